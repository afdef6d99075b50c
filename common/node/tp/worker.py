"""The ranks of a tensor-parallel worker: rank 0's setup, and the process of every other.

A worker of ``size`` ranks is ``size`` processes, one per device, started with the same
``--tp-address`` (rank 0 hosts the rendezvous there). Rank 0 is the worker the router
knows: it registers, receives the deployment's config, and broadcasts it (with its pool
size) to the other ranks, which build their shard of the model and a pool of their KV
heads, then follow rank 0 step by step (``common.node.tp.lockstep``). Only rank 0 talks
to the router; the other ranks have no socket but the group's.

Followers' metrics and final counters reach the router through rank 0, labelled
``rank`` (``common.node.tp.metrics``).

Each rank writes its own free log: ``<name>.freelog`` for rank 0, ``<name>.tp<r>.freelog``
for rank ``r`` (node ``<name>/tp<r>``), all in the worker's log directory; with offload,
each rank's host tier logs beside it (``<name>.host.freelog``, ``<name>.tp<r>.host.freelog``;
``common.node.tp.host``).

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
from urllib.parse import urlparse

import torch

from common.auth import Keys, SecretOffer, fetch_secret
from common.config import ServeConfig
from common.control import wait_any
from common.freelog import freelog_file
from common.kv import KvCache
from common.model import ModelRunner, TpModel
from common.node.pulse import Pulse
from common.node.tp.cache import LeaderKvCache, RankPins
from common.node.tp.endpoints import follower_endpoint
from common.node.tp.host import follower_host
from common.node.tp.lockstep import TAG_CONFIG, TAG_STEP, Lockstep, RankReport
from common.node.tp.metrics import RankMetrics, rank_stats
from common.node.tp.mirror import LeaderRunner, Mirror
from common.parallel import GroupLost, TpGroup
from transport import RankReceiver, RankSender

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TpSpec:
    """Where this process sits in its worker's group (``--tp-size/--tp-rank/--tp-address``)."""

    size: int
    rank: int
    address: str
    timeout_s: float = 30.0
    """Deadline of every collective (``--tp-timeout-s``)."""
    rendezvous_s: float = 120.0
    """Deadline of the rendezvous, a startup wait (``--tp-rendezvous-timeout-s``)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.rendezvous_s <= 0:
            raise ValueError(f"--tp-timeout-s {self.timeout_s} and --tp-rendezvous-timeout-s "
                             f"{self.rendezvous_s} must be > 0")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"--tp-rank {self.rank} must be in [0, --tp-size {self.size})")
        if self.size > 1 and not self.address:
            raise ValueError("--tp-size > 1 needs --tp-address tcp://HOST:PORT (rank 0's host)")


def freelog_path(log_dir: str | None, name: str, rank: int) -> str | None:
    return freelog_file(log_dir, name if rank == 0 else f"{name}.tp{rank}")


def leader_cache(spec: TpSpec, role: str, name: str, config: ServeConfig, num_pages: int,
                 device: str, log_dir: str | None, max_rows: int, *,
                 shared_memory: bool = False, kv_auth: dict | None = None,
                 keys: Keys | None = None, identity: str = "worker"
                 ) -> tuple[TpModel, LeaderKvCache, LeaderRunner]:
    """Rank 0: join the group, hand the others the config, build this rank's shard.

    ``kv_auth``: the KV plane's credentials from the router (``PlaneAuth.to_dict``),
    which the followers' endpoints present too. They never cross the group's own
    connection, which authenticates nothing: rank 0 offers them on a CURVE socket that
    only ``identity``'s key (from ``keys``, the one every rank runs with) may reach
    (``common.auth.handoff``); the group's setup carries the offer's address.

    Raises:
        ValueError: the group's size is not the config's (``prefill_tp``/``decode_tp``).
        GroupLost: a rank did not join within ``tp_timeout_s``.
    """
    if spec.size != config.role_tp(role):
        raise ValueError(f"{name}: started with --tp-size {spec.size}, the deployment's "
                         f"config has {config.role_tp(role)} rank(s) for a {role} worker")
    group = TpGroup.join(0, spec.size, spec.address, device, spec.timeout_s,
                         spec.rendezvous_s)
    shared = shared_memory and torch.device(device).type == "cpu"
    offer = _offer(spec, keys, identity) if kv_auth else None
    setup = {"config": config.to_dict(), "num_pages": num_pages, "max_rows": max_rows,
             "name": name, "role": role, "shared_memory": shared,
             "kv_auth_at": offer.address if offer else ""}
    group.broadcast_bytes(TAG_CONFIG, json.dumps(setup).encode())
    if offer is not None:
        try:
            offer.serve(json.dumps(kv_auth).encode(), spec.size - 1, spec.timeout_s)
        except TimeoutError as exc:
            raise GroupLost(f"{name}: {exc}") from None
    model, draft = _models(config, group, device)
    cache = LeaderKvCache(num_pages, config.page_size, layout=_layout(config, model),
                          device=device, log_path=freelog_path(log_dir, name, 0), node=name,
                          max_rows=max_rows, lockstep=Lockstep(group), shared_memory=shared)
    return model, cache, LeaderRunner(model, cache, draft)


def _offer(spec: TpSpec, keys: Keys | None, identity: str) -> SecretOffer:
    """Where rank 0 hands its followers the KV credentials: beside the rendezvous."""
    if keys is None:
        raise ValueError("KV-plane credentials without a key directory to hand them on with")
    return SecretOffer(keys, identity, urlparse(spec.address).hostname or "127.0.0.1")


class TpLeader:
    """Rank 0's group as its worker (``WorkerBase``) uses it, once its pool is built
    (``leader_cache``): followers kept in step, asked for their reports at every
    heartbeat, stopped after the pool closed."""

    def __init__(self, cache: LeaderKvCache) -> None:
        self.cache, self.lockstep = cache, cache.lockstep
        self.reports: list[RankReport] = []
        """The followers' last reports, in rank order."""

    def transport_cache(self) -> RankPins:
        """The pool as rank 0's KV transport uses it: its pins are its own, not mirrored."""
        return RankPins(self.cache)

    def keepalive(self) -> None:
        """After every tick: the ops recorded since the last step go out (followers hear
        from rank 0 all the same)."""
        self.lockstep.keepalive()

    def ask(self, final: bool = False) -> None:
        """Every follower's report (free-log problems, metrics; the final one, once the
        pools closed, its stats too; a group already lost then keeps the last ones).

        Raises:
            GroupLost: a follower is gone (not at the final ask).
        """
        try:
            self.reports = self.lockstep.health(final)
        except GroupLost as exc:
            if not final:
                raise
            logger.warning("the followers' final figures are missing: %s", exc)

    def problems(self) -> list[str]:
        """The followers' free logs that cannot write (rank 0 pauses admission on them)."""
        return [r.problems for r in self.reports if r.problems]

    def metrics(self) -> list[bytes]:
        """The followers' packed metric families, in rank order (labelled by rank)."""
        return [r.metrics for r in self.reports]

    def stats(self) -> dict:
        """The followers' final counters, ``tp<r>.<counter>``."""
        return rank_stats(self.reports)

    def stop(self) -> None:
        """After rank 0's pool closed: the last step, the followers close theirs."""
        self.lockstep.stop()


