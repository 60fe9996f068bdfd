"""Module-level state of shardwise that a reused process must forget between tests.

Pooled ranks (pool.py) and the test process itself run one test after another. A warn-once set
filled by one test would silence the warning that a later test expects, so the harness empties
each of these before every test: in each rank before a body runs (pool.py) and in the test
process by an autouse fixture (tests/conftest.py). A module not imported yet has nothing to
forget and is not imported here.
"""

from __future__ import annotations

import sys

# module-level sets of "already warned about" marks (once per process), by name, wherever the
# module that holds one lives: fsdp/fsdp1/args._WARNED, pipeline.stage._warned,
# sharded_tensor._warned_torch_only, signed_store._logged
WARN_ONCE_NAMES = ("_WARNED", "_warned", "_warned_torch_only", "_logged")


def reset_module_state() -> None:
    """Empty every warn-once set (WARN_ONCE_NAMES) of every loaded shardwise module."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "shardwise" or name.startswith("shardwise.")):
            continue
        for attr in WARN_ONCE_NAMES:
            marks = vars(module).get(attr)
            if isinstance(marks, set):
                marks.clear()
