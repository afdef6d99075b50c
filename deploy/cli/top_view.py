"""``pdkv top``: a live terminal view of a deployment's KV pages, queues and transfers.

It reads the same metrics Prometheus scrapes, either from the router over the control
plane (``--router ADDR``) or from a ``/metrics`` URL (``--url``: the front door's, or the
router's ``--metrics-port``), once a second, and draws them with ``rich``: one row per
worker with its device pool as a stacked bar (owned, pinned, pending, free), its host
tier, batch and queues, transfers in flight and their data path, and rates.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from deploy.cli.top_model import Scrape, TopView, WorkerRow, view

logger = logging.getLogger(__name__)

BAR_WIDTH = 24
# (state, bar glyph style): in the order they are stacked
_STATES = (("owned", "green"), ("pinned", "yellow"), ("pending", "red"))


def http_source(url: str, timeout_s: float) -> Callable[[], Scrape]:
    def read() -> Scrape:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode()
        return Scrape.of(text_string_to_metric_families(text), time.monotonic())
    return read


def render(v: TopView) -> Group:
    """One frame: header line, the workers table, frees by reason."""
    return Group(_header(v), _workers_table(v), _frees_table(v))


def _header(v: TopView) -> Text:
    up = sum(1 for w in v.workers if w.up)
    # a picture the source no longer confirms says nothing about who is up now
    state = ("NOT ANSWERING: workers unknown, last picture below", "bold red") if v.error \
        else (f"{up}/{len(v.workers)} workers up",
              "bold green" if up == len(v.workers) else "bold red")
    t = Text.assemble(("pdkv top", "bold"), f"  {v.source}  ", state,
                      f"  in flight {v.in_flight:.0f}",
                      f"  TTFT p50 {_secs(v.ttft_p50)} p99 {_secs(v.ttft_p99)}",
                      f"  {_num(v.tokens_per_s)} tok/s")
    if v.error:
        t.append(f"\n{v.error}", style="bold red")
    return t


def _workers_table(v: TopView) -> Table:
    table = Table(expand=False, pad_edge=False, box=None, header_style="bold")
    for col, justify in (("worker", "left"), ("role", "left"), ("up", "center"),
                         ("device KV", "left"), ("owned", "right"), ("pinned", "right"),
                         ("pending", "right"), ("free", "right"), ("host KV", "right"),
                         ("run", "right"), ("queued", "right"), ("retracted", "right"),
                         ("xfer", "right"), ("path", "left"), ("tok/s", "right"),
                         ("KV MB/s", "right"), ("freed/s", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for w in v.workers:
        up = Text("?", "bold red") if v.error else Text("up", "green") if w.up \
            else Text("LOST", "bold red")
        table.add_row(w.name, w.role, up,
                      _bar(w), *(_num(w.device.get(s, 0.0)) for s in
                                 ("owned", "pinned", "pending", "free")),
                      _host(w), _num(w.running),
                      _num(w.queues.get("prefill", 0.0) + w.queues.get("admission", 0.0)),
                      _num(w.queues.get("retracted", 0.0)), _num(w.in_flight), _paths(w),
                      _num(w.tokens_per_s), _num(None if w.kv_bytes_per_s is None
                                                 else w.kv_bytes_per_s / 1e6),
                      _num(w.freed_pages_per_s))
    return table


def _frees_table(v: TopView) -> Table:
    table = Table(title="pages freed by reason", title_justify="left", box=None,
                  header_style="bold", pad_edge=False)
    table.add_column("reason")
    table.add_column("pages", justify="right")
    table.add_column("pages/s", justify="right")
    for reason, (pages, rate) in v.frees_by_reason.items():
        table.add_row(reason, _num(pages), _num(rate))
    return table


def _bar(w: WorkerRow) -> Text:
    """The device pool as a stacked bar, like htop's memory meter."""
    cap = w.device_capacity
    text = Text()
    if cap <= 0:
        return Text("-")
    used = 0
    for state, style in _STATES:
        cells = round(w.device.get(state, 0.0) / cap * BAR_WIDTH)
        cells = min(cells, BAR_WIDTH - used)
        text.append("█" * cells, style=style)
        used += cells
    text.append("·" * (BAR_WIDTH - used), style="dim")
    text.append(f" {100 * (1 - w.device.get('free', 0.0) / cap):3.0f}%")
    return text


def _host(w: WorkerRow) -> str:
    if not w.host_capacity:
        return "-"
    return f"{w.host_used:.0f}/{w.host_capacity:.0f}"


def _paths(w: WorkerRow) -> Text:
    if not w.paths:
        return Text("-")
    kinds = sorted(set(w.paths.values()))
    return Text(",".join(kinds), style="bold yellow" if "shm" not in kinds else "")


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.0f}k"
    return f"{x:.0f}" if x == int(x) or abs(x) >= 100 else f"{x:.1f}"


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.2f}s"


def run(read: Callable[[], Scrape], source: str, interval_s: float = 1.0,
        once: bool = False, console: Console | None = None) -> int:
    """Draw frames until Ctrl-C (or one frame with ``once``); a failed read shows its error
    and is retried at the next tick."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a log: room for every column
            console = Console(width=200)
    before: Scrape | None = None
    if once:  # two reads an interval apart, so that the frame has rates
        try:
            before = read()
            time.sleep(interval_s)
            now = read()
        except Exception as exc:  # a CLI answer, not a traceback
            console.print(f"pdkv top: cannot read {source}: {exc}", style="bold red")
            return 1
        console.print(render(view(now, before, source)))
        return 0
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                t0 = time.monotonic()
                before = _frame(live, read, before, source)
                time.sleep(max(0.0, interval_s - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return 0


def _frame(live: Live, read: Callable[[], Scrape], before: Scrape | None,
           source: str) -> Scrape | None:
    try:
        now = read()
    except Exception as exc:  # show the failure, keep the last picture, try again
        if before is not None:
            frame = view(before, None, source)
            frame.error = f"read failed: {exc}"
            live.update(render(frame), refresh=True)
        else:
            live.update(Text(f"pdkv top {source}: read failed: {exc}", style="bold red"),
                        refresh=True)
        return before
    live.update(render(view(now, before, source)), refresh=True)
    return now
