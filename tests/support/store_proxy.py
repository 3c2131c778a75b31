"""A TCP proxy in front of a store server that holds up new connections, for the tests.

The ranks other than 0 reach rank 0's TCPStore through it. It forwards every connection
at once until the file ``hold_after`` exists (the ranks create it once their process group
has formed, however many connections that took), and holds every later one: accepted, but
not forwarded until the file ``release`` exists (``None``: until the proxy closes), or
closed at once with ``drop=True``, as by a store no longer reachable. Each
held connection also leaves a file ``held-N`` beside ``hold_after``, so that the ranks can
wait until theirs is held.
That is what a store's host does while it resolves a new client's name on a slow name
server, the cause of wrappers that hung in their construction.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from types import TracebackType


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


class HoldingProxy:
    """Listens on ``port`` (free, loopback) and forwards to ``target_port`` (see module)."""

    def __init__(
        self, target_port: int, hold_after: Path, release: Path | None, drop: bool = False
    ) -> None:
        self._target = target_port
        self._drop = drop
        self._hold_after = hold_after
        self._release = release
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self.accepted = 0
        self.held = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._sockets.append(conn)
            self.accepted += 1
            hold = self._hold_after.exists()
            if hold:
                self.held += 1
                (self._hold_after.parent / f"held-{self.held}").touch()
            threading.Thread(target=self._serve, args=(conn, hold), daemon=True).start()

    def _serve(self, conn: socket.socket, hold: bool) -> None:
        if hold and self._drop:
            conn.close()  # a store that cannot be reached any more
            return
        if hold:
            release = self._release
            while not self._closed.wait(0.05):
                if release is not None and release.exists():
                    break
            if self._closed.is_set():
                return
        upstream = self._connect_upstream()
        if upstream is None:
            conn.close()
            return
        self._sockets.append(upstream)
        threading.Thread(target=_pump, args=(upstream, conn), daemon=True).start()
        _pump(conn, upstream)

    def _connect_upstream(self) -> socket.socket | None:
        # A rank may reach the proxy before rank 0's store listens: keep trying, as a store
        # client does, until the store answers or the proxy closes.
        while not self._closed.is_set():
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target), timeout=5)
            except OSError:
                self._closed.wait(0.05)
                continue
            upstream.settimeout(None)
            return upstream
        return None

    def close(self) -> None:
        """Stop accepting and drop every connection."""
        self._closed.set()
        for s in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> HoldingProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
