"""`python -m shardwise` is the `shardwise` command."""

import sys

from shardwise.cli.main import main

sys.exit(main())
