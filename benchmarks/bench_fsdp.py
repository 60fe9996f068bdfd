"""`shardwise bench fsdp`, as a script: `python benchmarks/bench_fsdp.py [options]` runs the same.

The benchmark lives in shardwise/bench/fsdp.py.
"""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["fsdp", *sys.argv[1:]]))
