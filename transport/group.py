"""A tensor-parallel worker's KV transport: every rank moves the KV of its own heads.

Each rank of a disaggregated group has its own endpoint on its own pool (a prefill rank a
``KvSender``, a decode rank a ``KvReceiver``); the head mapping (``transport.tp``) pairs
each prefill rank with the decode ranks whose heads overlap its own. Rank 0 is the worker:
it wraps its endpoint in a ``GroupSender``/``GroupReceiver``, which records every call
that starts or stops a transfer (``expect``, ``send``, ``finish``, ``announce``, ``abort``)
in the lockstep (``Lockstep.record_transfer``); each follower repeats them on its own
endpoint (``RankSender``/``RankReceiver``, driven by ``Mirror``). The page ids of a request
are the same on every rank because rank 0 allocated them and the followers mirror its
cache; the transfer itself runs on each rank at its own pace.

A request's transfer is done only when it is done on every rank: rank 0 holds back its
endpoint's ``COMPLETED`` and asks the group (``Lockstep.agree``: the rids travel in the
step, then one all-reduce MIN of one status per rid, the same shape on every rank):

    status   meaning on a rank
    1        done (prefill: every leg acknowledged; decode: every leg's KV landed)
    0        under way
    < 0      ended otherwise: -1 - ABORT_REASONS.index(reason)

All 1: ``COMPLETED`` goes to the worker (a prefill frees ``sent``, a decode starts
decoding). Any < 0: the worker gets ``FAILED`` with that rank's reason. Still 0 after
``chunk_timeout_s``: ``FAILED`` (``timeout``). Whatever ends a request on rank 0 is
recorded as ``x_abort``, so every follower stops its part too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from .events import Event, EventKind
from .limits import ABORT_REASONS
from .metrics import transport_readings

logger = logging.getLogger(__name__)

DONE, PENDING = 1, 0


def failed(reason: str) -> int:
    """The status of a part that ended with ``reason`` (unknown reasons count as error)."""
    return -1 - ABORT_REASONS.index(reason if reason in ABORT_REASONS else "error")


def reason_of(status: int) -> str:
    return ABORT_REASONS[-1 - status] if -len(ABORT_REASONS) <= status < 0 else "error"


class _Agreement:
    """Rank 0's ``COMPLETED`` events, held until every rank's part is done."""

    def __init__(self, lockstep, deadline_s: float, what: str) -> None:
        self.lockstep, self.deadline_s, self.what = lockstep, deadline_s, what
        self.held: dict[str, tuple[Event, float]] = {}

    def settle(self) -> list[Event]:
        """Ask the group about every held rid; the events that are decided."""
        if not self.held:
            return []
        rids = list(self.held)
        verdicts = self.lockstep.agree(rids, [DONE] * len(rids))
        out, now = [], time.monotonic()
        for rid, verdict in zip(rids, verdicts):
            ev, since = self.held[rid]
            if verdict == DONE:
                out.append(ev)
            elif verdict < 0:
                reason = reason_of(verdict)
                out.append(replace(ev, kind=EventKind.FAILED, reason=reason, detail=(
                    f"the {self.what} of another tensor-parallel rank ended ({reason})")))
            elif now - since > self.deadline_s:
                out.append(replace(ev, kind=EventKind.FAILED, reason="timeout", detail=(
                    f"rank 0's {self.what} completed, another tensor-parallel rank's did "
                    f"not within {self.deadline_s:.0f} s")))
            else:
                continue
            del self.held[rid]
        return out


class _GroupEndpoint:
    """What ``GroupSender`` and ``GroupReceiver`` share: forwarding, abort, agreement."""

    what = "transfer"

    def __init__(self, endpoint, lockstep, advertise: str) -> None:
        self._real, self._lockstep = endpoint, lockstep
        self._agreement = _Agreement(lockstep, endpoint.config.chunk_timeout_s, self.what)
        got = lockstep.group.gather_bytes(advertise.encode())
        self.rank_addresses = [a.decode() for a in got]
        """Every rank's KV address, in rank order (what decodes of a prefill dial)."""

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def abort(self, rid: str, reason: str = "aborted", detail: str = "") -> bool:
        stopped = self._real.abort(rid, reason, detail)  # raises on a bad reason first
        self._agreement.held.pop(rid, None)
        self._lockstep.record_transfer("x_abort", rid, text=reason, detail=detail)
        return stopped

    def poll(self, timeout_s: float = 0.0) -> list[Event]:
        out = []
        for ev in self._real.poll(timeout_s):
            if ev.kind == EventKind.COMPLETED:
                self._agreement.held[ev.rid] = (ev, time.monotonic())
                continue
            out.append(ev)
            if ev.kind.is_final:  # ended on rank 0: the other ranks stop their part
                self._lockstep.record_transfer("x_abort", ev.rid, text=ev.reason or "error",
                                               detail=ev.detail)
        for ev in self._agreement.settle():
            out.append(ev)
            if ev.kind != EventKind.COMPLETED:
                self._lockstep.record_transfer("x_abort", ev.rid, text=ev.reason,
                                               detail=ev.detail)
        return out