def _models(config: ServeConfig, group: TpGroup, device: str) -> tuple[TpModel, TpModel | None]:
    """This rank's shard of the target and of the draft checkpoint (if any).

    A draft checkpoint is sharded exactly as the target (heads and MLP split, the head's
    vocabulary sharded, logits gathered to rank 0): every rank runs its shard of every
    draft pass in the lockstep, as it does the target's, and keeps the draft's KV of its
    own heads in the first columns of its own rows. So the draft's KV of a request lives
    on every rank next to the target's and travels with it, and rank 0 samples the
    proposals from gathered logits as it does the target's tokens. Replicating the draft
    on every rank would keep a full draft's KV on each (rows are per rank) and run each
    proposal ``size`` times; running it on rank 0 alone would leave the followers without
    the draft KV a disaggregated decode rank needs."""
    dcfg = config.draft_model_config() if config.with_draft else None
    return (TpModel(config.model_config(), group, device),
            TpModel(dcfg, group, device) if dcfg is not None else None)


def check_draft_split(config: ServeConfig, role: str) -> None:
    """Refuse a disaggregated worker whose draft checkpoint's KV cannot be split by the
    transport's head mapping: a draft with narrower KV rows than the target keeps each
    rank's draft heads in the first columns of that rank's rows, which are other columns
    in a group of another size.

    Raises:
        ValueError: ``role`` is prefill or decode, the draft's KV rows are narrower than
            the target's, and ``prefill_tp != decode_tp``.
    """
    draft = config.draft_model_config() if config.with_draft else None
    if role not in ("prefill", "decode") or draft is None or \
            config.prefill_tp == config.decode_tp:
        return
    target = config.model_config()
    if draft.kv_size < target.kv_size:
        raise ValueError(
            f"draft checkpoint {config.draft_model_path}: its KV rows ({draft.kv_size} "
            f"values) are narrower than the target's ({target.kv_size}), so prefill_tp="
            f"{config.prefill_tp} and decode_tp={config.decode_tp} must be equal (or use "
            "a draft as wide as the target, the built-in draft layers, or n-gram)")


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


