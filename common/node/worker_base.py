"""What every worker process shares: its link to the router, registration, heartbeats,
the main loop, shutdown.

A worker is a function: build, report ready, loop, exit cleanly::

    __init__ (no I/O) -> serve(): connect -> Register -> Registered(config)
        -> start(config): build (model, pool, KV sockets) -> Ready -> loop
        -> Shutdown -> close (free everything, Stats)

    router silent past the lease, or it says we were lost:
        -> abandon (end every request, keep the pools) -> Register again every
           heartbeat for ``rejoin_s`` -> Registered (same config) -> Ready -> loop

    SIGTERM while serving (a second one, or SIGINT, stops at once):
        -> Drain to the router, serve on (the router routes nothing new here and moves
           what is left after ``drain_timeout_s``) -> Shutdown -> close; holding
           nothing, it waits for that Shutdown one heartbeat at most

Constructing a worker touches no network: tests build one over a fake ``ControlLink``
and call ``start(config)``, ``dispatch(msg)`` and ``tick()`` directly. The loop
alternates control messages from the router, one ``tick`` of work, and ``Load`` reports
(which double as heartbeats). A router silent past the lease ends the worker: a worker
never outlives its deployment.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import replace

import torch
import zmq

import common.trace as trace
from common.auth import INSECURE, Keys, PlaneAuth, control_client, events_server
from common.config import ServeConfig
from common.control import (
    Abort,
    ControlLink,
    Drain,
    Error,
    Link,
    Load,
    Malformed,
    Message,
    Ping,
    Ready,
    Register,
    Registered,
    Req,
    Shutdown,
    Stats,
    StepTokens,
    Stop,
    wait_any,
)
from common.freelog import configure as configure_freelog
from common.freelog import freelog_file, log_problems
from common.kv import KvCache, reclaim_orphans, segment_stem
from common.model import Model, ModelRunner
from common.node import stop_signals
from common.node.events import EventsSpec, WorkerEvents
from common.node.pulse import Pulse
from common.node.registration import RouterLost, check_deployment, register
from common.node.tp import TpLeader, TpSpec, check_draft_split, leader_cache
from common.node.worker_metrics import WorkerMetrics
from common.parallel import GroupLost
from common.sizing import device_pool_pages, torch_threads

logger = logging.getLogger(__name__)
_FAREWELL_S = 1.0
"""How long a closing worker lets its final report and stats reach the router (only a
router that is gone makes it wait that long)."""


class FreeLogFailed(RuntimeError):
    """A free log of this worker cannot write and ``freelog_on_error`` is ``exit``."""


class WorkerBase(ABC):
    """Base of prefill, decode and colocated workers.

    Args:
        name: unique worker name (logs, free log file name, router bookkeeping).
        router: the router's address, or a ``ControlLink`` already made (tests).
        device: 'cpu' or 'cuda:N'.
        log_dir: directory for this worker's free log (``<name>.freelog``); None: no log.
        register_timeout_s: how long ``serve`` waits for the router to answer.
        local_models: ``model_path`` / ``draft_model_path`` of this host's copies of the
            deployment's checkpoints (``pdkv prefill --model DIR``); empty: the router's.
        keys: the deployment's key directory (CURVE to the router); None: no keys.
        identity: the key directory's identity this worker runs as (role ``worker``).
        events: publish the worker's KV events there (common/node/events.py); None: not.
    """

    role = "worker"

    def __init__(self, name: str, router: str | ControlLink, device: str = "cpu",
                 log_dir: str | None = None, register_timeout_s: float = 60.0, *,
                 local_models: dict[str, str] | None = None, tp: TpSpec | None = None,
                 keys: Keys | None = None, identity: str = "worker",
                 events: EventsSpec | None = None) -> None:
        self.name, self.device, self.log_dir = name, device, log_dir
        self.tp_spec = tp if tp is not None and tp.size > 1 else None
        """Where rank 0 of a tensor-parallel group finds its ranks; None: one rank."""
        self.tp: TpLeader | None = None
        """Rank 0's group, once built (common/node/tp/worker.py); None: one rank."""
        # This host's copies of the checkpoints (model_path, draft_model_path) replace
        # the router's paths; the KV handshake's weights fingerprint proves they match.
        self.local_models = dict(local_models or {})
        self.router_addr = router if isinstance(router, str) else ""
        self.link: ControlLink | None = router if isinstance(router, ControlLink) else None
        self.register_timeout_s = register_timeout_s
        self.deployment = keys.deployment_id if keys else ""
        self.keys, self.identity = keys, identity
        self.control_auth = control_client(keys, identity)
        """How this worker's link authenticates to the router (raises ``KeysError`` now,
        before any I/O, when the key directory lacks ``identity``)."""
        self.kv_auth: PlaneAuth = INSECURE
        """How this worker's KV sockets authenticate (from the router's ``Registered``)."""
        self.events_spec = events
        self.events_auth = events_server(keys, identity) if events else INSECURE
        """How its KV events sockets authenticate (raises ``KeysError`` now, as above)."""
        self.events: WorkerEvents | None = None
        self.events_stats: dict = {}
        self.ctx = zmq.Context()
        self.config: ServeConfig | None = None
        self.cache: KvCache | None = None
        self.built = False
        self.stopping = False
        self._last_router = self._next_load = 0.0
        self.paused = ""  # why no new work is admitted (a free log cannot write); "" admits
        self.drain_asked = False
        """A SIGTERM came while serving: drain (``_tick_drain``)."""
        self.draining = 0.0
        """When this worker began draining; 0: it is not."""
        self._drain_wait = 0.0
        self.pulse: Pulse | None = None
        """Heartbeats while a step runs (from ``start``)."""
        self._last_load: Load | None = None
        self.counting = WorkerMetrics(self.role, self.metric_readings)
        self.metrics = self.counting.metrics
        """This process's metrics; parts that count take their metric objects from it."""

    # -- life ------------------------------------------------------------------------------
    def serve(self) -> None:
        """Connect and register, build from the deployment's config, report ready, loop
        until the router says shutdown (or is lost); then close.

        Raises:
            RouterLost: no answer to the registration, or the router went silent.
        """
        try:
            if self.link is None:
                self.link = Link(self.ctx, self.router_addr, self.name, self.control_auth)
            self.start(self._register(self.register_timeout_s))
            self._loop()
        finally:
            self.close()

    def start(self, config: ServeConfig) -> None:
        """Build from ``config`` and report ready (``serve`` does this once registered)."""
        self.config = config
        self.pulse = Pulse(self.name, self._beat_outside, config.heartbeat_s / 4,
                           config.max_busy_s)
        configure_freelog(max_buffer_bytes=config.freelog_max_buffer_kib << 10)
        if config.debug_build_delay_s:  # test aid: a checkpoint that loads slowly
            time.sleep(config.debug_build_delay_s)
        self.reclaim_segments()   # a killed worker of this deployment may have left some
        self.build()
        self.built = True
        self._start_events()
        self._last_router = self._next_load = time.monotonic()
        self._last_load = self.load()
        pool = self.cache.num_free_pages() * config.page_size if self.cache else 0
        self.link.send(self._ready(pool))
        logger.info("%s: ready (%s, pool %d tokens, kv %s)", self.name, self.role, pool,
                    self.kv_address() or "-")

    def _ready(self, pool: int) -> Ready:
        events = self.events.addresses if self.events is not None else ("", "")
        return Ready(self.name, self.kv_address(), pool, *events)

    def _start_events(self) -> None:
        """Publish the caches' KV events (``events``), before any entry is cached."""
        if self.events_spec is None:
            return
        self.events = WorkerEvents(self.events_spec, self.events_auth, self.ctx)
        self.events.watch(self.host_offloader(), self.config.page_size)
        logger.info("%s: KV events at %s (replay %s)", self.name, *self.events.addresses)

    def _close_events(self) -> None:
        """After the caches' last change: their state for the final stats, then the
        last batch (``AllBlocksCleared``)."""
        if self.events is not None:
            self.events_stats = self.events.state()
            self.events.close()
            self.events = None

    def _register(self, timeout_s: float) -> ServeConfig:
        msg = register(self.link, self.role, self.name, self.router_addr, timeout_s,
                       self.deployment)
        if self.deployment:
            self.kv_auth = PlaneAuth.kv_from_dict(msg.kv_auth)
        return self._own(ServeConfig.from_dict(msg.config))

    def _own(self, config: ServeConfig) -> ServeConfig:
        """The deployment's config with this host's checkpoint paths."""
        if not self.local_models:
            return config
        return ServeConfig.from_dict({**config.to_dict(), **self.local_models})

    def make_cache(self, shared_memory: bool = False, num_pages: int | None = None
                   ) -> tuple[Model, KvCache, ModelRunner]:
        """Model (and draft checkpoint), pool (recording to ``<log_dir>/<name>.freelog``)
        and runner. The pool has ``num_pages``, by default as many as the role's memory
        budget holds on this worker's device (``common.sizing``).

        ``shared_memory`` puts a CPU pool in named shared memory (peers on this host copy
        into it directly); ignored for device pools."""
        cfg = self.config
        check_draft_split(cfg, self.role)
        if num_pages is None:
            num_pages = device_pool_pages(cfg, self.role, self.device)
        if self.tp_spec is not None or cfg.role_tp(self.role) > 1:
            model, cache, runner = self._make_tp_cache(num_pages, shared_memory)
        else:
            model, cache, runner = self._make_solo_cache(num_pages, shared_memory)
        runner.around_pass = self.computing  # heartbeats go on while a pass runs
        return model, cache, runner

    def _make_solo_cache(self, num_pages: int, shared_memory: bool
                         ) -> tuple[Model, KvCache, ModelRunner]:
        cfg = self.config
        model = Model(cfg.model_config(), device=self.device)
        dcfg = cfg.draft_model_config() if cfg.with_draft else None
        draft = Model(dcfg, device=self.device) if dcfg else None
        cache = KvCache(num_pages, cfg.page_size, layout=cfg.kv_layout(), device=self.device,
                        log_path=freelog_file(self.log_dir, self.name), node=self.name,
                        max_rows=cfg.max_rows, segment=segment_stem(self.deployment, self.name),
                        shared_memory=shared_memory and torch.device(self.device).type == "cpu")
        self.cache = cache
        self.counting.watch(cfg, cache)
        return model, cache, ModelRunner(model, cache, draft)

    def _make_tp_cache(self, num_pages: int, shared_memory: bool
                       ) -> tuple[Model, KvCache, ModelRunner]:
        if self.tp_spec is None:
            raise ValueError(f"{self.name}: the deployment runs {self.role} workers with "
                             f"{self.config.role_tp(self.role)} tensor-parallel ranks; start "
                             "this one with --tp-size/--tp-rank/--tp-address")
        kv_auth = self.kv_auth.to_dict() if self.deployment else {}
        model, cache, runner = leader_cache(self.tp_spec, self.role, self.name, self.config,
                                            num_pages, self.device, self.log_dir,
                                            self.config.max_rows, shared_memory=shared_memory,
                                            kv_auth=kv_auth, keys=self.keys,
                                            identity=self.identity)
        self.cache, self.tp = cache, TpLeader(cache)
        self.counting.watch(self.config, cache)
        return model, cache, runner

    @property
    def lockstep(self):
        """Rank 0's lockstep (``transport.group`` wraps its KV endpoint in it); None
        without a group."""
        return self.tp.lockstep if self.tp is not None else None

    def transport_cache(self):
        """The pool as this rank's KV transport uses it: in a tensor-parallel group its
        pins are this rank's own (``RankPins``), not mirrored to the other ranks."""
        return self.tp.transport_cache() if self.tp is not None else self.cache

    def tp_rank_size(self) -> tuple[int, int]:
        """(rank, size) of this worker's tensor-parallel group: (0, 1) without one."""
        return (0, self.tp_spec.size) if self.tp_spec is not None else (0, 1)

    # -- loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        stop_signals.drain_with(self._ask_drain)
        try:
            self._serve_loop()
        finally:
            stop_signals.drain_with(None)

    def _serve_loop(self) -> None:
        while not self.stopping:
            try:
                with stop_signals.held():
                    self.poll_control()
            except RouterLost as exc:
                if self.draining:   # leaving anyway: nothing to rejoin for
                    logger.warning("%s: %s while draining; stopping", self.name, exc)
                    self.stopping = True
                    break
                self._rejoin(exc)
                continue
            self._tick_drain()
            if self.stopping:
                break
            busy = self._tick()
            if not busy:
                if self.config.debug_integrity and self.cache is not None:
                    self.cache.check_integrity()
                wait_any([*self.link.sockets(), *self.sockets()], self.idle_wait_s())

    def _ask_drain(self) -> None:
        """SIGTERM's hook: note it only (it runs inside whatever the loop was doing)."""
        self.drain_asked = True

    def _tick_drain(self) -> None:
        """After a SIGTERM: ask the router to drain this worker, and give up waiting for
        its ``Shutdown`` after ``drain_timeout_s`` + ``lease_s`` (holding nothing, after
        one heartbeat: a router that is gone must not hold an idle worker up)."""
        now = time.monotonic()
        if self.drain_asked and not self.draining:
            held = self.num_requests()
            self.draining = now
            self._drain_wait = (self.config.drain_timeout_s + self.config.lease_s if held
                                else self.config.heartbeat_s)
            logger.warning("%s: SIGTERM: draining (%d requests held); a second SIGTERM "
                           "stops at once", self.name, held)
            self.link.send(Drain(self.name))
        elif self.draining and now - self.draining > self._drain_wait:
            logger.warning("%s: no shutdown from the router %.1f s into the drain; "
                           "stopping", self.name, now - self.draining)
            self.stopping = True

    def _tick(self) -> bool:
        try:
            with stop_signals.held():  # a SIGTERM never cuts a step (or its broadcast) in two
                busy = self.tick()
                if self.tp is not None:
                    self.tp.keepalive()
                self._heartbeat()  # a group lost meanwhile is handled as in tick
            return busy
        except GroupLost as exc:  # a rank died: the whole group goes, its requests fail
            logger.error("%s: tensor-parallel group lost: %s", self.name, exc)
            self.abandon(f"{self.name}: a tensor-parallel rank was lost ({exc}); retry")
            raise

    def poll_control(self) -> None:
        """Handle every message from the router; raise ``RouterLost`` past the lease."""
        for msg in self.link.recv_all():
            self._last_router = time.monotonic()
            self.dispatch(msg)
        silent = time.monotonic() - self._last_router
        if silent > self.config.lease_s:
            raise RouterLost(f"{self.name}: router silent for {silent:.1f}s "
                             f"(lease {self.config.lease_s}s)")

    def dispatch(self, msg: Message | Malformed) -> None:
        """One message from the router, by type; anything else is answered ``Error``.

        Raises:
            RouterLost: the router declared this worker lost (it was stopped or cut off
                past the lease); the loop then registers again.
        """
        if isinstance(msg, Error):  # logged, never answered (no error ping-pong)
            if msg.code in ("lost", "not_registered"):
                # it gave up on us, or it is a restarted router that never knew us
                raise RouterLost(f"{self.name}: the router does not count this worker "
                                 f"any more ({msg.code}: {msg.error})")
            logger.warning("%s: the router refused a message (%s): %s", self.name,
                           msg.code, msg.error)
        elif isinstance(msg, Req):
            trace.mark(f"{self.role}.req_in", msg.rid)
            self.counting.on_req(msg)
            self._contained(msg.rid, self.on_req, msg)
        elif isinstance(msg, Abort):
            self._contained(msg.rid, self.on_abort, msg.rid, msg.reason or "aborted")
        elif isinstance(msg, Stop):
            self._contained(msg.rid, self.on_stop, msg.rid)
        elif isinstance(msg, Shutdown):
            logger.info("%s: shutdown requested", self.name)
            self.stopping = True
        elif isinstance(msg, Malformed):
            logger.warning("%s: undecodable message from the router: %s", self.name,
                           msg.detail)
            self.link.send(Error(msg.rid, f"{self.name}: {msg.detail}", msg.code))
        elif not isinstance(msg, (Ping, Registered)):
            # a ping only renews the router's lease; a Registered is a late duplicate
            self.link.errors["unexpected"] += 1
            self.link.send(Error(getattr(msg, "rid", ""), f"{self.name}: a {self.role} "
                                 f"worker does not take {type(msg).__name__}", "unexpected"))

    def _contained(self, rid: str, handler, *args) -> None:
        """Run one request's handler; whatever it raises fails that request alone (the
        router hears ``Error`` and ends it), never the worker."""
        try:
            with stop_signals.held():
                handler(*args)
        except Exception as exc:
            logger.exception("%s: %s: handling %s failed", self.name, rid, handler.__name__)
            self.link.send(Error(rid, f"{self.name} could not serve {rid!r} "
                                 f"({type(exc).__name__}: {exc}); retry it", "refused"))

    # -- recovery ------------------------------------------------------------------------
    def _rejoin(self, lost: RouterLost) -> None:
        """The router is gone (or gave up on us): end what we hold, keep the model and
        pools, and register again for ``rejoin_s`` (the DEALER reconnects to a router
        restarted at the same address by itself).

        Raises:
            RouterLost: no router took us back in time, or it serves another config.
        """
        grace = self.config.rejoin_s
        if grace <= 0:
            raise lost
        logger.warning("%s; ending every request and registering again for up to %.0f s",
                       lost, grace)
        with stop_signals.held():
            self.abandon(f"{self.name} lost its router ({lost}); retry the request")
        deadline, next_try = time.monotonic() + grace, 0.0
        while (now := time.monotonic()) < deadline and not self.stopping:
            if now >= next_try:
                self.link.send(Register(self.role, self.name, os.getpid(), self.deployment))
                next_try = now + self.config.heartbeat_s
            for msg in self.link.recv_all():
                if isinstance(msg, Registered):
                    self._rejoined(msg)
                    return
            with stop_signals.held():
                self.tick()  # the KV plane lives on: peers' leases, copies and pins
            wait_any([*self.link.sockets(), *self.sockets()], 0.05)
        if not self.stopping:
            raise RouterLost(f"{self.name}: no router took this worker back within "
                             f"{grace:.0f} s ({lost})")

    def _rejoined(self, msg: Registered) -> None:
        check_deployment(self.name, msg, self.deployment)
        if self.deployment and PlaneAuth.kv_from_dict(msg.kv_auth) != self.kv_auth:
            raise RouterLost(f"{self.name}: the router now hands out other KV-plane "
                             "credentials (other keys of the router?); restart this worker")
        config = self._own(ServeConfig.from_dict(msg.config))
        if config != self.config:
            changed = sorted(k for k, v in config.to_dict().items()
                             if self.config.to_dict()[k] != v)
            raise RouterLost(f"{self.name}: the router now serves another config "
                             f"(changed: {changed}); restart this worker to serve it")
        self._last_router = self._next_load = time.monotonic()
        pool = self.cache.num_free_pages() * config.page_size if self.cache else 0
        self.link.send(self._ready(pool))
        logger.warning("%s: registered again with the router; serving", self.name)

    def reclaim_segments(self) -> None:
        """Unlink the shared-memory segments of this deployment's dead workers (at start,
        and whenever a KV peer is declared lost)."""
        try:
            reclaim_orphans(self.deployment)
        except Exception:  # never worth a worker: the next chance comes soon
            logger.exception("%s: reclaiming dead workers' shared memory failed", self.name)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self._next_load:
            self._next_load = now + self.config.heartbeat_s
            if self.tp is not None:
                self.tp.ask()
            self._check_free_logs()
            load = self._last_load = replace(self.load(), paused=self.paused)
            self.link.send(load)
            self._report(load)

    # -- heartbeats while a step runs (common/node/pulse.py) -----------------------------
    def computing(self):
        """Context of one forward pass, which keeps the loop from its sockets: heartbeats
        go on from the pulse thread meanwhile. ``debug_step_delay_s`` slows each pass."""
        return self.pulse.computing(self.config.debug_step_delay_s)

    def _beat_outside(self) -> int:
        """On the pulse thread, while the loop computes: the router's heartbeat (the last
        ``Load`` again) and the KV peers' when due. Returns how many went out."""
        sent, now = 0, time.monotonic()
        if now >= self._next_load:
            self._next_load = now + self.config.heartbeat_s
            self.link.send(self._last_load)
            sent += 1
        endpoint = self.kv_endpoint()
        return sent + (endpoint.heartbeat() if endpoint is not None else 0)

    def _check_free_logs(self) -> None:
        """While a free log cannot write, admit nothing new (the router stops routing here
        on the next ``Load``) or exit, by ``freelog_on_error`` (docs/freelog.md). In a
        tensor-parallel group that is any rank's log (rank 0 asks its followers)."""
        failing = [h.summary() for h in log_problems() if not h.ok]
        failing += self.tp.problems() if self.tp is not None else []  # followers'
        why = "; ".join(failing)
        if failing and self.config.freelog_on_error == "exit":
            raise FreeLogFailed(f"{self.name}: exiting (freelog_on_error=exit): {why}")
        if bool(why) != bool(self.paused):
            if why:
                logger.error("%s: not admitting new requests: %s", self.name, why)
            else:
                logger.warning("%s: free logs write again; admitting new requests", self.name)
        self.paused = why

    def send(self, msg: Message) -> None:
        self.counting.on_send(msg, self.cache)
        self.link.send(msg)
        if trace.enabled() and getattr(msg, "first", False):
            for rid in msg.rids[:msg.first] if isinstance(msg, StepTokens) else [msg.rid]:
                trace.mark(f"{self.role}.first_out", rid)

    def _report(self, load: Load | None, final: bool = False) -> None:
        """This process's metrics to the router (every heartbeat, and last at close)."""
        ranks = self.tp.metrics() if self.tp is not None else []  # labelled by rank
        if (report := self.counting.report(self.name, load, final, ranks)) is not None:
            self.link.send(report)

    def _final_load(self) -> Load | None:
        """The queues as they are at the end (None: parts already closed)."""
        try:
            return self.load()
        except Exception:
            logger.debug("%s: no load at close", self.name, exc_info=True)
            return None

    # -- subclass hooks ------------------------------------------------------------------
    @abstractmethod
    def build(self) -> None:
        """Model, pool and KV sockets from ``self.config``."""

    @abstractmethod
    def on_req(self, req: Req) -> None:
        """A request routed to this worker."""

    @abstractmethod
    def on_abort(self, rid: str, reason: str = "aborted") -> None:
        """The router aborts ``rid`` (client abort, or its other worker ended it:
        ``aborted``) or moved it to another worker (``migrated``): free it with
        ``reason``."""

    def on_stop(self, rid: str) -> None:
        """The router's text route ended ``rid``'s output (a stop string): a worker that
        decodes finishes it as ``stop``; a prefill has nothing to do (its part ends as
        always)."""
        return None

    @abstractmethod
    def tick(self) -> bool:
        """One round of work; True when there was work (the loop does not wait then)."""

    @abstractmethod
    def abandon(self, detail: str) -> None:
        """End every request (``aborted``, ``detail`` says why); keep the pools."""

    @abstractmethod
    def shutdown(self) -> None:
        """End every request (``aborted``), free everything, close the pools."""

    def kv_address(self) -> str:
        """Where decodes reach this worker's KV (a prefill's); empty otherwise."""
        return ""

    def kv_endpoint(self):
        """This worker's KV endpoint (``KvSender``/``KvReceiver``, or its group's), whose
        peers get heartbeats while a step runs; None without one."""
        return None

    def host_offloader(self):
        """The ``Offloader`` of this worker's host tier (its prefix cache publishes KV
        events), or None without one."""
        return None

    def sockets(self) -> list:
        """Extra sockets whose input should wake the idle loop."""
        return []

    def idle_wait_s(self) -> float:
        """Longest idle wait for a socket; shorter while a data path without sockets to
        wait on needs polling (NIXL: ``KvSender``/``KvReceiver.poll_within``)."""
        return 0.02

    def load(self) -> Load:
        """The load report sent every ``heartbeat_s``."""
        return Load(self.name, running=0, queued=0, free_tokens=0)

    def num_requests(self) -> int:
        """Requests this worker holds in any stage (a drain waits for them)."""
        load = self.load()
        return load.running + load.queued

    def stats(self) -> dict:
        """Final counters (``Stats``): names to numbers."""
        return {}

    def metric_readings(self) -> list[tuple[str, dict[str, str], float]]:
        """Counters and gauges this worker keeps elsewhere (transport, host tier), as
        ``(catalogue name, labels, value)``, read at every metrics report. Cheap reads
        only: it runs every ``heartbeat_s``."""
        return []

    def close(self) -> None:
        """Free everything (once built), say goodbye with the final stats, close."""
        if self.pulse is not None:
            self.pulse.close()
        try:
            if self.built:
                self.built = False
                self.shutdown()
                self._close_events()
                if self.tp is not None:  # the followers' last reports, then their close
                    self.tp.ask(final=True)
                    self.tp.stop()
                self._report(self._final_load(), final=True)
                self.link.send(Stats(self.name, {**self.stats(), **_free_log_stats(),
                                                 **(self.tp.stats() if self.tp else {}),
                                                 **self.events_stats}))
        finally:
            if self.events is not None:  # a failed build or shutdown: no last batch
                self.events.publisher.close(0.0)
            if self.link is not None:
                self.link.close_after(_FAREWELL_S)
            self.ctx.destroy(linger=0)  # also closes what a failed build left open


def _free_log_stats() -> dict:
    """Final-stats entries for free logs that lost events or never finished writing."""
    problems = log_problems()
    if not problems:
        return {}
    return {"freelog_lost_events": sum(h.lost_events for h in problems),
            "freelog_problem": "; ".join(h.summary() for h in problems)}


def setup_process(threads: int) -> None:
    """Per-process settings of a worker: torch threads (0: one per core of its CPU
    affinity, ``common.sizing.torch_threads``)."""
    torch.set_num_threads(torch_threads(threads))
