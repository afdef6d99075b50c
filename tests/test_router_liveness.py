"""The router notices a worker whose connection closed, on ipc and on tcp, with keys on:
the hub's socket monitor sees the connection go, the router pings every worker, and the
one whose connection is gone is lost then, not when its lease runs out (the lease here
is a minute, the heartbeat's pings 20 s apart). Real sockets, in process; the router's
loop is driven by hand."""

from __future__ import annotations

import logging
import time

import pytest

from common.auth import Keys, control_client, create_keys
from common.config import ServeConfig
from common.control import Link, Ready, Register, Registered
from deploy.router.router import Router


@pytest.fixture
def keys(tmp_path) -> Keys:
    create_keys(tmp_path / "keys")
    return Keys(tmp_path / "keys")


def _pump_until(router: Router, done, timeout_s: float = 15.0) -> None:
    """The router's loop (receive, dispatch, tick) until ``done()``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the router never got there"
        item = router.hub.recv(0.01)
        while item is not None:
            router.dispatch(*item)
            item = router.hub.recv(0)
        router.tick(time.monotonic())


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_worker_whose_connection_closes_is_lost_at_once(tmp_path, keys, transport,
                                                          caplog):
    address = f"ipc://{tmp_path}/r.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
    router = Router(address, ServeConfig(page_size=4, heartbeat_s=20.0, lease_s=60.0), keys)
    links = {}
    try:
        for name in ("d0", "d1"):
            links[name] = Link(router.ctx, router.address, name,
                               control_client(keys, "worker"))
            links[name].send(Register("decode", name, 1, keys.deployment_id))
        _pump_until(router, lambda: len(router.workers) == 2)
        for name, link in links.items():
            assert isinstance(link.recv(10), Registered)
            link.send(Ready(name, "", 400))
        _pump_until(router, lambda: all(w.ready for w in router.workers.values()))
        caplog.set_level(logging.INFO, logger="deploy.router.router")
        t0 = time.monotonic()
        links.pop("d0").close()                     # as a killed process's socket goes
        _pump_until(router, lambda: router.workers["d0"].lost)
        assert time.monotonic() - t0 < 10.0         # neither the lease nor a heartbeat
        assert "worker d0 (decode, pid 1) lost: its connection closed" in caplog.text
        assert not router.workers["d1"].lost
    finally:
        for link in links.values():
            link.close()
        router.close()
