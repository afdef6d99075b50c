"""``pdkv replay --plot``: one picture of what the free logs say, read at a glance.

Panels share one time axis (seconds since the earliest log started, by the logs' wall
clocks, so a prefill's and a decode's panels line up):

1. per log and pool: pages by state, stacked (owned, pinned by in-flight I/O, pending:
   freed while pinned). The y axis follows the pages in use, not the pool, so a run that
   uses 1% of its pool still shows its shape; the pool's capacity is a dashed reference
   line (with a note when it lies above the view) and the right axis reads in % of it.
   Legends sit outside the panel, clear of the data and of the capacity line;
2. frees by reason over time: pages freed per time bin, stacked by reason, all logs;
3. with ``--request RID``: that request's pages in every log where it appears (held, and
   pinned among them), with its frees marked by reason.

A ``lost`` marker draws a red line: the counts stop there.
"""

from __future__ import annotations

from collections import defaultdict

from common.freelog.timeline import Timeline

STATES = (("owned", "#4c72b0"), ("pinned", "#dd8452"), ("pending", "#c44e52"))
NUM_BINS = 60
_LEGEND = dict(loc="upper left", bbox_to_anchor=(1.12, 1.0), fontsize="small",
               borderaxespad=0.0)


def build_figure(timelines: list[Timeline], request: str | None = None):
    """The figure (matplotlib ``Figure``, Agg); ``write_plot`` saves it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((t.t0_unix_s for t in timelines), default=0.0)
    panels = [(t, name) for t in timelines for name in t.pools]
    tracked = [t for t in timelines if t.request is not None and t.request.t_s]
    rows = len(panels) + 1 + (1 if request is not None else 0)
    fig, axes = plt.subplots(rows, 1, sharex=True, squeeze=False,
                             figsize=(11, 1.2 + 2.4 * rows))
    axes = list(axes[:, 0])
    for ax, (tl, pool) in zip(axes, panels):
        _occupancy(ax, tl, pool, tl.t0_unix_s - t0)
    _frees(axes[len(panels)], timelines, t0)
    if request is not None:
        _request(axes[-1], tracked, request, t0)
    axes[-1].set_xlabel("seconds since the first log started")
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    return fig


def write_plot(timelines: list[Timeline], out: str, request: str | None = None) -> None:
    import matplotlib.pyplot as plt

    fig = build_figure(timelines, request)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _occupancy(ax, tl: Timeline, pool: str, offset: float) -> None:
    s = tl.pools[pool]
    t = [x + offset for x in s.t_s]
    bottom = [0] * len(t)
    for name, color in STATES:
        values = getattr(s, name)
        top = [b + v for b, v in zip(bottom, values)]
        ax.fill_between(t, bottom, top, step="post", color=color, alpha=0.85, lw=0,
                        label=f"{name} (peak {max(values, default=0):,})")
        bottom = top
    peak, cap = s.peak, s.capacity
    ax.axhline(cap, color="black", ls="--", lw=1.2, label=f"capacity {cap:,} pages")
    top = cap * 1.05 if peak >= cap / 2 else max(peak, 1) * 1.25
    ax.set_ylim(0, top)
    if cap > top:
        ax.text(0.005, 0.97, f"capacity {cap:,} pages is above the view "
                f"(peak {peak:,} = {peak / max(cap, 1):.1%})", transform=ax.transAxes,
                va="top", fontsize="small", color="black")
    for g in tl.gaps:
        ax.axvline(g + offset, color="red", lw=1.5, label="events lost (counts stop)")
    pct = ax.secondary_yaxis("right", functions=(lambda y: y / max(cap, 1) * 100,
                                                 lambda p: p * max(cap, 1) / 100))
    pct.set_ylabel("% of capacity", fontsize="small")
    ax.set_ylabel("pages")
    ax.set_title(f"{tl.node or '?'}: pool {pool} ({_name(tl.path)})", fontsize="medium",
                 loc="left")
    ax.legend(**_LEGEND)


def _frees(ax, timelines: list[Timeline], t0: float) -> None:
    events = [(t + tl.t0_unix_s - t0, reason, n) for tl in timelines for t, reason, n in tl.frees]
    end = max([t for t, _, _ in events] + [tl.end_s + tl.t0_unix_s - t0 for tl in timelines],
              default=1.0) or 1.0
    width = end / NUM_BINS
    by_reason: dict[str, list[int]] = defaultdict(lambda: [0] * NUM_BINS)
    for t, reason, n in events:
        by_reason[reason][min(int(t / width), NUM_BINS - 1)] += n
    centers = [(i + 0.5) * width for i in range(NUM_BINS)]
    bottom = [0] * NUM_BINS
    for reason in sorted(by_reason):
        heights = by_reason[reason]
        ax.bar(centers, heights, width=width * 0.9, bottom=bottom,
               label=f"{reason} ({sum(heights):,} pages)")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel(f"pages freed\nper {width:.3g} s")
    ax.set_title("frees by reason, all logs", fontsize="medium", loc="left")
    if by_reason:
        ax.legend(**_LEGEND)
    else:
        ax.text(0.5, 0.5, "no frees", transform=ax.transAxes, ha="center")


def _request(ax, tracked: list[Timeline], rid: str, t0: float) -> None:
    ax.set_title(f"request {rid}: its pages in each log", fontsize="medium", loc="left")
    ax.set_ylabel("pages")
    if not tracked:
        ax.text(0.5, 0.5, f"{rid} owns no page in these logs", transform=ax.transAxes,
                ha="center")
        return
    for tl in tracked:
        tr, off = tl.request, tl.t0_unix_s - t0
        t = [x + off for x in tr.t_s]
        line, = ax.step(t, tr.held, where="post", lw=2, label=f"{tl.node}: held")
        ax.step(t, tr.pinned, where="post", ls=":", color=line.get_color(),
                label=f"{tl.node}: pinned")
        for te, op, n, why in tr.events:
            if op.endswith(":free") or op.endswith(":handoff"):
                ax.annotate(f"{op.split(':')[1]} {why} ({n})", (te + off, 0),
                            xytext=(2, 12), textcoords="offset points", fontsize="x-small",
                            rotation=45, color=line.get_color())
    ax.set_ylim(bottom=0)
    ax.legend(**_LEGEND)


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]
