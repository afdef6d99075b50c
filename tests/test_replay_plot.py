"""``pdkv replay --plot``: the picture is checked through the figure object, not pixels.

Two real logs written by ``KvCache``: a prefill (16-page pool, nearly full at its peak)
and a decode (512 pages, a few percent used). Request ``req-1`` lives in both: prefilled
and sent while pinned, received while pinned, decoded, finished with its speculative tail.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import KvCache
from common.freelog import replay_file
from common.freelog.timeline import build_timeline

matplotlib = pytest.importorskip("matplotlib")
from common.freelog.plot import build_figure  # noqa: E402  (needs matplotlib)

REPO = Path(__file__).resolve().parents[1]
PAGE = 4


def prefill_log(path: Path) -> str:
    cache = KvCache(16, PAGE, log_path=path, node="prefill-0")
    rows = []
    for i in range(3):  # 3 requests of 4 pages each: 12 of 15 pages in use
        kv = cache.open_row(f"req-{i}")
        cache.extend(kv, 16)
        rows.append((kv, cache.pin(kv, 0, 16, reason="send")))
        time.sleep(0.01)
    for kv, pin in rows:
        cache.free_kv_row(kv, [(0, 16)], reason="sent")  # pending until the send completes
        time.sleep(0.01)
        cache.unpin(pin)
        cache.close_row(kv)
    cache.close()
    return cache.free_log.path


def decode_log(path: Path) -> str:
    cache = KvCache(512, PAGE, log_path=path, node="decode-0")
    kv = cache.open_row("req-1")
    cache.extend(kv, 16)
    pin = cache.pin(kv, 0, 16, reason="receive")
    time.sleep(0.01)
    cache.unpin(pin)
    for _ in range(3):
        cache.extend(kv, 4)
        time.sleep(0.005)
    cache.commit(kv, 26)
    other = cache.open_row("req-9")
    cache.extend(other, 8)
    cache.free_kv_row(other, [(0, 8)], reason="aborted")
    cache.close_row(other)
    cache.free_kv_row(kv, [(0, 28), (28, 28)], reason="finished")
    cache.close_row(kv)
    cache.close()
    return cache.free_log.path


@pytest.fixture
def logs(tmp_path) -> list[str]:
    return [prefill_log(tmp_path / "prefill-0.freelog"), decode_log(tmp_path / "decode-0.freelog")]


def _labels(ax) -> list[str]:
    return [h.get_label() for h in ax.get_legend_handles_labels()[0]]


def test_the_figure_has_shared_time_stacked_states_capacity_and_frees(logs):
    fig = build_figure([build_timeline(p, "req-1") for p in logs], "req-1")
    main = [ax for ax in fig.axes if ax.get_title(loc="left")]  # secondary y axes have no title
    assert [ax.get_title(loc="left") for ax in main] == [
        "prefill-0: pool full (prefill-0.freelog)", "decode-0: pool full (decode-0.freelog)",
        "frees by reason, all logs", "request req-1: its pages in each log"]
    for ax in main[1:]:
        assert main[0].get_shared_x_axes().joined(main[0], ax)  # one time axis
    reports = [replay_file(p) for p in logs]
    for ax, report in zip(main[:2], reports):
        stacked = [c.get_label().split(" ")[0] for c in ax.collections]
        assert stacked == ["owned", "pinned", "pending"]
        cap = report.pools["full"]["capacity"]
        capacity = [ln for ln in ax.get_lines() if ln.get_label().startswith("capacity")]
        assert len(capacity) == 1 and list(capacity[0].get_ydata()) == [cap, cap]
    prefill, decode = main[0], main[1]
    assert prefill.get_ylim()[1] >= 15  # 12 of 15 pages at the peak: capacity in view
    assert decode.get_ylim()[1] < 511  # 9 of 511: the view follows the data
    assert any("above the view" in t.get_text() for t in decode.texts)
    assert not any("above the view" in t.get_text() for t in prefill.texts)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in main:
        legend = ax.get_legend()
        assert legend is not None
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


def test_stacked_states_and_frees_agree_with_replay(logs):
    timelines = [build_timeline(p) for p in logs]
    for tl, path in zip(timelines, logs):
        report = replay_file(path)
        s = tl.pools["full"]
        assert s.peak == report.pools["full"]["peak_in_use"]
        assert max(s.pending) > 0 if tl.node == "prefill-0" else max(s.pinned) > 0
        assert (s.owned[-1], s.pinned[-1], s.pending[-1]) == (0, 0, 0)
    fig = build_figure(timelines)
    frees = next(ax for ax in fig.axes if ax.get_title(loc="left") == "frees by reason, all logs")
    drawn = {c.get_label().split(" ")[0]: sum(b.get_height() for b in c)
             for c in frees.containers}
    expected: dict[str, int] = {}
    for path in logs:
        for reason, v in replay_file(path).pools["full"]["frees_by_reason"].items():
            expected[reason] = expected.get(reason, 0) + v["pages"]
    assert drawn == expected == {"sent": 12, "aborted": 2, "finished": 7}


def test_request_panel_follows_one_request_across_workers(logs):
    fig = build_figure([build_timeline(p, "req-1") for p in logs], "req-1")
    panel = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith("request req-1"))
    lines = {ln.get_label(): ln for ln in panel.get_lines()}
    assert set(lines) == {"prefill-0: held", "prefill-0: pinned", "decode-0: held",
                          "decode-0: pinned"}
    assert max(lines["prefill-0: held"].get_ydata()) == 4
    assert max(lines["prefill-0: pinned"].get_ydata()) == 4  # sent while pinned
    assert max(lines["decode-0: held"].get_ydata()) == 7  # 16 + 12 tokens on 4-slot pages
    assert list(lines["decode-0: held"].get_ydata())[-1] == 0
    notes = [t.get_text() for t in panel.texts]
    assert "free sent (4)" in notes and "free finished (7)" in notes
    prefill_t = lines["prefill-0: held"].get_xdata()
    decode_t = lines["decode-0: held"].get_xdata()
    assert min(decode_t) > min(prefill_t)  # the decode log started later, on the same axis


def test_an_unknown_request_says_so(logs):
    fig = build_figure([build_timeline(p, "nobody") for p in logs], "nobody")
    panel = fig.axes[-1] if fig.axes[-1].get_title(loc="left") else fig.axes[-2]
    assert any("owns no page" in t.get_text() for t in panel.texts)


def test_a_lost_marker_draws_where_the_counts_stop(tmp_path):
    import msgpack

    path = tmp_path / "gap.freelog"
    pk = msgpack.Packer(use_bin_type=True)
    with open(path, "wb") as f:
        f.write(pk.pack({"format": "pdkv-freelog", "version": 1, "node": "d",
                         "pools": {"full": {"num_pages": 8, "page_size": 4, "reserved": [0]}},
                         "created_unix_ns": 1}))
        f.write(pk.pack({"seq": 0, "t_ns": 10**8, "op": "alloc", "pool": "full",
                         "pages": b"\x01\x00\x00\x00", "owner": "r"}))
        f.write(pk.pack({"seq": 1, "t_ns": 2 * 10**8, "op": "lost", "pool": "", "pages": b"",
                         "count": 3, "error": "ENOSPC"}))
    tl = build_timeline(path)
    assert tl.gaps == [0.2]
    ax = build_figure([tl]).axes[0]
    assert "events lost (counts stop)" in _labels(ax)


def test_cli_plot_with_a_request(tmp_path, logs):
    png = tmp_path / "p.png"
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "replay", "--plot", str(png),
                          "--request", "req-1", *logs], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "deploy.cli", "replay", "--request", "req-1",
                          *logs], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "give --plot" in bad.stderr
