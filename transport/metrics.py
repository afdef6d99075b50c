"""The transport's own counters as metric readings (``common.metrics.NodeMetrics.read``).

``KvSender`` and ``KvReceiver`` count into ``stats`` (a ``Counter``) as they work; this
maps those counts onto the catalogue's ``pdkv_transfer_*`` metrics at report time, and
reports the data path of every live peer (``data_paths``), so that a same-host peer that
fell back from shared memory to frames shows as ``tcp``/``ipc``.
"""

from __future__ import annotations

_ERR = "errors."
_FAILED = "handshake_failed."   # transport.handshake.count_failure: <reason>.<field>


def transport_readings(endpoint, direction: str) -> list[tuple[str, dict[str, str], float]]:
    """Readings of a ``KvSender`` (direction ``sent``) or ``KvReceiver`` (``received``)."""
    st = endpoint.stats
    # shared-memory copies count on both sides too (the decode's from KvWritten)
    nbytes = st["bytes_sent"] if direction == "sent" else st["bytes_recv"] + st[
        "bytes_recv_shm"]
    out = [("pdkv_transfer_bytes_total", {"direction": direction}, nbytes),
           ("pdkv_transfer_in_flight", {"direction": direction}, len(endpoint.transfers)),
           ("pdkv_transfer_lease_expiries_total", {}, st["lease_expiries"]),
           ("pdkv_transfer_handshake_failures_total", {"reason": "timeout", "field": "none"},
            st["timeouts.handshake"]),
           ("pdkv_transfer_aborts_total", {"side": "local"}, st["aborts_sent"]),
           ("pdkv_transfer_aborts_total", {"side": "peer"}, st["aborts_recv"])]
    for key, n in sorted(st.items()):
        if key.startswith(_ERR) and key != "errors.handshake":
            out.append(("pdkv_transfer_protocol_errors_total", {"code": key[len(_ERR):]}, n))
        elif key.startswith(_FAILED) and not key.startswith(f"{_FAILED}timeout."):
            reason, field = key[len(_FAILED):].split(".", 1)
            out.append(("pdkv_transfer_handshake_failures_total",
                        {"reason": reason, "field": field}, n))
    router = getattr(getattr(endpoint, "link", None), "router", None)
    if router is not None:   # a prefill: connections whose KV credentials were refused
        out.append(("pdkv_transfer_handshake_failures_total",
                    {"reason": "refused", "field": "auth"}, router.refused))
    for peer, path in sorted(endpoint.data_paths().items()):
        out.append(("pdkv_transfer_data_path", {"peer": peer, "path": path}, 1))
    return out
