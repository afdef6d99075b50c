"""Which registrations ("announces") a prefill honours: per-request KV capabilities
(docs/security.md).

The router makes a random capability for every request and gives it to the request's
decode and prefill only. The prefill worker registers it (``KvSender.expect``); the
decode puts it in its ``Register``. An announce is honoured only with the registered
capability; one with another is refused (``forbidden``) and counted, and leaves the
request untouched for the real decode. Since the router's ``Req`` and the decode's
``Register`` travel on different connections, an announce may arrive before the
prefill knows the capability: it is held until then, at most ``hold_s`` (then refused),
and at most a few per request and in all, so nobody can fill the prefill's memory.
"""

from __future__ import annotations

import hmac
from collections import Counter, OrderedDict
from dataclasses import dataclass

from .messages import ErrorCode, ProtocolError, Register
from .peers import Peer

# capabilities outlive their transfers (a late forged announce is refused at once, not
# held); a rid the router routes again gets a new one; the oldest are forgotten first
_MAX_CAPS = 1 << 16
_MAX_HELD = 1024        # announces waiting for their capability, in all
_MAX_HELD_PER_RID = 8   # ... and for one rid (TP ranks of the real decode, a few strays)


@dataclass
class Held:
    peer: Peer
    msg: Register
    t_arrival: float


class Capabilities:
    """The capability check of one prefill endpoint.

    Args:
        required: False admits every announce (tests and benchmarks without a router).
        hold_s: longest an announce waits for its capability.
        stats: the endpoint's counters (``refused.announce``, ``held.announce``).
    """

    def __init__(self, required: bool, hold_s: float, stats: Counter) -> None:
        self.required, self.hold_s, self.stats = required, hold_s, stats
        self._caps: OrderedDict[str, str] = OrderedDict()
        self._held: dict[str, list[Held]] = {}

    def admit(self, peer: Peer, msg: Register, now: float) -> bool:
        """True: honour ``msg`` now; False: held until its capability is known.

        Raises:
            ProtocolError: ``forbidden``: a wrong capability, or too many held announces.
        """
        if not self.required:
            return True
        want = self._caps.get(msg.rid)
        if want is not None:
            self._check(want, msg)
            return True
        held = self._held.setdefault(msg.rid, [])
        if len(held) >= _MAX_HELD_PER_RID or self.num_held >= _MAX_HELD:
            if not held:
                del self._held[msg.rid]
            self._refuse(msg, "too many announces wait for their request")
        held.append(Held(peer, msg, now))
        self.stats["held.announce"] += 1
        return False

    def expect(self, rid: str, cap: str) -> tuple[list[Held], list[tuple[Held, ProtocolError]]]:
        """Register ``rid``'s capability.

        Returns:
            the held announces that carry it (the caller honours them now), and the
            refused ones with their error (the caller answers each to its peer).
        """
        self._caps[rid] = cap
        self._caps.move_to_end(rid)
        while len(self._caps) > _MAX_CAPS:
            self._caps.popitem(last=False)
        ready, refused = [], []
        for h in self._held.pop(rid, []):
            if hmac.compare_digest(h.msg.cap.encode(), cap.encode()):
                ready.append(h)
            else:
                refused.append((h, self._error(h.msg, "wrong capability")))
        return ready, refused

    def expire(self, now: float) -> list[tuple[Held, ProtocolError]]:
        """Held announces past ``hold_s`` (no such request came): refused."""
        out = []
        for rid in [r for r, hs in self._held.items() if now - hs[0].t_arrival > self.hold_s]:
            keep = []
            for h in self._held.pop(rid):
                if now - h.t_arrival > self.hold_s:
                    out.append((h, self._error(h.msg, f"no request {rid!r} came to this "
                                               f"prefill within {self.hold_s}s")))
                else:
                    keep.append(h)
            if keep:
                self._held[rid] = keep
        return out

    def drop_peer(self, key: bytes) -> None:
        """A lost peer's held announces go (nobody waits for an answer)."""
        for rid in list(self._held):
            kept = [h for h in self._held[rid] if h.peer.key != key]
            if kept:
                self._held[rid] = kept
            else:
                del self._held[rid]

    @property
    def num_held(self) -> int:
        return sum(len(hs) for hs in self._held.values())

    def _check(self, want: str, msg: Register) -> None:
        if not hmac.compare_digest(want.encode(), msg.cap.encode()):
            self._refuse(msg, "wrong capability")

    def _refuse(self, msg: Register, why: str) -> None:
        raise self._error(msg, why)

    def _error(self, msg: Register, why: str) -> ProtocolError:
        self.stats["refused.announce"] += 1
        return ProtocolError(ErrorCode.FORBIDDEN, f"announce of {msg.rid!r} refused: {why} "
                             "(the router gives each request's capability to its decode "
                             "only)", msg.rid)
