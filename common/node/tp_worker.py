"""The ranks of a tensor-parallel worker: rank 0's setup, and the process of every other.

A worker of ``size`` ranks is ``size`` processes, one per device, started with the same
``--tp-address`` (rank 0 hosts the rendezvous there). Rank 0 is the worker the router
knows: it registers, receives the deployment's config, and broadcasts it (with its pool
size) to the other ranks, which build their shard of the model and a pool of their KV
heads, then follow rank 0 step by step (``common.model.tp_lockstep``). Only rank 0 talks
to the router; the other ranks have no socket but the group's.

Each rank writes its own free log: ``<name>.freelog`` for rank 0, ``<name>.tp<r>.freelog``
for rank ``r`` (node ``<name>/tp<r>``), all in the worker's log directory.

SIGTERM stops a follower only in step with rank 0 (see ``_on_signals``).

Failures: a rank that dies makes the others' next collective fail within
``tp_timeout_s``. Rank 0 then ends its requests (``aborted``, the router fails them to
their clients) and exits with status 1, so the router sees the worker lost; a follower
whose rank 0 is gone frees what it holds (``peer_lost``), closes its log and exits with
status 3.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import ServeConfig
from common.kv import KvCache
from common.model import (
    TAG_CONFIG,
    TAG_STEP,
    LeaderKvCache,
    LeaderRunner,
    Lockstep,
    Mirror,
    ModelRunner,
    TpModel,
)
from common.parallel import GroupLost, TpGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TpSpec:
    """Where this process sits in its worker's group (``--tp-size/--tp-rank/--tp-address``)."""

    size: int
    rank: int
    address: str
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"--tp-rank {self.rank} must be in [0, --tp-size {self.size})")
        if self.size > 1 and not self.address:
            raise ValueError("--tp-size > 1 needs --tp-address tcp://HOST:PORT (rank 0's host)")


def role_tp(config: ServeConfig, role: str) -> int:
    """Ranks a worker of ``role`` has in ``config``."""
    return config.prefill_tp if role == "prefill" else config.decode_tp


def freelog_path(log_dir: str | None, name: str, rank: int) -> str | None:
    if not log_dir:
        return None
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    suffix = "" if rank == 0 else f".tp{rank}"
    return str(Path(log_dir) / f"{name}{suffix}.freelog")


def leader_cache(spec: TpSpec, role: str, name: str, config: ServeConfig, num_pages: int,
                 device: str, log_dir: str | None, max_rows: int
                 ) -> tuple[TpModel, LeaderKvCache, LeaderRunner]:
    """Rank 0: join the group, hand the others the config, build this rank's shard.

    Raises:
        ValueError: the group's size is not the config's (``prefill_tp``/``decode_tp``), or
            the role cannot run tensor-parallel yet.
        GroupLost: a rank did not join within ``tp_timeout_s``.
    """
    if spec.size != role_tp(config, role):
        raise ValueError(f"{name}: started with --tp-size {spec.size}, the deployment's "
                         f"config has {role_tp(config, role)} rank(s) for a {role} worker")
    if role != "colocated":
        raise ValueError(f"{name}: tensor-parallel {role} workers are not built yet (the "
                         "KV transfer of a group is per rank); use colocated workers")
    group = TpGroup.join(0, spec.size, spec.address, device, spec.timeout_s)
    setup = {"config": config.to_dict(), "num_pages": num_pages, "max_rows": max_rows,
             "name": name}
    group.broadcast_bytes(TAG_CONFIG, json.dumps(setup).encode())
    model = TpModel(config.model_config(), group, device)
    lockstep = Lockstep(group)
    cache = LeaderKvCache(num_pages, config.page_size, layout=_layout(config, model),
                          device=device, log_path=freelog_path(log_dir, name, 0), node=name,
                          max_rows=max_rows, lockstep=lockstep)
    return model, cache, LeaderRunner(model, cache)


def _on_signals() -> list[float]:
    """SIGTERM/SIGINT only mark the time: rank 0, signalled too when the whole worker
    stops, closes its pool and sends the last step, and this rank closes its own log in
    step with it. A rank signalled alone leaves after a grace period (rank 0 then sees
    the group lost)."""
    asked: list[float] = []

    def mark(_signum, _frame) -> None:
        if not asked:
            asked.append(time.monotonic())

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, mark)
    return asked


def _layout(config: ServeConfig, model: TpModel):
    """The deployment's layout with this rank's KV heads."""
    from dataclasses import replace

    return replace(config.kv_layout(), num_kv_heads=model.config.num_kv_heads)


def run_follower(spec: TpSpec, name: str, device: str, log_dir: str | None) -> int:
    """Rank > 0 of worker ``name``: follow rank 0 until it stops (0) or is lost (3)."""
    group = TpGroup.join(spec.rank, spec.size, spec.address, device, spec.timeout_s)
    mirror = None
    try:
        setup = json.loads(group.broadcast_bytes(TAG_CONFIG, None))
        config = ServeConfig.from_dict(setup["config"])
        model = TpModel(config.model_config(), group, device)
        node = f"{name}/tp{spec.rank}"
        cache = KvCache(setup["num_pages"], config.page_size, layout=_layout(config, model),
                        device=device, log_path=freelog_path(log_dir, name, spec.rank),
                        node=node, max_rows=setup["max_rows"])
        mirror = Mirror(ModelRunner(model, cache), spec.rank)
        logger.info("%s: following rank 0 (%d KV heads, %d pages)", node,
                    model.config.num_kv_heads, setup["num_pages"])
        asked = _on_signals()
        grace = min(5.0, spec.timeout_s / 2)
        while mirror.apply(group.broadcast_bytes(TAG_STEP, None)):
            if asked and time.monotonic() - asked[0] > grace:
                logger.warning("%s: signalled and rank 0 did not stop within %.0f s: "
                               "leaving the group", node, grace)
                break
        if not mirror.closed:  # rank 0 stopped without closing its pool: close ours
            mirror.abandon()
        return 0
    except GroupLost as exc:
        logger.error("%s/tp%d: %s; freeing this rank's pages", name, spec.rank, exc)
        if mirror is not None:
            mirror.abandon()
        return 3
    finally:
        group.close()
