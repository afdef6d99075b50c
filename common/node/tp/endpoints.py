"""Each rank's KV endpoint: one transport config for every rank of a prefill or decode
worker, and a follower rank's own endpoint.

Every rank of a disaggregated group has an endpoint on its own pool (a prefill rank a
``KvSender``, a decode rank a ``KvReceiver``) and moves the KV of its own heads. Rank 0
wraps its endpoint in a ``GroupSender``/``GroupReceiver`` (``transport.group``), which
records every call that starts or stops a transfer; a follower's endpoint
(``RankSender``/``RankReceiver``) repeats them, driven by its ``Mirror``. ``kv_config``
is the one recipe every rank's endpoint is built from (rank 0's and a one-rank worker's
too), so the ranks of a group cannot disagree on their settings.
"""

from __future__ import annotations

from common.auth import INSECURE, PlaneAuth, check_bind
from common.config import ServeConfig
from common.kv import KvCache
from transport import KvReceiver, KvSender, RankReceiver, RankSender, TransportConfig


def kv_config(cfg: ServeConfig, role: str, name: str, fingerprint: str, rank: int = 0,
              size: int = 1) -> TransportConfig:
    """The KV endpoint's settings of rank ``rank`` of a ``role`` worker (prefill, decode).

    A prefill sends only to the decode the router assigned (``require_capability``); a
    decode gives a new prefill's handshake ``kv_handshake_timeout_s`` to answer (a busy
    prefill answers between its passes). A transfer's overall deadline is the client's
    (``request_timeout_s``)."""
    settings = dict(node=name, model=cfg.model, model_digest=fingerprint, tp_rank=rank,
                    tp_size=size, heartbeat_s=cfg.heartbeat_s, lease_s=cfg.lease_s,
                    shared_memory=cfg.shared_memory, kv_transport=cfg.kv_transport,
                    chunk_timeout_s=cfg.kv_chunk_timeout_s,
                    done_timeout_s=cfg.request_timeout_s)
    if role == "prefill":
        return TransportConfig(**settings, require_capability=True)
    if role == "decode":
        return TransportConfig(**settings, handshake_timeout_s=cfg.kv_handshake_timeout_s)
    raise ValueError(f"a {role} worker has no KV endpoint")


def follower_endpoint(role: str, cfg: ServeConfig, name: str, rank: int, size: int,
                      cache: KvCache, fingerprint: str, kv_auth: dict, kv_bind: str = "",
                      kv_advertise: str = "") -> tuple[RankSender | RankReceiver, str]:
    """Follower ``rank``'s endpoint on its own pool, and the KV address it advertises:
    a prefill rank's sender binds at ``kv_bind`` (decodes dial ``kv_advertise``, else the
    bound address); a decode rank advertises none ("").

    ``kv_auth``: the KV plane's credentials rank 0 handed on (``PlaneAuth.to_dict``);
    empty in a deployment without keys.

    Raises:
        InsecureBind: a public ``kv_bind`` in a deployment without keys.
    """
    auth = PlaneAuth.kv_from_dict(kv_auth) if kv_auth else INSECURE
    config = kv_config(cfg, role, name, fingerprint, rank, size)
    node = f"{name}/tp{rank}"
    if role == "prefill":
        check_bind(kv_bind, secured=bool(kv_auth))
        sender = KvSender(cache, kv_bind, config, auth=auth)
        return RankSender(sender, node), kv_advertise or sender.address
    return RankReceiver(KvReceiver(cache, config, auth=auth), node), ""
