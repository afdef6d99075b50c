"""The router (front door): registers workers, routes requests load-aware, relays results.

Clients and workers connect DEALER sockets to the router's one ROUTER socket
(``common.control.messages``). For each submitted request the router

1. lets it in through its door (``deploy.router.door``, the only admission): every
   parameter checked against the model and the pools that registered, the stop policy
   applied, a text encoded (a long one on a thread, ``deploy.router.text_encoder``);
   a bad request is answered ``error`` with its code;
2. picks a decode (least reserved tokens per pool token) and a prefill (fewest prompt
   tokens assigned and not yet prefilled), or one colocated worker;
3. sends ``req`` to both; the decode preallocates and announces to the prefill itself;
4. tells the client it let the request in (a ``tokens`` with no ids, the prompt's
   length in ``prompt_tokens``), then relays ``tokens`` to the client as they come, with
   their text when the model has a tokenizer (``deploy.router.text_route``: the only
   detokenizer and stop-string cutter; a stop string tells the decode to finish,
   ``stop``), and ``done`` once the decode
   finished and the prefill reported its transfer (or a short grace period passed);
5. forwards client aborts to both workers; an unknown rid is an error to the client;
6. notices a worker's death as its connection closes (a SIGSTOPped one when its lease
   runs out) and moves its requests to other workers (``deploy.router.migration``); fails
   requests past their deadline.

With a key directory every peer authenticates with CURVE and the router checks what its
identity may do (``deploy.router.roles``, docs/security.md): workers of this deployment only
about requests it gave them, clients only about their own requests, shutdown only by an
operator. Each request gets a KV capability that only its two workers learn.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

import zmq

from common import trace
from common.auth import Keys, control_server, kv_plane
from common.config import ServeConfig
from common.control import (
    Abort,
    Bye,
    ControlHub,
    Done,
    Drain,
    Error,
    Hub,
    Load,
    Malformed,
    Message,
    MetricsQuery,
    MetricsReport,
    MetricsSnapshot,
    Ping,
    Pong,
    Prefilled,
    Ready,
    Register,
    Registered,
    Shutdown,
    Stats,
    Status,
    StatusReport,
    StepTokens,
    Stop,
    Submit,
    Tokens,
    pack_ids,
)
from common.kv import reclaim_orphans
from common.request import BadRequest, SamplingParams
from deploy.router.door import Admitted, Door
from deploy.router.drain import Draining
from deploy.router.errors import Overloaded
from deploy.router.metrics import RouterMetrics
from deploy.router.migration import Migrations
from deploy.router.placement import Placement, WorkerInfo
from deploy.router.roles import is_operator, may_send
from deploy.router.routes import Route, RouteTable
from deploy.router.text_encoder import Job, TextEncoder

logger = logging.getLogger(__name__)
_PREFILL_GRACE_S = 2.0
_ENCODING_POLL_S = 0.002
"""The loop's wait while texts are being encoded: a finished one is routed this soon."""
_FAREWELL_S = 1.0
"""How long the Bye to whoever asked for shutdown may take to leave before the socket closes."""
_PROBE_S = 0.3
"""After a connection closed: how long the router keeps trying every worker's connection
(a dead worker's is gone a moment after the event; sends to it then fail)."""
_WORKER_MESSAGES = (Ready, Load, Stats, MetricsReport, StepTokens, Tokens, Done, Prefilled)
"""Accepted only from a peer that registered as a worker."""


