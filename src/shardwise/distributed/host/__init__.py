"""The same-host layer: what the ranks of one host share beyond the process group.

- segment.py: the one creator of shared-memory segments (private files in /dev/shm), and the
  rule of memory ordering that every protocol over them follows ([Note: memory ordering on one
  host]);
- same_host.py: whether a group's ranks share this host (``same_host``, ``on_one_host``);
- peers.py: copying bytes out of a peer's memory (``process_vm_readv``), after checking which
  process the peer is, and short notes between ranks through one segment with futex wake-ups
  (``NoteBoard``);
- libc.py: the one binding of the C library through ``ctypes``.

The mechanisms above keep only their own protocols: DDP's and ZeRO's same-host reduction
(dp/shm_reduce.py), FSDP's parameters held once per host and its peer-read gradient exchange
(fsdp/), RPC's shared-memory channel (rpc/wire/), and the C heap's release (memory/heap.py).
tests/test_layering.py checks that no other module creates segments or binds libc.
"""
