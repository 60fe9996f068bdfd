"""The command line: `shardwise train | run`. Nothing imports this package."""
