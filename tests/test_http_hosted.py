"""The router in the front door's event loop (``deploy.http.hosted``): the bridge reaches
it by calls, other clients still reach it on its socket, with the same rights checked,
and a shutdown through it answers ``Bye``."""

from __future__ import annotations

import asyncio

import pytest

from common.auth import Keys, create_keys
from common.config import ServeConfig
from common.control import Bye, Shutdown, Submit, pack_ids
from deploy.http.bridge import RouterBridge
from deploy.http.hosted import HostedRouter
from deploy.router.client import Client

CFG = ServeConfig(heartbeat_s=0.2, lease_s=3.0)


@pytest.fixture
def keys(tmp_path) -> Keys:
    create_keys(tmp_path / "keys")
    return Keys(tmp_path / "keys")


def test_the_bridge_calls_the_router_and_the_socket_serves_others(tmp_path, keys):
    hosted = HostedRouter(f"ipc://{tmp_path}/router.sock", CFG, keys)
    outside = Client(hosted.address, "test", keys, identity="client")

    async def story():
        hosted.attach()
        bridge = RouterBridge(hosted.address, port=hosted.port("client"))
        bridge.start()
        view = await bridge.status(timeout_s=1.0)   # answered by a call: no socket
        assert view.config["page_size"] == CFG.page_size and not view.workers
        queue = bridge.submit(Submit("r1", pack_ids([1, 2, 3]), {"max_new_tokens": 2}))
        event = await asyncio.wait_for(queue.get(), 1.0)   # no worker: refused at once
        assert event.done and event.reason == "refused" and "worker" in event.error
        assert event.code == "unavailable"
        # a client on the socket is served by the same loop meanwhile
        status = await asyncio.to_thread(outside.status, 2.0)
        assert status.in_flight == 0 and status.config["page_size"] == CFG.page_size
        # and keeps its rights: a client may not shut the deployment down
        outside.send(Shutdown())
        await asyncio.sleep(0.2)
        assert hosted.router.shutdown_by is None
        assert hosted.router.errors["forbidden.Shutdown"] == 1
        await bridge.close()
        hosted.detach()
        return await hosted.shutdown(2.0)   # no worker: every stat is in at once

    try:
        bye = asyncio.run(story())
    finally:
        outside.close()
        hosted.close()
    assert isinstance(bye, Bye) and bye.stats == {}
    assert hosted.finished and hosted.closed


def test_a_local_port_of_a_client_may_not_shut_down(tmp_path, keys):
    hosted = HostedRouter(f"ipc://{tmp_path}/router.sock", CFG, keys)

    async def story():
        hosted.attach()
        port, got = hosted.port("client"), []
        port.attach(asyncio.get_running_loop(), got.append)
        port.send(Shutdown())
        port.close()
        hosted.detach()
        return got

    try:
        got = asyncio.run(story())
    finally:
        hosted.close()
    assert hosted.router.shutdown_by is None
    assert [type(m).__name__ for m in got] == ["Error"] and got[0].code == "forbidden"
