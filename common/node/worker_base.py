"""What every worker process shares: its link to the router, registration, heartbeats,
the main loop, shutdown.

A worker is a function: ``build`` (model, pool, sockets), report ready, loop, exit cleanly::

    connect router -> register(role, name) -> registered(config)
    -> build from config -> ready(kv_addr, pool_tokens) -> loop -> shutdown -> close

The loop alternates control messages from the router, one ``tick`` of work, and load
reports (which double as heartbeats). A router silent past the lease ends the worker: a
worker never outlives its deployment.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path

import torch
import zmq

from common.config import ServeConfig
from common.kv import KvCache
from common.metrics import NodeMetrics, pack
from common.model import Model, ModelRunner
from common.node.control import (
    Abort,
    Error,
    Load,
    Malformed,
    Message,
    MetricsReport,
    Ping,
    Prefilled,
    Ready,
    Register,
    Registered,
    Req,
    Shutdown,
    Stats,
    Tokens,
)
from common.node.link import Link, wait_any

logger = logging.getLogger(__name__)


class RouterLost(RuntimeError):
    """The router went silent past the lease or never answered the registration."""


class WorkerBase(ABC):
    """Base of prefill, decode and colocated workers.

    Args:
        role: 'prefill', 'decode' or 'colocated'.
        name: unique worker name (logs, free log file name, router bookkeeping).
        router: the router's address.
        device: 'cpu' or 'cuda:N'.
        log_dir: directory for this worker's free log (``<name>.freelog``); None: no log.
        local_models: ``model_path`` / ``draft_model_path`` of this host's copies of the
            deployment's checkpoints (``pdkv prefill --model DIR``); empty: the router's.
    """

    role = "worker"

    def __init__(self, name: str, router: str, device: str = "cpu",
                 log_dir: str | None = None, register_timeout_s: float = 60.0, *,
                 local_models: dict[str, str] | None = None) -> None:
        self.name, self.device, self.log_dir = name, device, log_dir
        # This host's copies of the checkpoints (model_path, draft_model_path) replace
        # the router's paths; the KV handshake's weights fingerprint proves they match.
        self.local_models = dict(local_models or {})
        self.ctx = zmq.Context()
        self.link = Link(self.ctx, router, name)
        self.stopping = False
        self.metrics = NodeMetrics(self.role)
        """This process's metrics; parts that count take their metric objects from it."""
        # only the worker that generates (computes the prompt) counts tokens (prompt)
        self._generated = None if self.role == "prefill" else self.metrics.counter(
            "pdkv_generation_tokens_total")
        self._prompt = None if self.role == "decode" else self.metrics.counter(
            "pdkv_prompt_tokens_total")
        self._last_load: Load | None = None
        self.metrics.read(self._load_readings)
        self.metrics.read(self.metric_readings)
        self.config = self._register(register_timeout_s)
        self._last_router = self._next_load = time.monotonic()
        self.cache: KvCache | None = None

    # -- startup -------------------------------------------------------------------------
    def _register(self, timeout_s: float) -> ServeConfig:
        self.link.send(Register(self.role, self.name, os.getpid()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.link.recv(0.2)
            if isinstance(msg, Registered):
                return ServeConfig.from_dict({**msg.config, **self.local_models})
            if isinstance(msg, Error):
                raise RuntimeError(f"{self.name}: router refused registration: {msg.error}")
        raise RouterLost(f"{self.name}: no answer from the router within {timeout_s}s")

    def make_cache(self, num_pages: int, shared_memory: bool = False
                   ) -> tuple[Model, KvCache, ModelRunner]:
        """Model (and draft checkpoint), pool (recording to ``<log_dir>/<name>.freelog``)
        and runner.

        ``shared_memory`` puts a CPU pool in named shared memory (peers on this host copy
        into it directly); ignored for device pools."""
        cfg = self.config
        model = Model(cfg.model_config(), device=self.device)
        dcfg = cfg.draft_model_config() if cfg.with_draft else None
        draft = Model(dcfg, device=self.device) if dcfg else None
        log = None
        if self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            log = str(Path(self.log_dir) / f"{self.name}.freelog")
        cache = KvCache(num_pages, cfg.page_size, layout=cfg.kv_layout(), device=self.device,
                        log_path=log, node=self.name, max_rows=cfg.max_rows,
                        shared_memory=shared_memory and torch.device(self.device).type == "cpu")
        self.cache = cache
        self.metrics.watch_pools("device", cache.pool_stats)
        self.metrics.set_info(**build_info(self.config, cache))
        return model, cache, ModelRunner(model, cache, draft)

    def report_ready(self, kv_addr: str = "") -> None:
        pool = self.cache.num_free_pages() * self.config.page_size if self.cache else 0
        self.link.send(Ready(self.name, kv_addr, pool))
        logger.info("%s: ready (%s, pool %d tokens, kv %s)", self.name, self.role, pool,
                    kv_addr or "-")

    # -- loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        """Loop until the router says shutdown (or is lost); then close."""
        try:
            while not self.stopping:
                self._control()
                busy = self.tick()
                self._heartbeat()
                if not busy:
                    if self.config.debug_integrity and self.cache is not None:
                        self.cache.check_integrity()
                    wait_any([self.link.sock, *self.sockets()], 0.02)
        finally:
            self.close()

    def _control(self) -> None:
        for msg in self.link.recv_all():
            self._last_router = time.monotonic()
            self._dispatch(msg)
        silent = time.monotonic() - self._last_router
        if silent > self.config.lease_s:
            raise RouterLost(f"{self.name}: router silent for {silent:.1f}s "
                             f"(lease {self.config.lease_s}s)")

    def _dispatch(self, msg: Message | Malformed) -> None:
        if isinstance(msg, Req):
            if self._prompt is not None:
                self._prompt.inc(len(msg.prompt) // 4)   # int32 ids
            self.on_req(msg)
        elif isinstance(msg, Abort):
            self.on_abort(msg.rid)
        elif isinstance(msg, Shutdown):
            logger.info("%s: shutdown requested", self.name)
            self.stopping = True
        elif isinstance(msg, Malformed):
            logger.warning("%s: undecodable message from the router: %s", self.name,
                           msg.detail)
            self.link.send(Error(msg.rid, f"{self.name}: {msg.detail}", msg.code))
        elif not isinstance(msg, Ping):  # a ping only renews the router's lease
            self.link.errors["unexpected"] += 1
            self.link.send(Error(getattr(msg, "rid", ""), f"{self.name}: a {self.role} "
                                 f"worker does not take {type(msg).__name__}", "unexpected"))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self._next_load:
            self._next_load = now + self.config.heartbeat_s
            self._last_load = self.load()
            self.link.send(self._last_load)
            self.send_metrics()

    def send(self, msg: Message) -> None:
        if isinstance(msg, Tokens) and self._generated is not None:
            self._generated.inc(len(msg.ids))
        elif isinstance(msg, Prefilled) and msg.reason == "sent" and self.cache is not None:
            page_bytes = self.cache.layout.page_bytes(self.cache.page_size)
            self.metrics.counter("pdkv_transfer_pages_total").labels(direction="sent").inc(
                msg.kv_bytes // page_bytes)
            self.metrics.histogram("pdkv_transfer_seconds").labels(direction="sent").observe(
                msg.xfer_s)
        self.link.send(msg)

    def send_stats(self) -> None:
        self.link.send(Stats(self.name, self.stats()))

    def send_metrics(self, final: bool = False) -> None:
        """Report this process's metrics to the router (every heartbeat, and last at close)."""
        if final:  # the queues as they are at the end, not at the last heartbeat
            try:
                self._last_load = self.load()
            except Exception:  # parts already closed: keep the last heartbeat's
                logger.debug("%s: no load at close", self.name, exc_info=True)
        try:
            families = pack(self.metrics.collect())
        except Exception:  # metrics never take a worker down
            logger.exception("%s: collecting metrics failed", self.name)
            return
        self.link.send(MetricsReport(self.name, families, final))

    # -- subclass hooks ------------------------------------------------------------------
    @abstractmethod
    def on_req(self, req: Req) -> None:
        """A request routed to this worker."""

    @abstractmethod
    def on_abort(self, rid: str) -> None:
        """The router aborts ``rid`` (client abort, or its other worker ended it)."""

    @abstractmethod
    def tick(self) -> bool:
        """One round of work; True when there was work (the loop does not wait then)."""

    def sockets(self) -> list:
        """Extra sockets whose input should wake the idle loop."""
        return []

    def load(self) -> Load:
        """The load report sent every ``heartbeat_s``."""
        return Load(self.name, running=0, queued=0, free_tokens=0)

    def stats(self) -> dict:
        """Final counters (``Stats``): names to numbers."""
        return {}

    def _load_readings(self) -> list[tuple[str, dict[str, str], float]]:
        load = self._last_load
        if load is None:
            return []
        queue = "prefill" if self.role == "prefill" else "admission"
        return [("pdkv_running_requests", {}, load.running),
                ("pdkv_queue_requests", {"queue": queue}, load.queued)]

    def metric_readings(self) -> list[tuple[str, dict[str, str], float]]:
        """Counters and gauges this worker keeps elsewhere (transport, host tier), as
        ``(catalogue name, labels, value)``, read at every metrics report. Cheap reads
        only: it runs every ``heartbeat_s``."""
        return []

    def close(self) -> None:
        """Free everything, close the pool's free log, say goodbye."""
        try:
            self.send_metrics(final=True)
            self.send_stats()
        finally:
            self.link.close()
            self.ctx.term()


def build_info(config: ServeConfig, cache: KvCache) -> dict[str, str]:
    """The labels of ``pdkv_build_info`` for a worker built from ``config``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("pdkv")
    except PackageNotFoundError:
        ver = "unknown"
    lay = cache.layout
    return {"version": ver, "model": config.model, "dtype": str(lay.dtype),
            "page_size": str(cache.page_size), "transport": config.transport,
            "spec_k": str(config.spec_k),
            "layout": f"{lay.num_layers}+{lay.num_draft_layers}L/{lay.num_kv_heads}h/"
                      f"{lay.head_dim}d"}


def setup_process(threads: int) -> None:
    """Per-process settings of a worker: torch threads, logging."""
    torch.set_num_threads(max(1, threads))