class Router(Migrations, Draining):
    """The router's state and message handlers; ``serve`` runs its loop.

    Args:
        address: where to bind (without ``keys`` only loopback or a private ipc path), or
            a ``ControlHub`` already made (tests).
        config: the deployment's config, handed to every worker.
        keys: the deployment's key directory (CURVE on every peer); None: no keys.
        metrics_host, metrics_port: serve the deployment's metrics over HTTP there.
    """

    def __init__(self, address: str | ControlHub, config: ServeConfig,
                 keys: Keys | None = None, metrics_host: str = "127.0.0.1",
                 metrics_port: int | None = None) -> None:
        self.config = config
        self.door = Door(config)
        self.encoder = TextEncoder(config.encode_threads, config.encode_queue,
                                   config.encode_timeout_s)
        self.deployment = keys.deployment_id if keys else ""
        self.kv_auth = kv_plane(keys, config.kv_security)
        self.ctx = zmq.Context()
        try:
            self.hub = address if isinstance(address, ControlHub) else Hub(
                self.ctx, address, control_server(keys))
        except BaseException:
            self.ctx.term()
            raise
        self.address = self.hub.address
        self.identities: dict[bytes, str] = {}
        """Peer routing id -> the identity it authenticated as (first message)."""
        self.workers: dict[str, WorkerInfo] = {}
        self.by_peer: dict[bytes, str] = {}
        self.routes = RouteTable()
        self.errors: Counter[str] = self.hub.errors
        """Refused messages by ``Error`` code (undecodable ones counted by the hub)."""
        self.shutdown_by: bytes | None = None
        self.t_shutdown = 0.0
        self._next_ping = 0.0
        self._probe_until = self._next_probe = 0.0
        self._probe_gap = 0.0
        self._reclaims: list[float] = []
        """When to look for dead workers' shared memory again."""
        self._handlers: dict[type, Callable[[bytes, Message], None]] = {
            Register: self._on_register, Ready: self._on_ready, Load: self._on_load,
            Stats: self._on_stats, Tokens: self._on_tokens, Done: self._on_done,
            StepTokens: self._on_step_tokens,
            Prefilled: self._on_prefilled, Submit: self._on_submit, Abort: self._on_abort,
            Status: self._on_status, Shutdown: self._on_shutdown, Ping: self._on_ping,
            Error: self._on_error, Malformed: self._on_malformed,
            MetricsReport: self._on_metrics_report, MetricsQuery: self._on_metrics_query,
            Drain: self._on_drain}
        self.metrics = RouterMetrics(lambda: len(self.routes), lambda: len(self.encoder))
        self.placement = Placement(config, keys, self.metrics.node)
        """Where requests go: ``config.routing``, over the workers' KV events."""
        if metrics_port is not None:
            self.metrics.serve_http(metrics_host, metrics_port)

    # -- loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        if self.deployment:
            logger.info("router: listening at %s (deployment %s, CURVE; KV plane %s)",
                        self.address, self.deployment, self.kv_auth.mechanism)
        else:
            logger.warning("router: listening at %s WITHOUT authentication (no --auth-keys): "
                           "any local process may act as any worker or client",
                           self.address)
        try:
            while not self.shutdown_complete():
                item = self.hub.recv(self.idle_wait_s())
                while item is not None:
                    self.dispatch(*item)
                    item = self.hub.recv(0)
                self.tick(time.monotonic())
        finally:
            self.close()

    def idle_wait_s(self) -> float:
        """Longest wait for a message before the next ``tick`` (short while texts are
        being encoded: a finished one is routed this soon)."""
        wait = _ENCODING_POLL_S if len(self.encoder) else 0.05
        if self._probe_until:   # a connection closed: look again soon
            wait = min(wait, max(0.0, self._next_probe - time.monotonic()))
        return wait

    def close(self) -> None:
        """Stop the encoding threads, the KV events feed and the metrics server, close
        the socket."""
        self.encoder.close()
        self.placement.close()
        self.metrics.close()
        self.hub.close(_FAREWELL_S if self.shutdown_by is not None else 0.0)
        self.ctx.term()

    def dispatch(self, peer: bytes, msg: Message | Malformed, identity: str = "") -> None:
        """Handle one message from ``peer``, authenticated as ``identity`` ('' without
        keys); whatever a peer sends, the router answers and serves on."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._refuse(peer, getattr(msg, "rid", ""), "unexpected",
                         f"the router does not take {type(msg).__name__}")
            return
        if not self._authorized(peer, msg, identity):
            return
        name = self.by_peer.get(peer)
        if name is not None and self.workers[name].lost and not isinstance(msg, Register):
            # it was stopped or cut off past the lease; its requests failed: it must
            # register again before it serves (WorkerBase does, on this answer)
            self.hub.send(peer, Error("", f"worker {name} was declared lost; register "
                                      "again", "lost"))
            return
        if name is not None:
            self.workers[name].last_seen = time.monotonic()
        elif isinstance(msg, _WORKER_MESSAGES):
            self._refuse(peer, getattr(msg, "rid", ""), "not_registered",
                         f"{type(msg).__name__} from a peer that did not register")
            return
        handler(peer, msg)

    def _authorized(self, peer: bytes, msg: Message | Malformed, identity: str) -> bool:
        """The sender's identity may send this kind of message, and is the one this
        routing id first came with (docs/security.md)."""
        first = self.identities.setdefault(peer, identity)
        if first != identity:
            self._forbid(peer, msg, f"routing id {peer!r} belongs to {first!r}, not "
                         f"{identity!r}")
            return False
        if not may_send(identity, type(msg)):
            self._forbid(peer, msg, f"identity {identity!r} may not send "
                         f"{type(msg).__name__}")
            return False
        return True

    def _forbid(self, peer: bytes, msg: Message | Malformed, why: str) -> None:
        """Refuse and count a message its sender may not send; nothing else changes."""
        self.errors[f"forbidden.{type(msg).__name__}"] += 1
        self._refuse(peer, getattr(msg, "rid", ""), "forbidden", why)

    def _refuse(self, peer: bytes, rid: str, code: str, error: str) -> None:
        self.errors[code] += 1
        logger.warning("router: refused a message from %r: %s", peer, error)
        self.hub.send(peer, Error(rid, error, code))

    def _on_malformed(self, peer: bytes, msg: Malformed) -> None:
        # counted by the hub already
        self.hub.send(peer, Error(msg.rid, f"malformed message: {msg.detail}", msg.code))

    def _on_error(self, peer: bytes, msg: Error) -> None:
        # logged, never answered: an error about an error would bounce forever
        name = self.by_peer.get(peer)
        logger.warning("router: %s reports an error (%s) for %r: %s", name or peer,
                       msg.code, msg.rid, msg.error)
        route = self.routes.get(msg.rid)
        if route is None or name is None:
            return
        # A worker that could not take a request it still owes (its Req undecodable, say)
        # will never report on it: end it now rather than leave the client waiting.
        owes = ((name == route.decode and route.decode_done is None)
                or (name == route.prefill and route.prefill_info is None))
        if owes:
            self._fail(route, "aborted" if route.aborted_by_client else "error",
                       f"worker {name} could not serve the request ({msg.code}): "
                       f"{msg.error}")

    # -- workers -------------------------------------------------------------------------
    def _on_register(self, peer: bytes, msg: Register) -> None:
        if not hmac.compare_digest(msg.deployment, self.deployment):
            self._forbid(peer, msg, f"deployment {msg.deployment!r} is not this router's "
                         f"({self.deployment!r}): start the worker with this deployment's "
                         "--auth-keys")
            return
        if self.by_peer.get(peer, msg.name) != msg.name:   # one connection, one worker
            self._forbid(peer, msg, f"this connection registered already as "
                         f"{self.by_peer[peer]!r}")
            return
        old = self.workers.get(msg.name)
        if msg.role not in ("prefill", "decode", "colocated"):
            self._refuse(peer, "", "refused", f"role {msg.role!r} refused; roles: prefill, "
                         "decode, colocated")
            return
        if old is not None and not old.lost and old.peer != peer:
            # a restarted worker under its old name: take it if the old one is gone
            if self.hub.send(old.peer, Ping()):
                self._refuse(peer, "", "name_taken", f"name {msg.name!r} is taken by a live "
                             f"worker (pid {old.pid}); names are unique. If it died, it is "
                             f"released within the lease ({self.config.lease_s:g} s)")
                return
            self._lose(old, "unreachable (a new process took its name)")
        if old is not None and not old.lost and not old.ready:
            self.hub.send(peer, Registered(self.config.to_dict()))  # a repeat: same answer
            return
        if old is not None and not old.lost:  # the same process again: it dropped its work
            self._lose(old, "registered again")
        if old is not None:
            logger.warning("router: %s (%s) rejoins (pid %s)", msg.name, msg.role, msg.pid)
        self.workers[msg.name] = WorkerInfo(msg.name, msg.role, peer, msg.pid,
                                            last_seen=time.monotonic())
        self.by_peer[peer] = msg.name
        self.hub.send(peer, Registered(self.config.to_dict(), self.deployment,
                                       self.kv_auth.to_dict()))
        logger.info("router: %s registered as %s (pid %s)", msg.name, msg.role, msg.pid)

    def _on_ready(self, peer: bytes, msg: Ready) -> None:
        w = self.workers[self.by_peer[peer]]
        w.ready, w.kv_addr, w.pool_tokens = True, msg.kv_addr, msg.pool_tokens
        self.placement.watch(w, msg.events_addr, msg.events_replay_addr,
                             self.identities.get(peer, ""))
        logger.info("router: %s ready (%d pool tokens)", w.name, w.pool_tokens)

    def _on_load(self, peer: bytes, msg: Load) -> None:
        # last_seen is refreshed by dispatch; routing uses the router's own counts
        w = self.workers.get(self.by_peer.get(peer, ""))
        if w is None:
            return
        if bool(w.paused) != bool(msg.paused):  # the text changes while paused: log once
            if msg.paused:
                logger.error("router: %s admits no new requests: %s", w.name, msg.paused)
            else:
                logger.warning("router: %s admits new requests again", w.name)
        w.paused = msg.paused

    def _on_stats(self, peer: bytes, msg: Stats) -> None:
        self.workers[self.by_peer[peer]].stats = msg.stats

    def _on_metrics_report(self, peer: bytes, msg: MetricsReport) -> None:
        w = self.workers[self.by_peer[peer]]   # the registered name, not the message's
        if not self.metrics.report(w.name, w.role, msg.families, msg.final):
            self.errors["bad_field"] += 1

    def _on_metrics_query(self, peer: bytes, msg: MetricsQuery) -> None:
        self.hub.send(peer, MetricsSnapshot(self.metrics.snapshot()))

    def _route_of(self, peer: bytes, msg: Tokens | Done | Prefilled, role: str
                  ) -> Route | None:
        """The route ``msg`` is about, if its sender is that route's ``role`` worker. A
        rid that already ended (a late report) is dropped and counted ``stray_report``;
        one given to another worker is forbidden (refused and counted; the route goes on
        untouched)."""
        route = self.routes.get(msg.rid)
        if route is None:
            if not self.routes.retired(msg.rid):  # an attempt that moved on: expected
                self.errors["stray_report"] += 1
            return None
        if self.by_peer.get(peer) != getattr(route, role):
            self._forbid(peer, msg, f"{msg.rid!r} was not given to "
                         f"{self.by_peer.get(peer)!r} as its {role}")
            return None
        return route

    def _on_step_tokens(self, peer: bytes, msg: StepTokens) -> None:
        """One step's tokens of many requests: each request's share as its own."""
        for tokens in msg.items():
            self._on_tokens(peer, tokens)

    def _on_tokens(self, peer: bytes, msg: Tokens) -> None:
        role = self._tokens_role(peer, msg)
        route = self._route_of(peer, msg, role)
        if route is None:
            return
        if msg.first:
            trace.mark(f"router.first_in_from_{role}", route.rid)
        if role == "decode":
            route.has_kv = True   # its first token comes with the prompt's KV
        if msg.t_kv_wall:
            route.t_kv_wall = msg.t_kv_wall
        ids = self._new_ids(route, msg)
        if not ids:
            return
        route.streamed.extend(ids)    # a later attempt starts from them
        self.metrics.tokens(route.rid, len(ids))
        msg = dataclasses.replace(msg, rid=route.label, ids=ids, t_kv_wall=0.0,
                                  first=msg.first and len(ids) == len(msg.ids)
                                  and not route.prior)
        if route.text is not None:
            msg = self._text_tokens(route, msg)
        if msg.ids:
            self.hub.send(route.client, msg)
            if msg.first:
                trace.mark("router.first_out", route.rid)

    def _tokens_role(self, peer: bytes, msg: Tokens) -> str:
        """Who may send ``msg``: the decode, or (its first token alone) the prefill."""
        route = self.routes.get(msg.rid)
        if (route is not None and route.prefill and msg.first and len(msg.ids) == 1
                and self.by_peer.get(peer) == route.prefill):
            return "prefill"
        return "decode"

    def _new_ids(self, route: Route, msg: Tokens) -> list[int]:
        """The ids of ``msg`` the client has not had. The first token comes twice: from
        the prefill as soon as it is computed (so TTFT does not wait for the KV transfer)
        and from the decode once it holds the KV; the later one is dropped."""
        if not msg.first or not msg.ids:
            return list(msg.ids)
        if route.decode_done is not None:  # the decode ended it (an abort): nothing new
            return []
        if route.first_id is None:
            route.first_id = msg.ids[0]
            return list(msg.ids)
        if msg.ids[0] != route.first_id:  # both computed it from the same KV: a bug
            self.errors["first_token_mismatch"] += 1
            logger.error("router: %s: the prefill and the decode disagree on the first "
                         "token (%d relayed, %d now)", route.rid, route.first_id, msg.ids[0])
        return list(msg.ids[1:])

    def _text_tokens(self, route: Route, msg: Tokens) -> Tokens:
        """Detokenize; a stop string ends the output here, and the decode is told to
        finish (``Stop``: its row is freed ``finished``; the prefill ends its part as
        always)."""
        was_stopped = route.text.stopped
        ids, text = route.text.feed(msg.ids)
        if route.text.stopped and not was_stopped and route.decode_done is None:
            self._send_worker(route.decode, Stop(route.rid))
        return dataclasses.replace(msg, ids=ids, text=text)

    def _on_done(self, peer: bytes, msg: Done) -> None:
        route = self._route_of(peer, msg, "decode")
        if route is None or route.decode_done is not None or self._moves_on_done(route, msg):
            return
        if msg.ok and route.prior:   # the tokens of earlier attempts count too
            msg = dataclasses.replace(msg, n=msg.n + route.prior)
        route.decode_done = msg
        route.t_grace = time.monotonic() + _PREFILL_GRACE_S
        self._release(route.decode, route.row_len)
        if route.prefill and route.prefill_info is None and not msg.ok:
            self._send_worker(route.prefill, Abort(route.rid))
        self._maybe_finalize(route)

    def _on_prefilled(self, peer: bytes, msg: Prefilled) -> None:
        route = self._route_of(peer, msg, "prefill")
        if route is None or route.prefill_info is not None:
            return
        route.prefill_info = msg
        self._release(route.prefill, route.attempt_prompt_len)
        self._maybe_finalize(route)

    # -- clients -------------------------------------------------------------------------
    def _on_submit(self, peer: bytes, msg: Submit) -> None:
        t_in, now = trace.now_ns(), time.monotonic()
        try:
            if (peer, msg.rid) in self.encoder:
                raise BadRequest(f"rid {msg.rid!r} is already in flight (its text is being "
                                 "encoded); wait for its done or abort it before reusing it")
            rid = self.routes.new_rid(peer, msg.rid)
            ask = self.door.read(msg)
            if self.door.off_loop(ask):   # encoded on a thread; routed by _tick_encoded
                self.encoder.start((peer, msg.rid), partial(self.door.encode, ask),
                                   (rid, t_in, ask), now)
                return
            self._admitted(peer, msg.rid, rid, now, t_in, self.door.admit(
                ask, self.door.encode(ask), self.workers.values()))
        except BadRequest as exc:
            self._refuse_submit(peer, msg.rid, exc)

    def _admitted(self, peer: bytes, label: str, rid: str, t_submit: float, t_in: int,
                  admitted: Admitted) -> None:
        """Place and route a request that passed the door (``t_in``: its arrival, for
        the trace).

        Raises:
            BadRequest: no worker can take it."""
        prompt, params = admitted.prompt, admitted.params
        chosen = self.placement.pick(self.workers.values(), prompt,
                                     len(prompt) + params.max_new_tokens)
        decode, prefill = chosen.decode, chosen.prefill
        self._route(Route(rid, label, peer, decode.name, prefill.name if prefill else "",
                          len(prompt), len(prompt) + params.max_new_tokens, t_submit,
                          text=admitted.text, prompt_ids=pack_ids(prompt) if
                          admitted.options.return_token_ids else b"",
                          prompt=pack_ids(prompt), params=params),
                    prompt, params, decode, prefill)
        trace.mark("router.submit_in", rid, t_in)
        trace.mark("router.req_out", rid)

    def _refuse_submit(self, peer: bytes, label: str, exc: BadRequest) -> None:
        """Answer a refused submission with its code and the parameter at fault."""
        if isinstance(exc, Overloaded):
            self.metrics.encoded(None, type(exc).__name__)
        self.errors[exc.code] += 1
        self.hub.send(peer, Error(label, str(exc), exc.code, param=exc.param or ""))

    def _tick_encoded(self, now: float) -> None:
        """Route the text requests whose encoding finished; fail the ones that failed
        or passed ``encode_timeout_s``."""
        for job in self.encoder.take(now):
            self._encoded(job)

    def _encoded(self, job: Job) -> None:
        peer, label = job.key
        self.metrics.encoded(job.t_done - job.t_submit if job.error is None else None,
                             type(job.error).__name__ if job.error else "")
        try:
            if job.error is not None:
                raise job.error
            rid, t_in, ask = job.context
            self._admitted(peer, label, rid, job.t_submit, t_in,
                           self.door.admit(ask, job.result, self.workers.values()))
        except BadRequest as exc:
            self._refuse_submit(peer, label, exc)

    def _route(self, route: Route, prompt: list[int], params: SamplingParams,
               decode: WorkerInfo, prefill: WorkerInfo | None) -> None:
        self.routes.add(route)
        # admitted: the client hears it now (the HTTP edge answers 200 on it), with the
        # prompt's length as served
        self.hub.send(route.client, Tokens(route.label, [], prompt_tokens=route.prompt_len))
        self.metrics.submitted(route.rid, route.t_submit)
        self._start_attempt(route, decode, prefill)   # its capability, the load counts
        self._send_attempt(route, prompt, params, prefill)

    def _on_abort(self, peer: bytes, msg: Abort) -> None:
        if self.encoder.cancel((peer, msg.rid)) is not None:
            # never routed: no worker holds anything for it
            self.hub.send(peer, Done(msg.rid, "aborted", error="aborted while its text "
                                     "was being encoded"))
            self.metrics.finished("", "aborted")
            return
        route = self.routes.of_client(peer, msg.rid)
        if route is None and is_operator(self.identities.get(peer, "")):
            route = self.routes.get(msg.rid)  # an operator aborts by the router's id
        if route is None:
            self.errors["unknown_rid"] += 1
            self.hub.send(peer, Error(msg.rid, f"abort: unknown rid {msg.rid!r} (not in "
                                      "flight)", "unknown_rid"))
            return
        if route.client != peer and not is_operator(self.identities.get(peer, "")):
            self._forbid(peer, msg, f"abort: {msg.rid!r} was submitted by another client")
            return
        route.aborted_by_client = True
        for name in (route.decode, route.prefill):
            if name:
                self._send_worker(name, Abort(route.rid))

    def _on_status(self, peer: bytes, msg: Status) -> None:
        self.hub.send(peer, StatusReport(
            workers={w.name: {"role": w.role, "ready": w.ready, "lost": w.lost, "pid": w.pid,
                              "paused": w.paused, "draining": bool(w.draining)}
                     for w in self.workers.values()},
            in_flight=len(self.routes) + len(self.encoder), config=self.config.to_dict(),
            errors={**self.errors, **({"unauthenticated": self.hub.refused}
                                      if self.hub.refused else {})},
            metrics_url=self.metrics.url, nonce=msg.nonce))

    def _on_shutdown(self, peer: bytes, msg: Shutdown) -> None:
        logger.info("router: shutdown requested")
        for client, label in self.encoder.cancel_all():   # never routed: nothing to free
            self.hub.send(client, Error(label, "the router is shutting down", "shutdown"))
        self.shutdown_by, self.t_shutdown = peer, time.monotonic()
        for w in self.workers.values():
            if not w.lost:
                self.hub.send(w.peer, Shutdown())

    def _on_ping(self, peer: bytes, msg: Ping) -> None:
        self.hub.send(peer, Pong(self.routes.run, msg.nonce))

    # -- helpers -------------------------------------------------------------------------
    def _release(self, name: str, tokens: int) -> None:
        w = self.workers.get(name)
        if w is not None and tokens:
            w.assigned = max(0, w.assigned - tokens)
            w.routed = max(0, w.routed - 1)

    def _send_worker(self, name: str, msg: Message) -> None:
        w = self.workers.get(name)
        if w is not None and not w.lost and not self.hub.send(w.peer, msg):
            self._lose(w, "unreachable")

    def _maybe_finalize(self, route: Route, force: bool = False) -> None:
        if route.decode_done is None or (route.prefill and route.prefill_info is None
                                         and not force):
            return
        if not self.routes.pop(route):
            return
        if route.text is not None and (tail := route.text.finish()):
            self.hub.send(route.client, Tokens(route.label, [], text=tail))  # held back
        final = route.final()
        self.hub.send(route.client, final)
        self.metrics.finished(route.rid, final.reason)
        if final.ok:
            self.metrics.served(route.prompt_len, final.cached_tokens)

    def _fail(self, route: Route, reason: str, error: str) -> None:
        """End ``route`` before its decode finished: tell the client, abort its workers.
        Re-entrant: aborting a worker may find it gone and fail its other routes."""
        if not self.routes.pop(route):
            return
        if route.text is not None and route.text.stopped:
            # the client had its whole output (cut at a stop string) already
            self.hub.send(route.client, route.final(Done(route.rid, "stop")))
        else:
            self.hub.send(route.client, Done(route.label, reason, error=error))
        self.metrics.finished(route.rid, reason)
        self._release(route.decode, route.row_len if route.decode_done is None else 0)
        self._release(route.prefill, route.attempt_prompt_len if route.prefill_info is None
                      else 0)
        for name in (route.decode, route.prefill):
            if name and route.decode_done is None:
                self._send_worker(name, Abort(route.rid))

    def _lose(self, w: WorkerInfo, why: str) -> None:
        if w.lost:
            return
        w.lost = True
        self.metrics.lost(w.name, w.role)
        self.placement.forget(w.name)
        # after a shutdown every worker leaves: expected, not an error
        log = logger.info if self.shutdown_by is not None else logger.error
        log("router: worker %s (%s, pid %s) lost: %s", w.name, w.role, w.pid, why)
        self._rescue_routes(w, why)
        # its shared memory, if it died on this host: now, and again once it surely
        # finished dying (its connections close before the process is gone)
        reclaim_orphans(self.deployment)
        self._reclaims += [time.monotonic() + 1.0, time.monotonic() + self.config.lease_s]

    def tick(self, now: float) -> None:
        """Timed work: encoded texts, pings, leases, grace periods, request deadlines."""
        self._tick_encoded(now)
        self._tick_probes(now)
        self._tick_drains(now)
        if self._reclaims and now >= min(self._reclaims):
            self._reclaims = [t for t in self._reclaims if t > now]
            reclaim_orphans(self.deployment)
        if now >= self._next_ping:
            self._next_ping = now + self.config.heartbeat_s
            self._probe("unreachable")
        for w in list(self.workers.values()):
            # a worker building its model answers nothing: startup has its own deadline
            limit = self.config.lease_s if w.ready else self.config.ready_timeout_s
            if not w.lost and now - w.last_seen > limit:
                self._lose(w, f"silent for {now - w.last_seen:.1f}s" if w.ready else
                           f"not ready within {limit:.0f}s of registering")
        for route in self.routes:
            if route.decode_done is not None and now >= route.t_grace:
                self._maybe_finalize(route, force=True)
            elif route.decode_done is None and now - route.t_submit > \
                    self.config.request_timeout_s:
                self._fail(route, "timeout", f"no result in {self.config.request_timeout_s}s")

    def _tick_probes(self, now: float) -> None:
        """A connection closed: ping every worker now and a few times more over the next
        ``_PROBE_S`` (its connection is gone from the socket a moment after the event),
        so a killed worker is lost within milliseconds, not after its lease."""
        if self.hub.take_disconnects():
            self._probe_until, self._next_probe, self._probe_gap = now + _PROBE_S, now, 0.005
        if not self._probe_until or now < self._next_probe:
            return
        self._probe("its connection closed")
        self._next_probe, self._probe_gap = now + self._probe_gap, 2 * self._probe_gap
        if now >= self._probe_until:
            self._probe_until = 0.0

    def _probe(self, why: str) -> None:
        """Ping every worker; one whose connection is gone is lost (``why``). Not after a
        shutdown: every worker leaves then, and ``shutdown_complete`` waits for each
        one's final figures (a worker lost meanwhile would not be waited for)."""
        if self.shutdown_by is not None:
            for w in self.workers.values():
                if not w.lost:
                    self.hub.send(w.peer, Ping())
            return
        for w in list(self.workers.values()):
            if not w.lost and not self.hub.send(w.peer, Ping()):
                self._lose(w, why)

    def shutdown_complete(self) -> bool:
        """After a shutdown: True (and ``Bye`` sent to its sender) once every live, ready
        worker sent its final stats or the lease passed. One that never became ready
        served nothing: still building, or a registration that never went further (a
        hostile one, say), it would only hold the shutdown up for a lease."""
        if self.shutdown_by is None:
            return False
        live = [w for w in self.workers.values() if w.ready and not w.lost]
        waited = time.monotonic() - self.t_shutdown
        if all(w.stats is not None for w in live) or waited > self.config.lease_s:
            self.hub.send(self.shutdown_by, Bye({
                w.name: {"role": w.role, **(w.stats or {})} for w in self.workers.values()},
                metrics=self.metrics.snapshot()))
            return True
        return False


def serve_router(address: str, config: ServeConfig, keys: Keys | None = None,
                 metrics_host: str = "127.0.0.1", metrics_port: int | None = None) -> int:
    """Body of ``pdkv router``: serve until an operator asks for shutdown; with
    ``metrics_port``, serve the deployment's metrics at ``http://host:port/metrics``."""
    Router(address, config, keys, metrics_host, metrics_port).serve()
    return 0
