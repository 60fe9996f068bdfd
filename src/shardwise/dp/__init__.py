"""The data-parallel core that DDP, ZeRO and FSDP share: gradient buckets filled during backward
and launched in order (grad_buckets.py), torch's communication-hook protocol (comm_hooks.py),
wrap-time state sync, the sharded gradient norm (data_parallel.py), the check that every rank
built the same model (agree.py), flat all-gather / reduce-scatter done the fastest way per
backend (fast_collectives.py; through shared memory on one host, shm_reduce.py), and the hook a
wrapper puts on its forward's outputs to act when backward reaches them (output_hooks.py).

It imports only ``shardwise.distributed`` (tests/test_layering.py).
"""
