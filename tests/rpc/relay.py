"""A relay between two RPC workers, as a local process without the group secret runs one: it
listens on a port of its own, forwards every byte both ways, and can inject bytes towards the
acceptor or change the connector's bytes on their way (issue 25's connection take-over)."""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    """Forwards one connection to ``target``; ``c2a`` holds every byte the connector sent."""

    def __init__(self, target: tuple[str, int], flip_at: int | None = None):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.target, self.flip_at = target, flip_at
        self.c2a = bytearray()
        self._to_acceptor: socket.socket | None = None
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True)]
        self._threads[0].start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self._listener.accept()
            up = socket.create_connection(self.target)
            self._to_acceptor = up
            self.ready.set()
            back = threading.Thread(target=self._pump, args=(up, conn, False), daemon=True)
            back.start()
            self._threads.append(back)
            self._pump(conn, up, True)

    def _pump(self, src: socket.socket, dst: socket.socket, towards_acceptor: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if towards_acceptor:
                    data = self._tap(bytearray(data))
                with self._lock:
                    dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _tap(self, data: bytearray) -> bytearray:
        start = len(self.c2a)
        self.c2a += data
        if self.flip_at is not None and start <= self.flip_at < start + len(data):
            data[self.flip_at - start] ^= 0x01
        return data

    def inject(self, raw: bytes) -> None:
        """Send ``raw`` to the acceptor as if the connector had sent it."""
        assert self._to_acceptor is not None
        with self._lock:
            self._to_acceptor.sendall(raw)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._to_acceptor is not None:
            with contextlib.suppress(OSError):
                self._to_acceptor.shutdown(socket.SHUT_RDWR)