class _Leave(BaseException):
    """A follower signalled alone leaves its group (not an error of a collective: it
    passes through ``TpGroup``'s wrapping of failures into ``GroupLost``)."""


_TRANSPORT_WAIT_S = 0.02
"""Longest sleep of a follower with a KV transport: its heartbeats, leases and deadlines
move on at this pace, as rank 0's loop (``WorkerBase.idle_wait_s``)."""
_SIGNAL_WAIT_S = 0.25
"""Longest sleep of a follower without one: how soon it sees its grace pass."""


class FollowerWait:
    """How a follower waits for rank 0's next step (``TpGroup.broadcast_bytes``'s
    ``idle``): asleep on its KV transport's sockets and on the group's wake fd at once,
    so that it wakes the moment rank 0's step lands or a peer's message arrives, and at
    least every ``_TRANSPORT_WAIT_S`` for its transport's timers. The group's deadline
    still bounds the whole wait; a SIGTERM that rank 0 does not follow within ``grace``
    makes it leave."""

    def __init__(self, mirror: Mirror, asked: list[float], grace: float) -> None:
        self.mirror, self.asked, self.grace = mirror, asked, grace

    def __call__(self, wake_fd: int, left_s: float) -> None:
        self.check_signalled()
        endpoint = self.mirror.endpoint
        if endpoint is None:
            wait_any([wake_fd], min(left_s, _SIGNAL_WAIT_S))
            return
        wait_any([*endpoint.sockets(), wake_fd],
                 min(left_s, endpoint.poll_within() or _TRANSPORT_WAIT_S))
        endpoint.poll(0)

    def check_signalled(self) -> None:
        if self.asked and time.monotonic() - self.asked[0] > self.grace:
            raise _Leave


def _layout(config: ServeConfig, model: TpModel):
    """The deployment's layout with this rank's KV heads."""
    from dataclasses import replace

    return replace(config.kv_layout(), num_kv_heads=model.config.num_kv_heads)


