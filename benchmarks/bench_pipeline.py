"""`shardwise bench pipeline`, as a script: `python benchmarks/bench_pipeline.py [options]` runs
the same.

The benchmark lives in shardwise/bench/pipeline.py.
"""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["pipeline", *sys.argv[1:]]))
