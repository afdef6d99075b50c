"""A follower rank's figures: what it counts, and how rank 0 reports them to the router.

Only rank 0 of a tensor-parallel group talks to the router, so a follower's metrics
travel through the group: at every heartbeat rank 0's ``health`` step asks each follower
for a ``RankReport`` (its free-log problems, its metric families, and at the last one its
final counters), gathered in one bounded collective (``Lockstep.health``). Rank 0 then
sends one report with every sample labelled ``rank`` (``WorkerMetrics.report``), and its
final ``Stats`` carry each follower's counters under ``tp<r>.``.

Why through rank 0 and not a control link per rank: a follower has no socket but the
group's (no registration, no credentials of its own to check), and one report per group
keeps the router's bookkeeping (liveness, lost workers, final reports) per worker; the
gather costs one small collective per heartbeat on a group that exchanges a step per
pass anyway.
"""

from __future__ import annotations

import logging

from common.kv import KvCache
from common.metrics import NodeMetrics, host_readings, pack, watch_host
from common.node.tp.host import HostMirror
from common.node.tp.lockstep import RankReport
from common.node.worker_metrics import count_transfer
from transport import RankReceiver, RankSender

logger = logging.getLogger(__name__)


class RankMetrics:
    """A follower's ``NodeMetrics``: its device pool, its host tier and copies (``host``, a
    ``HostMirror``), its KV endpoint's counters and data paths, and the transfers
    completed on this rank."""

    def __init__(self, role: str, cache: KvCache, endpoint: RankSender | RankReceiver | None,
                 host: HostMirror | None = None) -> None:
        self.metrics = NodeMetrics(role)
        self.metrics.watch_pools("device", cache.pool_stats)
        watch_host(self.metrics, host)
        if host is not None:
            page_bytes = cache.layout.page_bytes(cache.page_size)
            self.metrics.read(lambda: host_readings(host, page_bytes))
        self.endpoint = endpoint
        self.totals = {"transfers_completed": 0, "transfer_pages": 0, "transfer_bytes": 0}
        if endpoint is not None:
            self.metrics.read(endpoint.readings)

    def report(self, problems: str, final: bool) -> RankReport:
        """This rank's report for a ``health`` step (metrics never fail the step)."""
        try:
            self._count()
            metrics = pack(self.metrics.collect())
        except Exception:
            logger.exception("tp: collecting this rank's metrics failed")
            metrics = b""
        return RankReport(problems, metrics, self.stats() if final else {})

    def _count(self) -> None:
        if self.endpoint is None:
            return
        for direction, pages, nbytes, seconds, path in self.endpoint.take_completed():
            count_transfer(self.metrics, direction, pages, nbytes, seconds, path)
            self.totals["transfers_completed"] += 1
            self.totals["transfer_pages"] += pages
            self.totals["transfer_bytes"] += nbytes

    def stats(self) -> dict[str, float]:
        """This rank's final counters: its completed transfers, and every byte its
        transport moved (``bytes_sent``/``bytes_recv``, as rank 0's stats say)."""
        out: dict[str, float] = dict(self.totals)
        if self.endpoint is not None:
            for name, labels, value in self.endpoint.readings():
                if name == "pdkv_transfer_bytes_total":
                    key = "bytes_sent" if labels["direction"] == "sent" else "bytes_recv"
                    out[key] = value
        return out


def rank_stats(reports: list[RankReport]) -> dict:
    """Rank 0's final-stats entries for its followers: ``tp<r>.<counter>``, and
    ``tp<r>.freelog_problem`` for a follower whose free log did not write."""
    out: dict = {}
    for rank, report in enumerate(reports, 1):
        out.update({f"tp{rank}.{k}": v for k, v in report.stats.items()})
        if report.problems:
            out[f"tp{rank}.freelog_problem"] = report.problems
    return out
