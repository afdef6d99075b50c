"""Requests outlive the workers that serve them: the router moves them elsewhere.

When a worker of a request is lost (its connection closed, or silent past the lease), is
drained past ``drain_timeout_s``, or a decode reports that the KV plane lost the
request's prefill (``peer_lost``, ``timeout``), the router starts a new **attempt** of
the request on other workers instead of failing it:

- the prompt of the new attempt is the request's prompt followed by every token already
  relayed towards the client (``Route.streamed``), its ``max_new_tokens`` what is still
  to come, and ``Req.prior`` the number of tokens it carries, so a seeded sampler draws
  at the same step as before (the draws are a function of seed and step) and a greedy
  request continues with exactly the tokens of a run without the fault;
- a prefill computes that prompt (its host tier supplies what it holds of it) and a
  decode takes it over, exactly as for a new request; the attempt has an id of its own
  (``label#run-n~1``), so its rows, transfers and free-log entries never mix with the
  last attempt's;
- the workers of the last attempt that are still alive are told ``Abort(migrated)``:
  each frees what it held for it with reason ``migrated`` (a decode's half-landed
  pages included), and whatever they still report about it is dropped;
- the client's stream goes on: no error, no repeated token, its ``Done`` counts the
  moves (``migrations``).

A request moves at most ``max_migrations`` times; one that cannot move (that limit, or
no other worker of the role) fails with an error that says why. One whose output was
complete when its decode died (every token relayed, or a stop token) just ends.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets

from common.control import Abort, Done, Prefilled, Req, pack_ids, unpack_ids
from common.request import BadRequest, SamplingParams
from deploy.router.placement import WorkerInfo, admits_at_once, live, pick
from deploy.router.routes import Route

logger = logging.getLogger(__name__)

MOVE_ON_DONE = ("peer_lost", "timeout", "migrated", "aborted", "error")
"""A decode's end reasons that move the request rather than end it: its prompt KV never
fully came (the KV plane lost or timed out the prefill), a worker of it gave it up on its
own (``aborted`` when no client asked), or it failed there (``error``: a tensor-parallel
group that lost a rank fails the step it was in, a prefill that cannot be reached). A
failure that would repeat anywhere costs ``max_migrations`` more attempts, then the
client gets the last one's words."""


