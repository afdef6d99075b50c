"""Readings of counters that live in other parts (host tier offloader, speculation), for
``NodeMetrics.read``. They take the parts by duck typing so that common/metrics stays
below common/host and the nodes."""

from __future__ import annotations

from common.metrics.node import NodeMetrics, Reading
from common.request import ReqState


def host_readings(off, page_bytes: int) -> list[Reading]:
    """Pages and bytes an ``Offloader`` copied each way; none without a host tier."""
    if off is None:
        return []
    out: list[Reading] = []
    for direction, pages in (("offload", off.num_offloaded_pages),
                             ("load", off.num_loaded_pages)):
        out.append(("pdkv_host_copy_pages_total", {"direction": direction}, pages))
        out.append(("pdkv_host_copy_bytes_total", {"direction": direction},
                    pages * page_bytes))
    return out


def spec_readings(stats) -> list[Reading]:
    """Draft tokens proposed and accepted (a speculative step's ``stats``), if any."""
    if stats is None:
        return []
    return [("pdkv_spec_draft_tokens_total", {}, stats.num_proposed),
            ("pdkv_spec_accepted_tokens_total", {}, stats.num_accepted)]


def abort_readings(aborted_in) -> list[Reading]:
    """Aborted requests by stage (``{stage: count}``, stages as ``ReqState`` names in lower
    case); every stage a worker has is reported, 0 where none was aborted, so a dashboard
    sees the series from the start."""
    return [("pdkv_request_aborts_total", {"stage": stage}, aborted_in.get(stage, 0))
            for stage in _STAGES]


_STAGES = tuple(s.name.lower() for s in ReqState if not s.is_finished)
"""The stages of a request before its end, as the workers log them."""


def watch_host(metrics: NodeMetrics, off) -> None:
    """Expose the pages of an ``Offloader``'s host tier as tier ``host`` (if any)."""
    if off is not None:
        metrics.watch_pools("host", lambda: [off.host.pool_stats()])