class GroupSender(_GroupEndpoint):
    """Rank 0's ``KvSender`` in a prefill group (the followers' run ``RankSender``)."""

    def expect(self, rid: str, cap: str) -> None:
        self._real.expect(rid, cap)
        self._lockstep.record_transfer("x_expect", rid, text=cap)

    def send(self, rid: str, kv, upto: int) -> bool:
        self._lockstep.record_transfer("x_send", rid, n=int(upto))
        return self._real.send(rid, kv, upto)

    def finish(self, rid: str, kv, first_token: int) -> bool:
        self._lockstep.record_transfer("x_finish", rid, n=int(first_token))
        return self._real.finish(rid, kv, first_token)


class GroupReceiver(_GroupEndpoint):
    """Rank 0's ``KvReceiver`` in a decode group (the followers' run ``RankReceiver``)."""

    what = "KV transfer"

    def __init__(self, endpoint, lockstep) -> None:
        super().__init__(endpoint, lockstep, "")
        self._addresses: dict[int, list[str]] = {}

    def begin_connect(self, addresses: list[str] | str) -> int:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        group = self._real.begin_connect(addresses)
        self._addresses[group] = addresses
        return group

    def connect(self, addresses: list[str] | str) -> int:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        group = self._real.connect(addresses)
        self._addresses[group] = addresses
        return group

    def announce(self, rid: str, kv, prompt_len: int, cached_tokens: int = 0,
                 group: int = 0, cap: str = "") -> None:
        self._real.announce(rid, kv, prompt_len, cached_tokens, group, cap)
        self._lockstep.record_transfer("x_announce", rid, n=int(prompt_len),
                                       m=int(cached_tokens), text=cap,
                                       detail=",".join(self._addresses[group]))