def run_follower(spec: TpSpec, name: str, device: str, log_dir: str | None,
                 kv_bind: str = "", kv_advertise: str = "", keys: Keys | None = None,
                 identity: str = "worker") -> int:
    """Rank > 0 of worker ``name``: follow rank 0 until it stops (0) or is lost (3).

    A prefill or decode rank has its own KV endpoint (the KV of its heads moves between
    ranks directly); ``kv_bind`` / ``kv_advertise``: where a prefill rank's sender binds
    and what decodes dial. ``keys``/``identity``: what this rank fetches rank 0's KV
    credentials with (the same as rank 0's).

    Raises:
        InsecureBind: a prefill rank asked to bind a public ``kv_bind`` without keys.
    """
    group = TpGroup.join(spec.rank, spec.size, spec.address, device, spec.timeout_s,
                         spec.rendezvous_s)
    mirror = pulse = None
    try:
        setup = json.loads(group.broadcast_bytes(TAG_CONFIG, None))
        setup["kv_auth"] = _fetch_kv_auth(setup, keys, identity, spec)
        config = ServeConfig.from_dict(setup["config"])
        model, draft = _models(config, group, device)
        node = f"{name}/tp{spec.rank}"
        cache = KvCache(setup["num_pages"], config.page_size, layout=_layout(config, model),
                        device=device, log_path=freelog_path(log_dir, name, spec.rank),
                        node=node, max_rows=setup["max_rows"],
                        shared_memory=setup.get("shared_memory", False))
        runner = ModelRunner(model, cache, draft, graphs=False)  # rank 0's passes, as sent
        host = follower_host(config, cache, device, log_dir, f"{name}.tp{spec.rank}", node)
        endpoint = _endpoint(setup, spec, config, cache, runner.fingerprint, kv_bind,
                             kv_advertise, group)
        counting = RankMetrics(setup.get("role", "colocated"), cache, endpoint, host)
        mirror = Mirror(runner, spec.rank, endpoint, group, host=host)
        # this rank's KV peers get heartbeats while a long pass runs, as rank 0's do
        pulse = Pulse(node, lambda: endpoint.heartbeat() if endpoint is not None else 0,
                      config.heartbeat_s / 4, config.max_busy_s)
        runner.around_pass = lambda: pulse.computing(config.debug_step_delay_s)
        mirror.reporter = lambda final: counting.report(mirror.log_problems(final), final)
        logger.info("%s: following rank 0 (%d KV heads, %d pages)", node,
                    model.config.num_kv_heads, setup["num_pages"])
        wait = FollowerWait(mirror, _on_signals(), min(5.0, spec.timeout_s / 2))
        try:
            while mirror.apply(group.broadcast_bytes(TAG_STEP, None, wait)):
                if mirror.endpoint is not None:
                    mirror.endpoint.poll(0)  # steps may come back to back: never starve it
                wait.check_signalled()
        except _Leave:
            logger.warning("%s: signalled and rank 0 did not stop within %.0f s: "
                           "leaving the group", node, wait.grace)
        if not mirror.closed:  # rank 0 stopped without closing its pool: close ours
            mirror.abandon()
        return 0
    except GroupLost as exc:
        logger.error("%s/tp%d: %s; freeing this rank's pages", name, spec.rank, exc)
        if mirror is not None:
            mirror.abandon()
        return 3
    finally:
        if pulse is not None:
            pulse.close()
        if mirror is not None:
            mirror.close_endpoint()
        group.close()


def _fetch_kv_auth(setup: dict, keys: Keys | None, identity: str, spec: TpSpec) -> dict:
    """The KV credentials rank 0 offers (none when the deployment has no keys)."""
    where = setup.get("kv_auth_at", "")
    if not where:
        return {}
    if keys is None:
        raise GroupLost(f"tp rank {spec.rank}: rank 0 runs with keys and this rank without: "
                        "start every rank with the same --auth-keys")
    try:
        return json.loads(fetch_secret(keys, identity, where, spec.timeout_s))
    except TimeoutError as exc:
        raise GroupLost(f"tp rank {spec.rank}: {exc}") from None


def _endpoint(setup: dict, spec: TpSpec, config: ServeConfig, cache: KvCache,
              fingerprint: str, kv_bind: str, kv_advertise: str, group: TpGroup
              ) -> RankSender | RankReceiver | None:
    """This rank's KV endpoint (a disaggregated worker's), its address sent to rank 0
    (whose ``GroupSender``/``GroupReceiver`` gathers every rank's)."""
    role = setup.get("role", "colocated")
    if role == "colocated":
        return None
    endpoint, address = follower_endpoint(role, config, setup["name"], spec.rank, spec.size,
                                          cache, fingerprint, setup["kv_auth"], kv_bind,
                                          kv_advertise)
    group.gather_bytes(address.encode())
    return endpoint
