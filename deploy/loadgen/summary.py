"""The numbers a run reports: latency percentiles, throughput, KV moved."""

from __future__ import annotations

import numpy as np

from deploy.loadgen.driver import Result


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(results: dict[str, Result], stats: dict, wall_s: float,
              ttft_target: float = 1.0, tpot_target: float = 0.1,
              this_run_only: bool = False) -> dict:
    """Summary of a run.

    Args:
        results: per-request results from ``drive``.
        stats: the workers' final stats (``Cluster.stop``).
        wall_s: first submission to last result.
        ttft_target, tpot_target: goodput counts requests meeting both (seconds).
        this_run_only: the workers served before this run (``pdkv run --router``): their
            counters span the deployment's lifetime, so only this run's requests count and
            the figures that need worker counters are ``None`` (printed as n/a).
    """
    if this_run_only:
        stats = {}
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
        "kv_transfer_tail_p50_ms": pct([r.xfer_s for r in ok if r.xfer_s > 0], 50) * 1e3,
        "kv_bytes": kv_bytes, "kv_stream_busy_s": busy,
        "kv_gb_per_s": None if this_run_only else (kv_bytes / busy / 1e9 if busy > 0 else 0.0),
        "this_run_only": this_run_only,
        "goodput_rps": len(good) / wall_s if wall_s > 0 else 0.0,
        "ttft_target_s": ttft_target, "tpot_target_s": tpot_target,
        **(dict.fromkeys(_COUNTER_FIGURES) if this_run_only else spec_and_host(stats)),
    }


_COUNTER_FIGURES = ("acceptance_rate", "mean_accepted_len", "offloaded_pages",
                    "prefix_hit_pages", "prefix_hit_pages_prefill", "retracted")


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
    rate = "" if s["kv_gb_per_s"] is None else f", {s['kv_gb_per_s']:.3f} GB/s while streaming"
    if s["kv_bytes"]:
        # the tail delays the second token: the first goes from the prefill to the router
        lines.append(f"  KV moved      {s['kv_bytes'] / 1e6:.2f} MB{rate}; transfer tail p50 "
                     f"{s['kv_transfer_tail_p50_ms']:.1f} ms (before the second token)")
    elif s.get("this_run_only"):
        lines.append("  KV moved      0 B reported by this run's requests")
    else:
        lines.append("  KV moved      0 B (colocated: no transfer)")
    if s.get("this_run_only"):
        lines.append("  speculation   n/a, host tier n/a (attached: the workers' counters "
                     "span the deployment's lifetime, not this run)")
        return "\n".join(lines)
    lines.append(f"  speculation   acceptance {s['acceptance_rate']:.2f}, mean accepted "
                 f"length {s['mean_accepted_len']:.2f} tokens/step")
    lines.append(f"  host tier     {s['offloaded_pages']} pages offloaded, "
                 f"{s['prefix_hit_pages']} prefix-hit pages "
                 f"({s['prefix_hit_pages_prefill']} at prefill), {s['retracted']} retracted")
    return "\n".join(lines)
