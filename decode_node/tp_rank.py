"""A decode worker's follower rank: its KV receiver (its own pool, its own heads), which
announces what rank 0 announces to the prefill ranks holding its heads
(``transport.group``)."""

from __future__ import annotations

from common.auth import INSECURE, PlaneAuth
from common.node.tp import RankSetup
from decode_node.worker import kv_config
from transport import KvReceiver, RankReceiver


def decode_rank(setup: RankSetup) -> tuple[RankReceiver, str]:
    """This rank's receiver; a decode advertises no KV address ("")."""
    auth = PlaneAuth.kv_from_dict(setup.kv_auth) if setup.kv_auth else INSECURE
    receiver = KvReceiver(setup.cache, kv_config(
        setup.config, setup.name, setup.fingerprint, setup.rank, setup.size), auth=auth)
    return RankReceiver(receiver, f"{setup.name}/tp{setup.rank}"), ""
