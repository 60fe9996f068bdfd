"""Remote references: rref.py (``RRef``, the user's handle, and its proxies) and rref_context.py
(each worker's table of the RRefs it owns and holds, and their reference counting)."""
