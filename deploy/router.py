"""The router (front door): registers workers, routes requests load-aware, relays results.

Clients and workers connect DEALER sockets to the router's one ROUTER socket
(``common.node.control``). For each submitted request the router

1. validates it (``common.request.validate``) against the model and the pools that
   registered, answering ``error`` to the client for a bad one;
2. picks a decode (least reserved tokens per pool token) and a prefill (fewest prompt
   tokens assigned and not yet prefilled), or one colocated worker;
3. sends ``req`` to both; the decode preallocates and announces to the prefill itself;
4. relays ``tokens`` to the client as they come, and ``done`` once the decode finished and
   the prefill reported its transfer (or a short grace period passed);
5. forwards client aborts to both workers; an unknown rid is an error to the client;
6. fails requests of a worker silent past the lease, and requests past their deadline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq

from common.config import ServeConfig
from common.node import Hub, pack_ids, unpack_ids
from common.request import BadRequest, SamplingParams, validate
from deploy.placement import WorkerInfo, admits_at_once, max_tokens, pick

logger = logging.getLogger(__name__)
_PREFILL_GRACE_S = 2.0


@dataclass
class Route:
    rid: str
    client: bytes
    decode: str
    prefill: str
    prompt_len: int
    row_len: int
    t_submit: float
    decode_done: dict | None = None
    prefill_info: dict | None = None
    t_grace: float = 0.0
    extra: dict = field(default_factory=dict)


class Router:
    """The router's state and message handlers; ``serve`` runs its loop."""

    def __init__(self, address: str, config: ServeConfig) -> None:
        self.config = config
        self.mcfg = config.model_config()
        self.ctx = zmq.Context()
        self.hub = Hub(self.ctx, address)
        self.address = self.hub.address
        self.workers: dict[str, WorkerInfo] = {}
        self.by_peer: dict[bytes, str] = {}
        self.routes: dict[str, Route] = {}
        self.shutdown_by: bytes | None = None
        self.t_shutdown = 0.0
        self._next_ping = 0.0

    # -- loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        logger.info("router: listening at %s", self.address)
        try:
            while not self._shutdown_complete():
                item = self.hub.recv(0.05)
                while item is not None:
                    self._dispatch(*item)
                    item = self.hub.recv(0)
                self._tick(time.monotonic())
        finally:
            self.hub.close()
            self.ctx.term()

    def _dispatch(self, peer: bytes, msg: dict) -> None:
        handler = getattr(self, f"_on_{msg['t']}", None)
        if handler is None:
            self.hub.send(peer, {"t": "error", "rid": msg.get("rid", ""),
                                 "error": f"unknown message type {msg['t']!r}"})
            return
        name = self.by_peer.get(peer)
        if name is not None:
            self.workers[name].last_seen = time.monotonic()
        try:
            handler(peer, msg)
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("router: bad %s message: %s", msg["t"], exc)
            self.hub.send(peer, {"t": "error", "rid": str(msg.get("rid", "")),
                                 "error": f"bad {msg['t']} message: {exc!r}"})

    # -- workers -------------------------------------------------------------------------
    def _on_register(self, peer: bytes, msg: dict) -> None:
        name, role = msg["name"], msg["role"]
        old = self.workers.get(name)
        if role not in ("prefill", "decode", "colocated") or (old and not old.lost):
            self.hub.send(peer, {"t": "error", "error": f"role {role!r} or name {name!r} "
                                 "refused (roles: prefill, decode, colocated; names unique)"})
            return
        self.workers[name] = WorkerInfo(name, role, peer, msg.get("pid", 0),
                                        last_seen=time.monotonic())
        self.by_peer[peer] = name
        self.hub.send(peer, {"t": "registered", "config": self.config.to_dict()})
        logger.info("router: %s registered as %s (pid %s)", name, role, msg.get("pid"))

    def _on_ready(self, peer: bytes, msg: dict) -> None:
        w = self.workers[self.by_peer[peer]]
        w.ready, w.kv_addr, w.pool_tokens = True, msg["kv_addr"], msg["pool_tokens"]
        logger.info("router: %s ready (%d pool tokens)", w.name, w.pool_tokens)

    def _on_load(self, peer: bytes, msg: dict) -> None:
        pass  # last_seen is refreshed by _dispatch; routing uses the router's own counts

    def _on_stats(self, peer: bytes, msg: dict) -> None:
        self.workers[self.by_peer[peer]].stats = msg["stats"]

    def _on_tokens(self, peer: bytes, msg: dict) -> None:
        route = self.routes.get(msg["rid"])
        if route is not None:
            if "t_kv_wall" in msg:
                route.extra["t_kv_wall"] = msg.pop("t_kv_wall")
            self.hub.send(route.client, msg)

    def _on_done(self, peer: bytes, msg: dict) -> None:
        route = self.routes.get(msg["rid"])
        if route is None:
            return
        route.decode_done = msg
        route.t_grace = time.monotonic() + _PREFILL_GRACE_S
        self._release(route.decode, route.row_len)
        if route.prefill and route.prefill_info is None and msg["reason"] not in (
                "stop", "length"):
            self._send_worker(route.prefill, {"t": "abort", "rid": route.rid})
        self._maybe_finalize(route)

    def _on_prefilled(self, peer: bytes, msg: dict) -> None:
        route = self.routes.get(msg["rid"])
        if route is None:
            return
        route.prefill_info = msg
        self._release(route.prefill, route.prompt_len)
        self._maybe_finalize(route)

    # -- clients -------------------------------------------------------------------------
    def _on_submit(self, peer: bytes, msg: dict) -> None:
        rid = str(msg["rid"])
        try:
            if rid in self.routes:
                raise BadRequest(f"rid {rid!r} is already in flight")
            prompt = unpack_ids(msg["prompt"]) if isinstance(msg["prompt"], bytes) else \
                list(msg["prompt"])
            params = SamplingParams.from_dict(msg.get("params", {}))
            validate(prompt, params, vocab_size=self.mcfg.vocab_size,
                     max_tokens=max_tokens(self.workers.values()),
                     max_new_tokens_limit=self.config.max_new_tokens_limit)
            decode, prefill = pick(self.workers.values(), len(prompt),
                                   len(prompt) + params.max_new_tokens)
        except BadRequest as exc:
            self.hub.send(peer, {"t": "error", "rid": rid, "error": str(exc)})
            return
        self._route(peer, rid, prompt, params, decode, prefill)

    def _route(self, client: bytes, rid: str, prompt: list[int], params: SamplingParams,
               decode: WorkerInfo, prefill: WorkerInfo | None) -> None:
        row_len = len(prompt) + params.max_new_tokens
        route = Route(rid, client, decode.name, prefill.name if prefill else "", len(prompt),
                      row_len, time.monotonic())
        self.routes[rid] = route
        eager = admits_at_once(decode, row_len, self.config)
        decode.assigned += row_len
        decode.routed += 1
        req = {"t": "req", "rid": rid, "prompt": pack_ids(prompt), "params": params.to_dict(),
               "prefill": route.prefill, "prefill_addr": prefill.kv_addr if prefill else "",
               "decode": decode.name, "eager": eager}
        self._send_worker(decode.name, req)
        if prefill is not None:
            prefill.assigned += len(prompt)
            self._send_worker(prefill.name, req)

    def _on_abort(self, peer: bytes, msg: dict) -> None:
        route = self.routes.get(msg["rid"])
        if route is None or route.client != peer:
            self.hub.send(peer, {"t": "error", "rid": msg["rid"],
                                 "error": f"abort: unknown rid {msg['rid']!r} (not in flight)"})
            return
        route.extra["aborted_by_client"] = True
        for name in (route.decode, route.prefill):
            if name:
                self._send_worker(name, {"t": "abort", "rid": route.rid})

    def _on_status(self, peer: bytes, msg: dict) -> None:
        self.hub.send(peer, {"t": "status", "workers": {
            w.name: {"role": w.role, "ready": w.ready, "lost": w.lost, "pid": w.pid}
            for w in self.workers.values()}, "in_flight": len(self.routes),
            "config": self.config.to_dict()})

    def _on_shutdown(self, peer: bytes, msg: dict) -> None:
        logger.info("router: shutdown requested")
        self.shutdown_by, self.t_shutdown = peer, time.monotonic()
        for w in self.workers.values():
            if not w.lost:
                self.hub.send(w.peer, {"t": "shutdown"})

    def _on_ping(self, peer: bytes, msg: dict) -> None:
        self.hub.send(peer, {"t": "pong"})

    # -- helpers -------------------------------------------------------------------------
    def _release(self, name: str, tokens: int) -> None:
        w = self.workers.get(name)
        if w is not None and tokens:
            w.assigned = max(0, w.assigned - tokens)
            w.routed = max(0, w.routed - 1)

    def _send_worker(self, name: str, msg: dict) -> None:
        w = self.workers.get(name)
        if w is not None and not w.lost and not self.hub.send(w.peer, msg):
            self._lose(w, "unreachable")

    def _maybe_finalize(self, route: Route, force: bool = False) -> None:
        done = route.decode_done
        if done is None or (route.prefill and route.prefill_info is None and not force):
            return
        info = route.prefill_info or {}
        out = {**done, "t": "done"}
        if route.extra.get("aborted_by_client") and done["reason"] not in ("stop", "length"):
            out["reason"] = "aborted"   # a race with the peer's abort may say "error"
        for key in ("xfer_s", "kv_bytes"):
            if key in info:
                out[key] = info[key]
        if "error" in info and done["reason"] not in ("stop", "length"):
            # the prefill's words name the cause; the decode's only say the transfer ended
            out["error"] = info["error"] + (f" (decode: {done['error']})"
                                            if done.get("error") else "")
        if "t_finish_wall" in info and "t_kv_wall" in route.extra:
            # exposed transfer: prefill's last chunk computed -> decode holds KV + token
            out["xfer_s"] = max(0.0, route.extra["t_kv_wall"] - info["t_finish_wall"])
        self.hub.send(route.client, out)
        del self.routes[route.rid]

    def _fail(self, route: Route, reason: str, error: str) -> None:
        for name in (route.decode, route.prefill):
            if name and route.decode_done is None:
                self._send_worker(name, {"t": "abort", "rid": route.rid})
        self._release(route.decode, route.row_len if route.decode_done is None else 0)
        self._release(route.prefill, route.prompt_len if route.prefill_info is None else 0)
        self.hub.send(route.client, {"t": "done", "rid": route.rid, "reason": reason,
                                     "error": error})
        del self.routes[route.rid]

    def _lose(self, w: WorkerInfo, why: str) -> None:
        if w.lost:
            return
        w.lost = True
        logger.error("router: worker %s (%s, pid %s) lost: %s", w.name, w.role, w.pid, why)
        for route in list(self.routes.values()):
            if w.name in (route.decode, route.prefill) and route.decode_done is None:
                self._fail(route, "error", f"worker {w.name} lost: {why}")

    def _tick(self, now: float) -> None:
        if now >= self._next_ping:
            self._next_ping = now + self.config.heartbeat_s
            for w in self.workers.values():
                if not w.lost:
                    self.hub.send(w.peer, {"t": "ping"})
        for w in list(self.workers.values()):
            if not w.lost and now - w.last_seen > self.config.lease_s:
                self._lose(w, f"silent for {now - w.last_seen:.1f}s")
        for route in list(self.routes.values()):
            if route.decode_done is not None and now >= route.t_grace:
                self._maybe_finalize(route, force=True)
            elif route.decode_done is None and now - route.t_submit > \
                    self.config.request_timeout_s:
                self._fail(route, "timeout", f"no result in {self.config.request_timeout_s}s")

    def _shutdown_complete(self) -> bool:
        if self.shutdown_by is None:
            return False
        live = [w for w in self.workers.values() if not w.lost]
        waited = time.monotonic() - self.t_shutdown
        if all(w.stats is not None for w in live) or waited > self.config.lease_s:
            self.hub.send(self.shutdown_by, {"t": "bye", "stats": {
                w.name: {"role": w.role, **(w.stats or {})} for w in self.workers.values()}})
            return True
        return False


def serve_router(address: str, config: ServeConfig) -> int:
    """Body of ``pdkv router``: serve until a client asks for shutdown."""
    Router(address, config).serve()
    return 0
