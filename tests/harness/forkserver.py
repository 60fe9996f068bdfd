"""A multiprocessing forkserver of the harness's own, so that its rank processes start without
importing torch and shardwise again (seconds each on two cores).

multiprocessing has one forkserver per process, whose preloaded modules are fixed when it
starts; tests/compat/torch_zero uses that one with torch's test utilities preloaded, which the
harness's ranks must not hold. This module starts a second server (another
``multiprocessing.forkserver.ForkServer``) and a Process class whose processes fork from it:
each is a new process, forked from a server that has imported the preloaded modules and run
nothing else (no Python thread), started as multiprocessing's forkserver method starts them.
"""

from __future__ import annotations

import io
import os
from multiprocessing import forkserver, popen_forkserver, process, reduction, spawn, util
from multiprocessing.context import set_spawning_popen

_server = forkserver.ForkServer()


def set_preload(modules: list[str]) -> None:
    """What the server imports when it starts (at the first ``Process.start()``)."""
    _server.set_forkserver_preload(modules)


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):  # popen_forkserver.Popen._launch, with our server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = _server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class Process(process.BaseProcess):
    """``multiprocessing.Process``, its process forked from this module's server."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)
