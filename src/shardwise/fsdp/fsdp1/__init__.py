"""torch FSDP1's surface over the FSDP runtime (``shardwise.fsdp``'s ``fully_shard``).

``FullyShardedDataParallel`` (wrapper.py) and its arguments (args.py), enums and state-dict
settings (config.py), state-dict types (state_dict.py), name-keyed optimizer state
(optim_state_dict.py, state_broadcast.py), ``summon_full_params`` (summon.py),
``clip_grad_norm_`` (clip_grad.py), auto-wrap policies (policies.py) and manual wrapping
(wrap.py). Users import these names from ``shardwise.fsdp``; this package's own ``__init__``
imports nothing, so that the runtime may use the pure policy functions without a cycle.
"""