class Migrations:
    """The router's part that moves requests (mixed into ``Router``; uses its routes,
    workers, hub, metrics and sending)."""

    # -- when a worker is lost -----------------------------------------------------------
    def _rescue_routes(self, w: WorkerInfo, why: str) -> None:
        """Every request ``w`` owed something moves, or ends if it owes nothing more."""
        for route in self.routes:
            if route.decode_done is not None:
                continue  # the decode ended it; a missing Prefilled waits out the grace
            if w.name == route.decode:
                self._move(route, f"{w.role}_lost", f"worker {w.name} lost: {why}")
            elif w.name == route.prefill and route.prefill_info is None:
                if route.has_kv:  # the decode holds the prompt's KV: nothing is missing
                    self._prefill_done(route, f"prefill {w.name} lost after the transfer")
                else:
                    self._move(route, "prefill_lost", f"worker {w.name} lost: {why}")

    def _prefill_done(self, route: Route, why: str) -> None:
        route.prefill_info = Prefilled(route.rid, "peer_lost", error=why)
        self._release(route.prefill, route.attempt_prompt_len)

    # -- moving one request --------------------------------------------------------------
    def _move(self, route: Route, cause: str, why: str) -> None:
        """Start ``route``'s next attempt on other workers, or end it: complete already,
        cut at a stop string, moved too often, or no worker to take it."""
        if self._complete(route):
            return
        if self.shutdown_by is not None:
            self._fail(route, "error", f"{why}; not moved: the deployment is shutting down")
            return
        if route.migrations >= self.config.max_migrations:
            self._fail(route, "error", f"{why}; not moved again: it moved "
                       f"{route.migrations} times already (max_migrations)")
            return
        params = dataclasses.replace(
            route.params, max_new_tokens=route.params.max_new_tokens - len(route.streamed))
        prompt = unpack_ids(route.prompt).tolist() + route.streamed
        try:
            decode, prefill = pick(self._elsewhere(route), len(prompt),
                                   len(prompt) + params.max_new_tokens)
        except BadRequest as exc:
            self._fail(route, "error", f"{why}; no other worker could take it over: {exc}")
            return
        # the router's state first, the messages after: a send that finds a worker gone
        # loses it at once, and that may move or fail this very request again
        old, left = route.rid, self._leave_attempt(route)
        self.routes.next_attempt(route)
        self.metrics.moved(old, route.rid, cause)
        route.migrations += 1
        route.prior = len(route.streamed)
        self._start_attempt(route, decode, prefill)
        logger.warning("router: %s moved to %s%s as %s (%d tokens carried): %s", old,
                       decode.name, f" via {prefill.name}" if prefill else "", route.rid,
                       route.prior, why)
        for name in left:
            self._send_worker(name, Abort(old, "migrated"))
        self._send_attempt(route, prompt, params, prefill)

    def _elsewhere(self, route: Route) -> list[WorkerInfo]:
        """The workers the next attempt may take: the last attempt's decode only where no
        other worker of its role is up. A decode that ended a request with an error may
        not be counted lost yet (a tensor-parallel group that lost a rank fails its step
        first), and it would fail the request again; a lost prefill is not live anyway."""
        workers = list(self.workers.values())
        return [w for w in workers if w.name != route.decode or
                not any(o.name != route.decode for o in live(workers, w.role))]

    def _complete(self, route: Route) -> bool:
        """End ``route`` here if nothing is missing from its output: every token
        relayed, a stop token relayed, or a stop string cut it (True)."""
        params, streamed = route.params, route.streamed
        stop = bool(streamed) and params.is_stop(streamed[-1])
        if route.text is not None and route.text.stopped:
            stop = True
        if not stop and len(streamed) < params.max_new_tokens:
            return False
        route.decode_done = Done(route.rid, "stop" if stop else "length", n=len(streamed))
        self._release(route.decode, route.row_len)
        if route.prefill and route.prefill_info is None:
            self._prefill_done(route, "its decode ended first")
        self._maybe_finalize(route, force=True)
        return True

    def _leave_attempt(self, route: Route) -> list[str]:
        """Give back what the router counted for the attempt ``route`` leaves; the
        workers that may still hold it (they are told ``Abort(migrated)``)."""
        owes_prefill = bool(route.prefill) and route.prefill_info is None
        self._release(route.decode, route.row_len)
        if owes_prefill:
            self._release(route.prefill, route.attempt_prompt_len)
        return [name for name in (route.prefill if owes_prefill else "", route.decode)
                if name]

    def _start_attempt(self, route: Route, decode: WorkerInfo,
                       prefill: WorkerInfo | None) -> None:
        """The next attempt's workers and the router's load counts for them."""
        route.decode, route.prefill = decode.name, prefill.name if prefill else ""
        route.decode_done = route.prefill_info = route.first_id = None
        route.has_kv, route.t_kv_wall = False, 0.0
        route.cap = secrets.token_hex(16)   # KV only to these two (docs/security.md)
        route.eager = admits_at_once(decode, route.row_len, self.config)
        decode.assigned += route.row_len
        decode.routed += 1
        if prefill is not None:
            prefill.assigned += route.attempt_prompt_len
            prefill.routed += 1  # released with its Prefilled, as a decode's with Done

    def _send_attempt(self, route: Route, prompt: list[int], params: SamplingParams,
                      prefill: WorkerInfo | None) -> None:
        """The same ``Req`` to the attempt's prefill (first: the first token comes from
        its pass) and decode. A send that finds a worker gone may end or move the
        request meanwhile: then this attempt's ``Req`` goes no further."""
        rid = route.rid
        req = Req(rid, pack_ids(prompt), params.to_dict(), prefill=route.prefill,
                  prefill_addr=prefill.kv_addr if prefill else "", decode=route.decode,
                  eager=route.eager, label=route.label, cap=route.cap, prior=route.prior)
        for name in (route.prefill, route.decode):
            if name and self.routes.get(rid) is route:
                self._send_worker(name, req)

    # -- what the decode says ------------------------------------------------------------
    def _moves_on_done(self, route: Route, msg: Done) -> bool:
        """A decode's ``Done`` that ended the request where it was (``MOVE_ON_DONE``):
        move it (True) instead (the decode freed its row already; the ``Abort`` the move
        sends it finds nothing). Past ``max_migrations`` (0: migration off) it ends with
        the workers' own words, as without migration."""
        if msg.ok or msg.reason not in MOVE_ON_DONE or route.aborted_by_client or \
                self.shutdown_by is not None or \
                route.migrations >= self.config.max_migrations:
            return False
        self._move(route, "kv_lost", f"decode {route.decode} ended its transfer "
                   f"({msg.reason}): {msg.error}")
        return True
