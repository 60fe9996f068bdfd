"""`shardwise bench mesh`, as a script: `python benchmarks/bench_mesh.py [options]` runs the same.

The benchmark lives in shardwise/bench/mesh.py.
"""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["mesh", *sys.argv[1:]]))
