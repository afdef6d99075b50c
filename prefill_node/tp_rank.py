"""A prefill worker's follower rank: its KV sender (its own pool, its own heads), which
repeats what rank 0's sender does (``transport.group``)."""

from __future__ import annotations

from common.auth import INSECURE, PlaneAuth, check_bind
from common.node.tp import RankSetup
from prefill_node.worker import kv_config
from transport import KvSender, RankSender


def prefill_rank(setup: RankSetup) -> tuple[RankSender, str]:
    """Bind this rank's sender at ``setup.kv_bind``; returns it and the address decodes
    dial (``kv_advertise``, else the bound one).

    Raises:
        InsecureBind: a public ``kv_bind`` in a deployment without keys.
    """
    auth = PlaneAuth.kv_from_dict(setup.kv_auth) if setup.kv_auth else INSECURE
    check_bind(setup.kv_bind, secured=bool(setup.kv_auth))
    sender = KvSender(setup.cache, setup.kv_bind, kv_config(
        setup.config, setup.name, setup.fingerprint, setup.rank, setup.size), auth=auth)
    return RankSender(sender, f"{setup.name}/tp{setup.rank}"), \
        setup.kv_advertise or sender.address
