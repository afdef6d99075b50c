"""The numbers a run reports: latency percentiles, throughput, KV moved."""

from __future__ import annotations

import numpy as np

from deploy.driver import Result


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(results: dict[str, Result], stats: dict, wall_s: float,
              ttft_target: float = 1.0, tpot_target: float = 0.1) -> dict:
    """Summary of a run.

    Args:
        results: per-request results from ``drive``.
        stats: the workers' final stats (``Cluster.stop``).
        wall_s: first submission to last result.
        ttft_target, tpot_target: goodput counts requests meeting both (seconds).
    """
    ok = [r for r in results.values() if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if len(r.output_ids) > 1]
    xfer_share = [r.xfer_s / r.ttft_s for r in ok if r.ttft_s > 0]
    tokens = sum(len(r.output_ids) for r in ok)
    # workers' own count after a shutdown; else what the requests report (attached runs)
    kv_bytes = sum(int(s.get("bytes_sent", 0)) for s in stats.values()) or sum(
        r.kv_bytes for r in results.values())
    busy = sum(float(s.get("stream_busy_s", 0.0)) for s in stats.values())
    good = [r for r in ok if r.ttft_s <= ttft_target and r.tpot_s <= tpot_target]
    reasons: dict[str, int] = {}
    for r in results.values():
        reasons[r.reason or "unfinished"] = reasons.get(r.reason or "unfinished", 0) + 1
    return {
        "requests": len(results), "ok": len(ok), "reasons": reasons,
        "wall_s": wall_s, "output_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "tpot_p50_ms": pct(tpot, 50) * 1e3, "tpot_p99_ms": pct(tpot, 99) * 1e3,
        "kv_transfer_share_of_ttft_p50": pct(xfer_share, 50),
        "kv_bytes": kv_bytes, "kv_stream_busy_s": busy,
        "kv_gb_per_s": kv_bytes / busy / 1e9 if busy > 0 else 0.0,
        "goodput_rps": len(good) / wall_s if wall_s > 0 else 0.0,
        "ttft_target_s": ttft_target, "tpot_target_s": tpot_target,
        **spec_and_host(stats),
    }


def spec_and_host(stats: dict) -> dict:
    """Speculation and host-tier figures summed over the workers' final stats."""
    def total(key: str, role: str | None = None) -> int:
        return sum(int(s.get(key, 0)) for s in stats.values()
                   if role is None or s.get("role") == role)
    proposed, seq_steps = total("spec_proposed"), total("spec_seq_steps")
    return {
        "acceptance_rate": total("spec_accepted") / proposed if proposed else 0.0,
        "mean_accepted_len": total("spec_emitted") / seq_steps if seq_steps else 0.0,
        "offloaded_pages": total("offloaded_pages"),
        "prefix_hit_pages": total("prefix_hit_pages"),
        "prefix_hit_pages_prefill": total("prefix_hit_pages", "prefill"),
        "retracted": total("retracted"),
    }


def format_summary(s: dict, mode: str, layout: str) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["reasons"].items()))
    lines = [
        f"pdkv run: {mode} {layout}",
        f"  requests      {s['requests']} ({reasons}) in {s['wall_s']:.1f} s",
        f"  TTFT          p50 {s['ttft_p50_ms']:.1f} ms   p99 {s['ttft_p99_ms']:.1f} ms",
        f"  TPOT          p50 {s['tpot_p50_ms']:.1f} ms   p99 {s['tpot_p99_ms']:.1f} ms",
        f"  throughput    {s['tokens_per_s']:.1f} output tokens/s ({s['output_tokens']} tokens)",
    ]
    if s["kv_bytes"]:
        lines.append(f"  KV moved      {s['kv_bytes'] / 1e6:.2f} MB, {s['kv_gb_per_s']:.3f} GB/s "
                     f"while streaming; transfer tail p50 "
                     f"{s['kv_transfer_share_of_ttft_p50']:.1%} of TTFT")
    else:
        lines.append("  KV moved      0 B (colocated: no transfer)")
    lines.append(f"  speculation   acceptance {s['acceptance_rate']:.2f}, mean accepted "
                 f"length {s['mean_accepted_len']:.2f} tokens/step")
    lines.append(f"  host tier     {s['offloaded_pages']} pages offloaded, "
                 f"{s['prefix_hit_pages']} prefix-hit pages "
                 f"({s['prefix_hit_pages_prefill']} at prefill), {s['retracted']} retracted")
    return "\n".join(lines)
