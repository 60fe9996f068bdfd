"""Trust: what a member of the group may make a worker do, and the key that makes one a member.

callables.py (the one allow-list for every name a peer sends: functions, classes, pickle
globals), methods.py (methods of values the worker owns), serialization.py (payloads: pickle
protocol 5 with tensors out of band, decoded by the guarded unpickler), pickle_scan.py (the
scan of a payload's opcodes before anything is built) and pickle_rules.py (what a payload may
build), secret.py (the group key the handshake of ``rpc/wire/auth.py`` proves).
"""
