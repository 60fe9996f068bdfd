"""`shardwise bench NAME`: our implementations and torch's counterparts side by side.

Each benchmark module defines ``BENCH`` (a ``SideBySide``: the implementations and what each
rank runs) or a ``run(argv)`` of its own (collectives); ``BENCHES`` maps the names `shardwise
bench` takes to those modules, imported only when chosen. A run prints a table and, with
``--out DIR``, writes ``DIR/NAME.json`` (the record: every number the table prints, and each
round's) and ``DIR/NAME.png`` (step time and peak memory per implementation with the spread
across rounds, and each row's physical limit); records.py renders a record as a table,
page.py writes docs/benchmarks.md from docs/records/, limits.py measures what each strategy's
limit is made of, and cuda_overlap.py adds what ``--device cuda`` measures.
"""

BENCHES = {
    "ddp": "shardwise.bench.ddp",
    "zero": "shardwise.bench.zero",
    "fsdp": "shardwise.bench.fsdp",
    "tp": "shardwise.bench.tp",
    "collectives": "shardwise.bench.collectives",
    "rpc": "shardwise.bench.rpc",
    "mesh": "shardwise.bench.mesh",
    "pipeline": "shardwise.bench.pipeline",
}

__all__ = ["BENCHES"]
