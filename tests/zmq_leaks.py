"""Tracking of the ZMQ sockets and contexts a test makes, to fail one that leaks them."""

from __future__ import annotations

import zmq


class ZmqTracker:
    """Records every context and socket made while ``install``ed (on ``zmq.Context``)."""

    def __init__(self) -> None:
        self.contexts: list[zmq.Context] = []
        self.sockets: list[zmq.Socket] = []

    def install(self, monkeypatch) -> None:
        init, make_socket = zmq.Context.__init__, zmq.Context.socket
        tracker = self

        def tracked_init(self, io_threads=1, shadow=0, **kwargs):
            init(self, io_threads, shadow=shadow, **kwargs)
            if not shadow:   # a shadow wraps a context someone else terminates
                tracker.contexts.append(self)

        def tracked_socket(self, *args, **kwargs):
            sock = make_socket(self, *args, **kwargs)
            tracker.sockets.append(sock)
            return sock

        monkeypatch.setattr(zmq.Context, "__init__", tracked_init)
        monkeypatch.setattr(zmq.Context, "socket", tracked_socket)

    def leaks(self) -> str:
        """Close what is still open; return a message naming it ('' when nothing)."""
        open_sockets = [s for s in self.sockets if not s.closed]
        open_contexts = [c for c in self.contexts if not c.closed]
        for s in open_sockets:
            s.close(linger=0)
        for c in open_contexts:
            c.destroy(linger=0)
        if not open_sockets and not open_contexts:
            return ""
        kinds = sorted(s.type.name for s in open_sockets)
        return (f"leaked {len(open_sockets)} ZMQ socket(s) {kinds} and {len(open_contexts)} "
                "context(s): close sockets (linger=0) and terminate contexts before the "
                "test ends")
