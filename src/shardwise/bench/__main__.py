"""``python -m shardwise.bench NAME ...``: what `shardwise bench` runs, and how its ranks start."""

import sys

from shardwise.bench.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
