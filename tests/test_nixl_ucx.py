"""UCX, under NIXL, uses only the interfaces the deployment names (transport/nixl.py,
``restrict_ucx``): unnamed, loopback. A real NIXL agent in a fresh process (UCX reads its
environment once) shows it in the metadata it would hand a peer: with the default, none
of this machine's other addresses is in it; with ``all``, they are (the check can fail).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import subprocess
import sys

import pytest

from transport import nixl

_AGENT = """
import json, os, sys
from transport import nixl
agent = nixl.Agent("ucx-test")
print(json.dumps({"devices": os.environ.get("UCX_NET_DEVICES"),
                  "metadata": agent.metadata().hex()}))
"""


def _external_ipv4() -> list[str]:
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
            except OSError:
                continue
            if not addr.startswith("127."):
                out.append(addr)
    return out


def test_unnamed_interfaces_mean_loopback_and_a_named_one_is_kept():
    env: dict[str, str] = {}
    assert nixl.restrict_ucx(env) == "lo" and env == {"UCX_NET_DEVICES": "lo"}
    env = {"UCX_NET_DEVICES": "mlx5_0:1"}
    assert nixl.restrict_ucx(env) == "mlx5_0:1"
    from deploy.launch.cluster.ray_host import interface_of  # what Ray's actors name

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") == ""  # no interface of ours holds it
    for ip in _external_ipv4():
        assert interface_of(ip) not in ("", "lo"), ip


def _agent_metadata(devices: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    if devices is not None:
        env["UCX_NET_DEVICES"] = devices
    r = subprocess.run([sys.executable, "-c", _AGENT], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(bool(nixl.import_error()), reason="needs NIXL (pip install 'pdkv[nixl]')")
def test_an_agent_offers_peers_no_address_beyond_loopback():
    external = _external_ipv4()
    if not external:
        pytest.skip("this machine has no interface beyond loopback to keep UCX off")
    packed = [socket.inet_aton(a).hex() for a in external]
    default = _agent_metadata(None)
    assert default["devices"] == "lo"
    assert not any(p in default["metadata"] for p in packed), external
    everything = _agent_metadata("all")
    assert any(p in everything["metadata"] for p in packed), external
