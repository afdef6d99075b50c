"""What replay learns from the digests in a free log, and the check across logs.

Three records ride on ``unpin`` events (docs/freelog.md, "Digests"); readers that predate
them ignore the keys:

- ``xfer`` (a transfer's send or receive pin): per leg ``{"rid", "dir": "sent" | "recv",
  "peer", "runs": [[first_block, num_blocks, head_start, head_end, epoch, digest,
  (claimed)], ...]}``; a receive record adds ``dest_pages`` (int32 bytes of the request's
  destination pages) and may carry ``refused`` (data messages refused for their pages or
  their digest: ``{"kind", "first_block", "num_blocks", "detail"}``).
- ``store`` (the host tier's pin of an offload copy): one digest per unpinned host page,
  computed over the page as it was stored.
- ``load`` (the host tier's pin of a prefix load): one digest per unpinned host page,
  computed as it was loaded; ``rid`` names the request that loaded it.

Within one log replay checks that each received run's digest equals the one its message
claimed, that a loaded host page's digest equals the one it was stored with, and reports
refused messages; ``cross_check`` joins the runs of several logs (a prefill's ``sent``,
a decode's ``recv``) by request, blocks, heads and destination epoch and checks that every
digest received equals the one sent. Each finding names the request and the pages.
"""

from __future__ import annotations

import numpy as np

from common.freelog.report import Violation

RunKey = tuple  # (rid, first_block, num_blocks, head_start, head_end, epoch)


class DigestLedger:
    """The digests one log recorded; ``check_*`` return its own findings as violations."""

    def __init__(self, node: str):
        self.node = node
        self.sent: dict[RunKey, tuple[int | None, str]] = {}   # key -> (digest, peer)
        self.received: dict[RunKey, tuple[int | None, int | None, list[int], int]] = {}
        self.findings: list[Violation] = []
        self.stored: dict[tuple[str, int], int] = {}            # (pool, page) -> digest
        self.counts = {"runs_sent": 0, "runs_received": 0, "runs_refused": 0,
                       "pages_stored": 0, "pages_loaded": 0}

    # -- reading ----------------------------------------------------------------------------
    def take(self, ev: dict, pool: str, pages, seq: int) -> None:
        """One ``unpin`` event's records (malformed ones become findings)."""
        try:
            for leg in ev.get("xfer") or ():
                self._xfer(leg, pool, seq)
            if "store" in ev:
                self._store(ev["store"], pool, pages, seq)
            if "load" in ev:
                self._load(ev, pool, pages, seq)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self._find(seq, "malformed-event", pool, f"digest record unreadable ({exc!r})")

    def _xfer(self, leg: dict, pool: str, seq: int) -> None:
        rid, direction = leg["rid"], leg["dir"]
        dest = np.frombuffer(leg["dest_pages"], "<i4") if leg.get("dest_pages") else None
        for run in leg["runs"]:
            key = (rid, *map(int, run[:5]))
            if direction == "sent":
                self.sent[key] = (run[5], leg.get("peer", ""))
                self.counts["runs_sent"] += 1
                continue
            pages = [] if dest is None else dest[key[1]:key[1] + key[2]].tolist()
            got, claimed = run[5], run[6] if len(run) > 6 else None
            self.received[key] = (got, claimed, pages, seq)
            self.counts["runs_received"] += 1
            if got is not None and claimed is not None and got != claimed:
                self._mismatch(seq, pool, rid, key, pages, got, claimed, "its message")
        for refused in leg.get("refused") or ():
            self.counts["runs_refused"] += 1
            first, num = int(refused["first_block"]), int(refused["num_blocks"])
            pages = [] if dest is None else dest[first:first + num].tolist()
            kind = "digest-mismatch" if refused["kind"] == "corrupt" else "refused-pages"
            self._find(seq, kind, pool, f"{rid}: blocks [{first}, {first + num}) (pages "
                       f"{_short(pages)}) refused on landing: {refused.get('detail', '')}",
                       owner=rid, pages=pages)

    def _store(self, digests: list, pool: str, pages, seq: int) -> None:
        for page, digest in zip(pages, digests, strict=True):
            self.stored[(pool, int(page))] = digest
        self.counts["pages_stored"] += len(digests)

    def _load(self, ev: dict, pool: str, pages, seq: int) -> None:
        rid = ev.get("rid", "?")
        bad = []
        for page, digest in zip(pages, ev["load"], strict=True):
            want = self.stored.get((pool, int(page)))
            if want is not None and digest is not None and digest != want:
                bad.append(int(page))
        self.counts["pages_loaded"] += len(ev["load"])
        if bad:
            self._find(seq, "digest-mismatch", pool, f"{rid}: host pages {_short(bad)} "
                       "loaded with digests other than they were stored with", owner=rid,
                       pages=bad)

    # -- findings ---------------------------------------------------------------------------
    def _mismatch(self, seq: int, pool: str, rid: str, key: RunKey, pages: list[int],
                  got, want, what: str) -> None:
        self._find(seq, "digest-mismatch", pool, f"{rid}: blocks [{key[1]}, "
                   f"{key[1] + key[2]}) heads [{key[3]}, {key[4]}) (pages {_short(pages)}) "
                   f"landed with digest {_hex(got)}, {what} says {_hex(want)}", owner=rid,
                   pages=pages)

    def _find(self, seq: int, kind: str, pool: str, message: str, owner: str | None = None,
              pages: list[int] | None = None) -> None:
        pages = pages or []
        self.findings.append(Violation(seq=seq, kind=kind, pool=pool, message=message,
                                       owner=owner, page=pages[0] if pages else None,
                                       num_pages=len(pages), pages=pages[:8]))


def cross_check(ledgers: list[DigestLedger]) -> tuple[list[Violation], dict]:
    """Join what the logs sent with what they received.

    Returns:
        the mismatches (each names the request, the receiving node and its pages) and
        counts: runs matched, runs received whose sender's log was not given, runs sent
        that no given log received (an aborted request, or its decode's log missing).
    """
    sent = {}
    for ledger in ledgers:
        for key, (digest, _) in ledger.sent.items():
            sent[key] = (digest, ledger.node)
    found, matched, unmatched = [], 0, 0
    received = set()
    for ledger in ledgers:
        for key, (got, claimed, pages, seq) in ledger.received.items():
            received.add(key)
            if key not in sent:
                unmatched += 1
                continue
            want, sender = sent[key]
            if want is None or got is None:
                continue
            if got != want or (claimed is not None and claimed != want):
                found.append(Violation(
                    seq=seq, kind="digest-mismatch", pool="",
                    message=f"{key[0]}: blocks [{key[1]}, {key[1] + key[2]}) heads "
                            f"[{key[3]}, {key[4]}) (pages {_short(pages)} of "
                            f"{ledger.node}) were sent by {sender} with digest {_hex(want)}"
                            f", landed with {_hex(got)} (the message said "
                            f"{_hex(claimed)})", owner=key[0],
                    page=pages[0] if pages else None, num_pages=len(pages),
                    pages=pages[:8]))
            else:
                matched += 1
    counts = {"runs_matched": matched, "runs_received_unmatched": unmatched,
              "runs_sent_unreceived": len(set(sent) - received),
              "mismatches": len(found)}
    return found, counts


def _hex(value) -> str:
    return "none" if value is None else f"{int(value):#018x}"


def _short(pages: list[int], limit: int = 8) -> str:
    if len(pages) <= limit:
        return f"[{', '.join(map(str, pages))}]"
    return f"[{', '.join(map(str, pages[:limit]))}, ... ({len(pages)} pages)]"
