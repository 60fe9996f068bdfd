"""`shardwise bench tp`, as a script: `python benchmarks/bench_tp.py [options]` runs the same.

The benchmark lives in shardwise/bench/tp.py.
"""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["tp", *sys.argv[1:]]))
