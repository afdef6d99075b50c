"""A client of the router: submit requests, abort them, collect streamed results."""

from __future__ import annotations

import time

import zmq

from common.node import Link, pack_ids


class Client:
    """One DEALER connection to the router.

    ``poll`` returns the router's messages: ``tokens`` (rid, ids, first), ``done`` (rid,
    reason, n, xfer_s, kv_bytes, error) and ``error`` (rid, error) for refused requests.
    """

    def __init__(self, address: str, name: str = "client") -> None:
        self.ctx = zmq.Context()
        self.link = Link(self.ctx, address, name)

    def submit(self, rid: str, prompt: list[int], params: dict | None = None) -> None:
        self.link.send({"t": "submit", "rid": rid, "prompt": pack_ids(prompt),
                        "params": params or {}})

    def submit_raw(self, msg: dict) -> None:
        """Send any message (tests send malformed requests this way)."""
        self.link.send(msg)

    def abort(self, rid: str) -> None:
        self.link.send({"t": "abort", "rid": rid})

    def poll(self, timeout_s: float = 0.0) -> list[dict]:
        first = self.link.recv(timeout_s)
        return [] if first is None else [first, *self.link.recv_all()]

    def request(self, msg: dict, answer: str, timeout_s: float) -> dict:
        """Send ``msg`` and wait for the first message of type ``answer``.

        Raises:
            TimeoutError: no answer within ``timeout_s``.
        """
        self.link.send(msg)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = self.link.recv(left)
            if got is not None and got["t"] == answer:
                return got
        raise TimeoutError(f"router did not answer {msg['t']} within {timeout_s}s")

    def status(self, timeout_s: float = 1.0) -> dict:
        return self.request({"t": "status"}, "status", timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> dict:
        """Ask the router to stop every worker; returns each worker's final stats."""
        return self.request({"t": "shutdown"}, "bye", timeout_s)["stats"]

    def close(self) -> None:
        self.link.close()
        self.ctx.term()