class _RankEndpoint:
    """A follower's endpoint: repeats rank 0's transfer ops, keeps each rid's status and
    the transfers completed on this rank (its metrics, ``take_completed``)."""

    direction = ""

    def __init__(self, endpoint, node: str) -> None:
        self.endpoint, self.node = endpoint, node
        self.statuses: dict[str, int] = {}
        self.completed: list[tuple[str, int, int, float, str]] = []

    def apply(self, op, kv) -> None:
        """One ``x_*`` op; a failure fails this rank's part of the rid, never the rank."""
        try:
            if op.op == "x_abort":
                self.endpoint.abort(op.owner, op.text if op.text in ABORT_REASONS
                                    else "error", op.detail)
            elif kv is None:
                raise ValueError(f"{op.op} for {op.owner!r}, which holds no row here")
            else:
                self._start(op, kv)
        except Exception as exc:  # contained: the group learns it at the next agreement
            logger.warning("%s: %s of %s failed here: %s", self.node, op.op, op.owner, exc)
            self.statuses[op.owner] = failed("error")

    def _start(self, op, kv) -> None:
        raise NotImplementedError

    def status(self, rid: str) -> int:
        return self.statuses.get(rid, PENDING)

    def forget(self, rid: str) -> None:
        self.statuses.pop(rid, None)

    def poll(self, timeout_s: float) -> None:
        for ev in self.endpoint.poll(timeout_s):
            if ev.kind == EventKind.COMPLETED:
                self.statuses[ev.rid] = DONE
                self.completed.append(self._counted(ev))
            elif ev.kind.is_final:
                self.statuses[ev.rid] = failed(ev.reason)
            elif ev.kind in (EventKind.PEER_LOST, EventKind.HANDSHAKE_FAILED):
                logger.error("%s: %s %s: %s", self.node, ev.kind.name, ev.peer, ev.detail)

    def close(self) -> None:
        self.endpoint.close()

    def sockets(self) -> list:
        return self.endpoint.sockets()

    def poll_within(self) -> float | None:
        return self.endpoint.poll_within()

    def heartbeat(self) -> int:
        return self.endpoint.heartbeat()

    def _counted(self, ev: Event) -> tuple[str, int, int, float, str]:
        raise NotImplementedError

    def take_completed(self) -> list[tuple[str, int, int, float, str]]:
        out, self.completed = self.completed, []
        return out

    def readings(self) -> list[tuple[str, dict[str, str], float]]:
        return transport_readings(self.endpoint, self.direction)


class RankSender(_RankEndpoint):
    """A prefill follower's ``KvSender``: sends this rank's heads of what rank 0 sends."""

    direction = "sent"

    def __init__(self, endpoint, node: str) -> None:
        super().__init__(endpoint, node)
        self.finished: dict[str, float] = {}  # rid -> when rank 0's prefill finished

    def apply(self, op, kv) -> None:
        if op.op == "x_expect":  # before the row exists: the router just routed it here
            self.endpoint.expect(op.owner, op.text)
            return
        super().apply(op, kv)

    def forget(self, rid: str) -> None:
        super().forget(rid)
        self.finished.pop(rid, None)

    def _start(self, op, kv) -> None:
        if op.op == "x_send":
            self.endpoint.send(op.owner, kv, op.n)
        elif op.op == "x_finish":
            self.finished[op.owner] = time.monotonic()
            self.endpoint.finish(op.owner, kv, op.n)
        else:
            raise ValueError(f"a prefill rank does not take {op.op}")

    def _counted(self, ev: Event) -> tuple[str, int, int, float, str]:
        """As rank 0 counts it: the prompt's pages less the decode's cached prefix, the
        prefill's end (here: its ``x_finish``) to the last acknowledgement."""
        cache = self.endpoint.cache
        ps = cache.page_size
        pages = -(-ev.prompt_len // ps) - ev.cached_tokens // ps
        since = self.finished.pop(ev.rid, None)
        seconds = 0.0 if since is None else time.monotonic() - since
        return ("sent", pages, pages * cache.layout.page_bytes(ps), seconds, ev.path)


class RankReceiver(_RankEndpoint):
    """A decode follower's ``KvReceiver``: receives this rank's heads from the prefill
    ranks that hold them, into the row rank 0 allocated (the same page ids)."""

    direction = "received"

    def __init__(self, endpoint, node: str) -> None:
        super().__init__(endpoint, node)
        self.groups: dict[tuple[str, ...], int] = {}

    def _counted(self, ev: Event) -> tuple[str, int, int, float, str]:
        return ("received", ev.kv_pages, ev.kv_bytes, ev.xfer_s, ev.path)

    def _start(self, op, kv) -> None:
        if op.op != "x_announce":
            raise ValueError(f"a decode rank does not take {op.op}")
        addresses = tuple(op.detail.split(","))
        group = self.groups.get(addresses)
        if group is None or self.endpoint.group_lost(group):
            group = self.groups[addresses] = self.endpoint.begin_connect(list(addresses))
        self.endpoint.announce(op.owner, kv, op.n, op.m, group, cap=op.text)
