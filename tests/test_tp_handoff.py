"""The KV plane's credentials reach a tensor-parallel worker's followers over CURVE, never
over the group's own connection (common/auth/handoff.py, common/node/tp/worker.py): real
ranks in their own processes, a real gloo group on loopback, real key directories."""

from __future__ import annotations

import json

import pytest

from common.auth import Keys, SecretOffer, create_keys, fetch_secret, new_kv_plane
from common.node.tp import TpSpec
from common.node.tp.worker import TAG_CONFIG, _fetch_kv_auth, _offer
from common.parallel import TpGroup
from tests.tp_helpers import run_ranks

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def keydir(tmp_path):
    create_keys(tmp_path / "keys")
    return tmp_path / "keys"


def test_only_the_workers_own_key_fetches_the_secret(keydir, tmp_path):
    keys = Keys(keydir)
    offer = SecretOffer(keys, "worker", "127.0.0.1")
    assert offer.address.startswith("tcp://127.0.0.1:")
    create_keys(tmp_path / "other")  # another deployment's worker key
    with pytest.raises(TimeoutError, match="other keys"):
        fetch_secret(Keys(tmp_path / "other"), "worker", offer.address, 1.0)
    with pytest.raises(TimeoutError, match="did not fetch"):
        offer.serve(b"s3cret", 1, 1.0)   # the stranger got nothing, so nobody fetched
    offer = SecretOffer(keys, "worker", "127.0.0.1")
    import threading
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(fetch_secret(keys, "worker",
                                                                offer.address, 10.0)))
    t.start()
    offer.serve(b"s3cret", 1, 10.0)
    t.join(10)
    assert got == [b"s3cret"]


def _ranks(rank: int, size: int, address: str, keydir: str, creds: dict) -> dict:
    """Rank 0 hands on ``creds`` as ``leader_cache`` does; the others fetch them as
    ``run_follower`` does. Returns what crossed the group and what each rank holds."""
    spec = TpSpec(size, rank, address, 20.0)
    keys = Keys(keydir)
    group = TpGroup.join(rank, size, address, "cpu", 20.0)
    try:
        if rank == 0:
            offer = _offer(spec, keys, "worker")
            setup = json.dumps({"kv_auth_at": offer.address}).encode()
            group.broadcast_bytes(TAG_CONFIG, setup)
            offer.serve(json.dumps(creds).encode(), size - 1, 20.0)
            return {"sent": setup.decode(), "holds": creds}
        setup = json.loads(group.broadcast_bytes(TAG_CONFIG, None))
        return {"got": setup, "holds": _fetch_kv_auth(setup, keys, "worker", spec)}
    finally:
        group.close()


def test_followers_get_the_kv_credentials_but_the_group_never_carries_them(keydir):
    creds = new_kv_plane("curve").to_dict()
    results = run_ranks(_ranks, 3, str(keydir), creds)
    assert [r["holds"] for r in results] == [creds] * 3
    for secret in (creds["secret"], creds["public"]):
        assert secret not in results[0]["sent"]  # the group's bytes: an address, no key
    assert results[1]["got"]["kv_auth_at"].startswith("tcp://127.0.0.1:")


def test_on_ray_a_groups_rendezvous_is_on_loopback(tmp_path):
    """Every rank of a group shares its rank 0's node (STRICT_PACK), so the rendezvous
    binds loopback there, not the node's address (no Ray needed to read the plan)."""
    import shutil

    from common.config import ServeConfig
    from deploy.launch.cluster.ray_host import TP_PLACEHOLDER
    from deploy.launch.cluster.ray_launch import RayCluster

    cluster = RayCluster(ServeConfig(prefill_tp=2, decode_tp=2, offload=False), "disagg",
                         1, 1, str(tmp_path))
    try:
        ranks = {p.name: p.argv[p.argv.index("--tp-address") + 1] for p in cluster.procs
                 if "--tp-address" in p.argv}
        assert ranks == {"prefill0": "tcp://127.0.0.1:{lport}", "prefill0.tp1": TP_PLACEHOLDER,
                         "decode0": "tcp://127.0.0.1:{lport}", "decode0.tp1": TP_PLACEHOLDER}
    finally:
        shutil.rmtree(cluster.sock_dir, ignore_errors=True)
