"""`shardwise bench zero`, as a script: `python benchmarks/bench_zero.py [options]` runs the same.

The benchmark lives in shardwise/bench/zero.py.
"""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["zero", *sys.argv[1:]]))
