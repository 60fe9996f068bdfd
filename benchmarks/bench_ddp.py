"""`shardwise bench ddp`, as a script: `python benchmarks/bench_ddp.py [options]` runs the same.

The benchmark lives in shardwise/bench/ddp.py.
"""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["ddp", *sys.argv[1:]]))
