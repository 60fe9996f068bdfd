"""`shardwise bench collectives`, as a script: `python benchmarks/bench_collectives.py` runs it.

The benchmark lives in shardwise/bench/collectives.py.
"""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["collectives", *sys.argv[1:]]))
