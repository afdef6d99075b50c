"""The front door's view of the deployment across the router's status answers: what it
derives from the config (``/v1/models``' max_model_len, which reads a checkpoint's
config.json) is built once per config, not once per answer (one comes every
``status_interval_s``)."""

from __future__ import annotations

import pytest

from common.config import ServeConfig
from common.control import CODEC, StatusReport
from deploy.http.app import FrontDoor
from deploy.http.bridge import RouterBridge

WORKERS = {"p0": {"role": "prefill", "ready": True, "lost": False, "pid": 1, "paused": ""},
           "d0": {"role": "decode", "ready": True, "lost": False, "pid": 2, "paused": ""}}


def _status(config: dict) -> StatusReport:
    # through the codec, as it comes off the wire: a new dict every time
    return CODEC.decode(CODEC.encode(StatusReport(WORKERS, 0, config)))


@pytest.fixture
def door():
    bridge = RouterBridge("ipc:///nonexistent/pdkv-router.sock")   # nothing is sent
    yield FrontDoor(bridge)
    bridge._port.close()


def test_an_unchanged_config_keeps_what_was_derived_from_it(door, monkeypatch):
    reads = []
    real = ServeConfig.model_config
    monkeypatch.setattr(ServeConfig, "model_config",
                        lambda self: reads.append(self) or real(self))
    config = ServeConfig().to_dict()
    door.bridge._dispatch(_status(config))
    first = door.view()
    max_len, n_reads = door.max_model_len(first), len(reads)
    assert n_reads
    for _ in range(3):                                   # three more status answers
        door.bridge._dispatch(_status(config))
    later = door.view()
    assert later is not first and later.config is first.config
    assert door.max_model_len(later) == max_len and len(reads) == n_reads


def test_a_changed_config_is_taken_up(door):
    door.bridge._dispatch(_status(ServeConfig().to_dict()))
    before = door.view()
    small = ServeConfig(decode_pages=64, page_size=4)
    door.bridge._dispatch(_status(small.to_dict()))
    after = door.view()
    assert after.config is not before.config and after.config["decode_pages"] == 64
    assert door.max_model_len(after) == small.pool_tokens("decode") != \
        door.max_model_len(before)
