"""For benchmark scripts in this folder that are not in the package (bench_pipeline.py): the
side-by-side runner now lives in shardwise/bench/sidebyside.py; `shardwise bench NAME` runs the
packaged ones.

A benchmark script calls ``main(worker, impls, baseline, extra)`` where
``worker(impl, args, group)`` runs on every rank and returns ``(step_times_seconds, extra)``.
"""

from shardwise.bench.sidebyside import script_main as main

__all__ = ["main"]
