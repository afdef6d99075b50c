"""The transport's metrics read off real endpoints and scraped over HTTP as Prometheus
does: handshake failures by the field that differed (and credentials refused), on both
ends of each failed handshake.

One prefill (``KvSender``) and four decodes (``KvReceiver``) in this process over real
ZMQ sockets (TCP on loopback, PLAIN credentials), all polled from the test's one thread:
nothing waits, so every handshake, good or bad, runs to its end."""

from __future__ import annotations

import time

import pytest

from common.auth import new_kv_plane
from common.metrics import MetricsServer, NodeMetrics
from tests.metrics_helpers import by, scrape
from tests.transport_helpers import config, layout, make_cache
from transport import KvReceiver, KvSender
from transport.metrics import transport_readings

pytestmark = pytest.mark.timeout(60)
FAILURES = "pdkv_transfer_handshake_failures_total"


def _scrape(endpoint, role: str, direction: str) -> dict:
    """The endpoint's transport readings served by a real ``MetricsServer``, scraped."""
    node = NodeMetrics(role)
    node.read(lambda: transport_readings(endpoint, direction))
    server = MetricsServer(node.collect)
    try:
        return scrape(server.url)
    finally:
        server.close()


def test_handshake_failures_are_counted_by_field_on_both_ends():
    auth = new_kv_plane("plain")
    tx = KvSender(make_cache(64, 4, layout(), node="p"), "tcp://127.0.0.1:*",
                  config("p"), auth=auth)
    decodes = {   # name -> (receiver, field its handshake fails on)
        "d_dtype": (KvReceiver(make_cache(64, 4, layout(dtype="float16"), node="d_dtype"),
                               config("d_dtype"), auth=auth), "dtype"),
        "d_page": (KvReceiver(make_cache(64, 8, layout(), node="d_page"), config("d_page"),
                              auth=auth), "page_size"),
        "d_stranger": (KvReceiver(make_cache(64, 4, layout(), node="d_stranger"),
                                  config("d_stranger", handshake_timeout_s=1.0),
                                  auth=new_kv_plane("plain")), "none"),  # other password
        "d_ok": (KvReceiver(make_cache(64, 4, layout(), node="d_ok"), config("d_ok"),
                            auth=auth), ""),
    }
    try:
        groups = {name: rx.begin_connect(tx.address) for name, (rx, _) in decodes.items()}
        deadline = time.monotonic() + 20
        while any(rx.link.is_connecting(groups[n]) for n, (rx, _) in decodes.items()):
            assert time.monotonic() < deadline, "handshakes still under way"
            tx.poll(0.0)
            for rx, _ in decodes.values():
                rx.poll(0.002)
        prefill = _scrape(tx, "prefill", "sent")
        got = by(prefill, FAILURES, ("reason", "field"))
        assert got.pop(("refused", "auth")) >= 1        # the stranger's every attempt
        assert {k: v for k, v in got.items() if v} == {
            ("mismatch", "dtype"): 1.0, ("mismatch", "page_size"): 1.0}
        assert by(prefill, "pdkv_transfer_data_path", ("path",)) == {("tcp",): 1.0}
        for name, (rx, field) in decodes.items():
            got = {k: v for k, v in by(_scrape(rx, "decode", "received"), FAILURES,
                                       ("reason", "field")).items() if v}
            want = {} if not field else {("timeout", "none"): 1.0} if field == "none" \
                else {("mismatch", field): 1.0}
            assert got == want, name
            assert rx.group_lost(groups[name]) == bool(field), name
    finally:
        for rx, _ in decodes.values():
            rx.close()
        tx.close()
