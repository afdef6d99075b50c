"""The front door's view of the deployment across the router's status answers: what it
derives from the config (limits, the tokenizer) is built once per config, not once per
answer (one comes every ``status_interval_s``)."""

from __future__ import annotations

import pytest

from common.config import ServeConfig
from common.control import CODEC, StatusReport
from deploy.http import app as app_module
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


def test_an_unchanged_config_keeps_its_tokenizer_and_limits(door, monkeypatch):
    loads = []
    real = app_module.load_text_model
    monkeypatch.setattr(app_module, "load_text_model",
                        lambda config: loads.append(config) or real(config))
    config = ServeConfig().to_dict()
    door.bridge._dispatch(_status(config))
    first = door.view()
    text, limits = door.text(first), door.limits(first)
    for _ in range(3):                                   # three more status answers
        door.bridge._dispatch(_status(config))
    later = door.view()
    assert later is not first and later.config is first.config
    assert door.text(later) is text and door.limits(later) is limits
    assert len(loads) == 1


def test_a_changed_config_is_taken_up(door):
    door.bridge._dispatch(_status(ServeConfig().to_dict()))
    before = door.view()
    door.bridge._dispatch(_status(ServeConfig(max_new_tokens_limit=64).to_dict()))
    after = door.view()
    assert after.config is not before.config and after.config["max_new_tokens_limit"] == 64
    assert door.limits(after).max_new_tokens == 64 != door.limits(before).max_new_tokens
