"""`shardwise bench rpc`, as a script: `python benchmarks/bench_rpc.py [options]` runs the same.

The benchmark lives in shardwise/bench/rpc.py.
"""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["rpc", *sys.argv[1:]]))
