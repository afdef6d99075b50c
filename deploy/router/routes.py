"""The router's requests in flight: who asked, who serves, what each worker reported.

A client's rid is a label: the router gives every submission its own id (``label#run-n``,
unique across router restarts), which is what workers, transports and free logs see.
Messages back to the client carry the label again. A client may not reuse a label while
its request is still in flight (its aborts would be ambiguous); once it ended, the label
is free, so a seeded workload runs again against the same deployment.

A request the router moved to other workers (``deploy.router.migration``) gets a new id
per attempt, the attempt's number appended (``label#run-n~1``): every attempt has rows
and transfers of its own, and reports about an earlier attempt are told apart from
strays (``retired``).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from common.control import Done, Prefilled
from common.request import BadRequest, SamplingParams
from deploy.router.text_route import TextRoute

MAX_LABEL = 256
"""Longest client rid: the router's id (``label#run-n``) stays within what the KV
transport carries (512)."""
_RETIRED = 4096
"""Ids of earlier attempts remembered, so that their late reports are dropped quietly."""


@dataclass
class Route:
    """One request in flight."""

    rid: str
    """The router's id of this submission (workers see it)."""
    label: str
    """The client's rid."""
    client: bytes
    decode: str
    prefill: str
    prompt_len: int
    row_len: int
    t_submit: float
    decode_done: Done | None = None
    prefill_info: Prefilled | None = None
    t_grace: float = 0.0
    t_kv_wall: float = 0.0
    """Wall clock when the decode held all KV and the first token (0: not yet)."""
    first_id: int | None = None
    """The first token as relayed to the client (the prefill's or the decode's, whichever
    came first; None: not yet)."""
    aborted_by_client: bool = False
    text: TextRoute | None = None
    """Its output text: detokenizer, stop ids and stop strings (None: the model has no
    tokenizer)."""
    prompt_ids: bytes = b""
    """The prompt's ids for the client (it asked: ``return_token_ids``)."""
    cap: str = ""
    """The KV capability only this request's decode and prefill get (docs/security.md)."""
    prompt: bytes = b""
    """The prompt's ids (``pack_ids``): a new attempt starts from them."""
    params: SamplingParams | None = None
    """The sampling parameters as admitted."""
    streamed: list[int] = field(default_factory=list)
    """Every output id relayed towards the client so far, over all attempts."""
    migrations: int = 0
    """Attempts before this one (how often the request moved)."""
    prior: int = 0
    """Output ids of earlier attempts: this attempt's prompt ends with them."""
    eager: bool = False
    """This attempt's decode surely admits at once: its prefill need not wait."""
    has_kv: bool = False
    """This attempt's decode holds the prompt's KV (it streamed a token): its prefill
    owes nothing more."""

    @property
    def attempt_prompt_len(self) -> int:
        """Prompt tokens this attempt's prefill computes (the prompt and ``prior``)."""
        return self.prompt_len + self.prior

    def final(self, done: Done | None = None) -> Done:
        """The client's ``Done``: the decode's (or ``done``), with the prefill's figures
        and words, and the output's text."""
        done, info = done or self.decode_done, self.prefill_info
        if self.text is not None:
            if self.text.stopped:  # cut at a stop string: whatever the decode did after
                done = dataclasses.replace(done, reason="stop", error="",
                                           n=self.text.num_ids)
            done = dataclasses.replace(done, text=self.text.text)
        out = dataclasses.replace(done, rid=self.label, prompt_tokens=self.prompt_len,
                                  prompt_ids=self.prompt_ids, migrations=self.migrations)
        if self.aborted_by_client and not done.ok:
            out = dataclasses.replace(out, reason="aborted")  # a race may say "error"
        if info is None:
            return out
        # cached: prompt tokens a host tier held, on whichever side held more (the
        # prefill's were not computed, the decode's not transferred)
        out = dataclasses.replace(out, xfer_s=info.xfer_s, kv_bytes=info.kv_bytes,
                                  cached_tokens=max(done.cached_tokens, info.cached_tokens))
        if info.error and not done.ok:
            # the prefill's words name the cause; the decode's only say the transfer ended
            out = dataclasses.replace(out, error=info.error + (
                f" (decode: {done.error})" if done.error else ""))
        if info.t_finish_wall and self.t_kv_wall:
            # exposed transfer: prefill's last chunk computed -> decode holds KV + token
            out = dataclasses.replace(out, xfer_s=max(0.0, self.t_kv_wall
                                                      - info.t_finish_wall))
        return out


def label_of(rid: str) -> str:
    """The client's label of a router id (``label#run-n``): what logs and free logs name."""
    return rid.rsplit("#", 1)[0]


class RouteTable:
    """Routes by the router's id and by (client, label)."""

    def __init__(self) -> None:
        self.run = secrets.token_hex(2)
        """This router incarnation's tag in every id it gives."""
        self._next = 0
        self._by_rid: dict[str, Route] = {}
        self._by_label: dict[tuple[bytes, str], str] = {}
        self._retired: OrderedDict[str, None] = OrderedDict()

    def new_rid(self, client: bytes, label: str) -> str:
        """An id for a new submission of ``label`` by ``client``.

        Raises:
            BadRequest: the label is empty, too long or not printable (it names the
                request in every message, log line and free log), or the client's request
                of that label is still in flight.
        """
        if not 0 < len(label) <= MAX_LABEL or not label.isprintable():
            raise BadRequest(f"rid must be 1..{MAX_LABEL} printable characters, got "
                             f"{len(label)}: {label[:40]!r}")
        if (client, label) in self._by_label:
            raise BadRequest(f"rid {label!r} is already in flight; wait for its done or "
                             "abort it before reusing it")
        self._next += 1
        return f"{label}#{self.run}-{self._next}"

    def add(self, route: Route) -> None:
        self._by_rid[route.rid] = route
        self._by_label[(route.client, route.label)] = route.rid

    def get(self, rid: str) -> Route | None:
        return self._by_rid.get(rid)

    def next_attempt(self, route: Route) -> str:
        """Give ``route`` the id of its next attempt (``<first id>~<n>``); the id of the
        attempt it leaves is ``retired``."""
        old = route.rid
        first = old.rsplit("~", 1)[0] if route.migrations else old  # a label may hold "~"
        new = f"{first}~{route.migrations + 1}"
        del self._by_rid[old]
        self._by_rid[new] = route
        self._by_label[(route.client, route.label)] = new
        route.rid = new
        self._retired[old] = None
        while len(self._retired) > _RETIRED:
            self._retired.popitem(last=False)
        return new

    def retired(self, rid: str) -> bool:
        """``rid`` named an attempt of a request that moved on (late reports about it
        are expected, not strays)."""
        return rid in self._retired

    def of_client(self, client: bytes, label: str) -> Route | None:
        rid = self._by_label.get((client, label))
        return None if rid is None else self._by_rid[rid]

    def pop(self, route: Route) -> bool:
        """Forget ``route``; False when it was gone already (ended by another path)."""
        if self._by_rid.get(route.rid) is not route:
            return False
        del self._by_rid[route.rid]
        del self._by_label[(route.client, route.label)]
        return True

    def __len__(self) -> int:
        return len(self._by_rid)

    def __iter__(self):
        """A snapshot: handlers may end routes while the caller iterates."""
        return iter(list(self._by_rid.values()))
