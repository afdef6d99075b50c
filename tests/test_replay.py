"""Stories for ``pdkv replay``: hand-made free logs and what replay says about them.

Pool ``full`` has 16 pages of 4 slots; page 0 is reserved. Logs are written with raw
msgpack so that each story can break the rules the real writer never breaks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from common.freelog import FreeLogWriter, ReplayReport, UnreadableLog, replay_file
from common.freelog import replay_main as main

REPO = Path(__file__).resolve().parents[1]
HEADER = {"format": "pdkv-freelog", "version": 1, "node": "decode-0",
          "pools": {"full": {"num_pages": 16, "page_size": 4, "reserved": [0]}},
          "created_unix_ns": 1}


def write_log(path: Path, events: list[dict], header: dict | None = None,
              tail: bytes = b"") -> Path:
    """Number the events (unless they carry a seq) and write them after the header."""
    packer = msgpack.Packer(use_bin_type=True)
    with open(path, "wb") as f:
        f.write(packer.pack(HEADER if header is None else header))
        for seq, ev in enumerate(events):
            ev = {"seq": seq, "t_ns": 1000 * seq, "pool": "full", **ev}
            ev["pages"] = np.asarray(ev.get("pages", []), dtype="<i4").tobytes()
            f.write(packer.pack(ev))
        f.write(tail)
    return path


def alloc(owner, *pages):
    return {"op": "alloc", "owner": owner, "pages": list(pages)}


def free(owner, *pages, reason="finished"):
    return {"op": "free", "owner": owner, "reason": reason, "pages": list(pages)}


def pin(pin_id, *pages, reason="send"):
    return {"op": "pin", "pin": pin_id, "reason": reason, "pages": list(pages)}


def unpin(pin_id, *pages):
    return {"op": "unpin", "pin": pin_id, "pages": list(pages)}


def release(*pages):
    return {"op": "release", "pages": list(pages)}


def close(*retained):
    return {"op": "close", "pool": "", "retained": list(retained)}


def replay(tmp_path: Path, events: list[dict], **kw) -> ReplayReport:
    return replay_file(write_log(tmp_path / "log.freelog", events, **kw))


def only_violation(report: ReplayReport):
    assert report.num_violations == 1, report.format()
    return report.violations[0]


# -- clean logs ------------------------------------------------------------------------------
def test_a_request_sent_while_pinned_replays_clean(tmp_path):
    report = replay(tmp_path, [
        alloc("req-1", 1, 2, 3),
        pin(7, 1, 2, 3),
        free("req-1", 1, 2, 3, reason="sent"),  # pages pending until the unpin
        unpin(7, 1, 2, 3),
        release(1, 2, 3),
        alloc("req-2", 3, 2),
        {"op": "handoff", "owner": "req-2", "to": "cache:prefix", "pages": [3]},
        free("req-2", 2),
        close("cache:prefix"),
    ])
    assert report.ok and report.exit_code == 0, report.format()
    assert report.closed and report.close_seq == 8 and report.events == 9
    full = report.pools["full"]
    assert full["pages_allocated"] == 5 and full["pages_freed"] == 4
    assert full["pages_released"] == 3 and full["peak_in_use"] == 3
    assert full["in_use_at_end"] == 1  # page 3, held by the retained cache
    assert full["frees_by_reason"] == {"finished": {"events": 1, "pages": 1},
                                       "sent": {"events": 1, "pages": 3}}
    assert report.warnings == []


def test_the_real_writer_log_replays_clean(tmp_path):
    path = tmp_path / "writer.freelog"
    log = FreeLogWriter(path, node="prefill-0",
                        pools={"full": {"num_pages": 16, "page_size": 4, "reserved": [0]},
                               "swa": {"num_pages": 8, "page_size": 4, "reserved": [0]}})
    log.alloc("full", np.array([4, 5]), "req-9")
    log.alloc("swa", np.array([1]), "req-9")
    log.pin("full", np.array([4, 5]), 1, "send")
    log.free("full", np.array([4, 5]), "req-9", "sent", ranges=[(0, 6)])
    log.free("swa", np.array([1]), "req-9", "sent")
    log.unpin("full", np.array([4, 5]), 1)
    log.release("full", np.array([4, 5]))
    log.close()
    report = replay_file(path)
    assert report.ok, report.format()
    assert set(report.pools) == {"full", "swa"} and report.events == 8


# -- violations ------------------------------------------------------------------------------
def test_double_free_names_the_page_and_the_previous_free(tmp_path):
    report = replay(tmp_path, [alloc("req-1", 5, 6), free("req-1", 5, 6),
                               free("req-1", 6), close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.page, v.owner) == ("double-free", 2, 6, "req-1")
    assert v.last == {"seq": 1, "op": "free", "owner": "req-1"}
    assert report.exit_code == 1


def test_free_by_a_foreign_owner(tmp_path):
    report = replay(tmp_path, [alloc("req-1", 4), alloc("req-2", 9),
                               free("req-2", 4, 9), free("req-1", 4), close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.page, v.owner) == ("foreign-free", 2, 4, "req-2")
    assert "owned by req-1" in v.message
    assert v.last == {"seq": 0, "op": "alloc", "owner": "req-1"}


def test_reuse_of_a_page_freed_while_pinned(tmp_path):
    report = replay(tmp_path, [alloc("req-1", 3), pin(1, 3, reason="offload"),
                               free("req-1", 3, reason="aborted"),
                               alloc("req-2", 3),  # the copy still reads page 3
                               unpin(1, 3), release(3), close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.page, v.owner) == ("reuse-while-pinned", 3, 3, "req-2")
    assert "pending" in v.message
    assert v.last == {"seq": 2, "op": "free", "owner": "req-1"}


def test_double_allocation(tmp_path):
    report = replay(tmp_path, [alloc("req-1", 2), alloc("req-2", 2), free("req-1", 2),
                               close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.page, v.owner) == ("double-alloc", 1, 2, "req-2")


def test_pin_of_a_free_page(tmp_path):
    report = replay(tmp_path, [pin(4, 8), unpin(4, 8), close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.page) == ("pin-free-page", 0, 8)


def test_unpin_of_an_unknown_pin(tmp_path):
    report = replay(tmp_path, [alloc("req-1", 1), pin(1, 1), unpin(1, 1), unpin(1, 1),
                               free("req-1", 1), close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.page) == ("unknown-unpin", 3, 1)


def test_release_must_follow_the_last_unpin_and_list_exactly_the_pending_pages(tmp_path):
    report = replay(tmp_path, [alloc("req-1", 1, 2), pin(1, 1, 2),
                               free("req-1", 1, 2), unpin(1, 1, 2), release(1), close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.page) == ("release-mismatch", 4, 2)
    assert report.pools["full"]["in_use_at_end"] == 0  # both are free after the unpin

    missing = replay(tmp_path, [alloc("req-1", 1), pin(1, 1), free("req-1", 1),
                                unpin(1, 1), alloc("req-2", 1), close("req-2")])
    v = only_violation(missing)
    assert (v.kind, v.seq, v.pages) == ("missing-release", 4, [1])


def test_leak_at_close_names_the_owner_and_its_pages(tmp_path):
    report = replay(tmp_path, [alloc("req-1", 1), alloc("req-7", 10, 11, 12),
                               free("req-1", 1), close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.owner, v.num_pages, v.pages) == ("leak", 3, "req-7", 3,
                                                              [10, 11, 12])
    assert "req-7 still holds 3 page(s)" in report.format()


def test_retained_cache_owner_at_close_is_not_a_leak(tmp_path):
    report = replay(tmp_path, [
        alloc("req-1", 1, 2),
        {"op": "handoff", "owner": "req-1", "to": "cache:prefix", "pages": [1, 2]},
        close("cache:prefix")])
    assert report.ok, report.format()
    assert report.retained == ["cache:prefix"]


def test_pin_still_live_at_close(tmp_path):
    report = replay(tmp_path, [alloc("c", 1), pin(3, 1, reason="send"), close("c")])
    v = only_violation(report)
    assert (v.kind, v.seq, v.page) == ("pinned-at-close", 2, 1)


def test_seq_gap_and_seq_not_starting_at_zero(tmp_path):
    events = [{"seq": 0, **alloc("r", 1)}, {"seq": 1, **free("r", 1)},
              {"seq": 5, **close()}]
    v = only_violation(replay(tmp_path, events))
    assert (v.kind, v.seq) == ("seq-gap", 5)
    assert "expected 2, got 5" in v.message

    late = replay(tmp_path, [{"seq": 3, **alloc("r", 1)}, {"seq": 4, **free("r", 1)},
                             {"seq": 5, **close()}])
    assert only_violation(late).kind == "seq-gap"


def test_events_after_close(tmp_path):
    v = only_violation(replay(tmp_path, [close(), alloc("r", 1)]))
    assert (v.kind, v.seq) == ("event-after-close", 1)


def test_printed_violations_are_capped_but_all_counted(tmp_path, capsys):
    events = [free("ghost", p) for p in range(1, 16)] * 4 + [close()]
    path = write_log(tmp_path / "many.freelog", events)
    report = replay_file(path, max_violations=10)
    assert report.num_violations == 60 and len(report.violations) == 10
    assert main(_args(path, max_violations=5)) == 1
    out = capsys.readouterr().out
    assert "... and 55 more" in out


# -- the end of the log --------------------------------------------------------------------
def test_torn_tail_is_a_warning(tmp_path):
    torn = msgpack.packb({"seq": 2, "op": "close", "pool": "", "retained": []})[:-3]
    report = replay(tmp_path, [alloc("r", 1), free("r", 1)], tail=torn)
    assert report.ok and report.exit_code == 0, report.format()
    assert any("torn last record" in w for w in report.warnings)
    assert any("no close event" in w for w in report.warnings)


def test_no_close_is_a_warning_and_held_pages_are_not_leaks(tmp_path):
    report = replay(tmp_path, [alloc("r", 1, 2)])
    assert report.ok and not report.closed
    assert report.warnings == ["no close event: the process did not shut down cleanly "
                               "(killed?); 2 page(s) in use and 0 live pin(s) at the end "
                               "are not judged"]


@pytest.mark.parametrize("content, expect", [
    (None, "cannot open"),
    (b"", "empty file"),
    (b"this is not msgpack at all", "not a free log"),
    (b"\xc1\xc1\xc1", "not a msgpack free log"),
    (msgpack.packb({"format": "pdkv-freelog", "version": 2, "pools": {}}), "version 2"),
    (msgpack.packb({"format": "pdkv-freelog", "version": 1,
                    "pools": {"full": {"num_pages": 0, "page_size": 4}}}), "num_pages"),
])
def test_unreadable_input_raises_and_exits_2(tmp_path, content, expect):
    path = tmp_path / "bad.freelog"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UnreadableLog, match=expect):
        replay_file(path)
    assert main(_args(path)) == 2


def test_unknown_keys_are_ignored(tmp_path):
    header = {**HEADER, "build": "abc"}
    report = replay(tmp_path, [{**alloc("r", 1), "trace_id": 7}, free("r", 1), close()],
                    header=header)
    assert report.ok, report.format()


# -- the command line ------------------------------------------------------------------------
def _args(*logs, **kw):
    import argparse

    return argparse.Namespace(logs=[str(p) for p in logs], json=kw.get("json", False),
                              plot=None, progress=False,
                              max_violations=kw.get("max_violations", 50))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", "replay", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_exit_codes_and_json(tmp_path):
    clean = write_log(tmp_path / "clean.freelog", [alloc("r", 1), free("r", 1), close()])
    dirty = write_log(tmp_path / "dirty.freelog", [alloc("r", 1), close()])
    assert _cli(str(clean)).returncode == 0
    assert _cli(str(clean), str(dirty)).returncode == 1
    assert _cli(str(clean), str(tmp_path / "missing.freelog")).returncode == 2

    out = _cli("--json", str(clean), str(dirty))
    report = json.loads(out.stdout)
    assert (report["ok"], report["exit_code"]) == (False, 1)
    first, second = report["logs"]
    assert first["ok"] and first["pools"]["full"]["pages_allocated"] == 1
    assert second["violations"][0]["kind"] == "leak"
    assert second["violations"][0]["pages"] == [1]


def test_cli_help_lists_every_option():
    out = _cli("--help").stdout
    for option in ("--json", "--plot", "--progress", "--no-progress", "--max-violations",
                   "exit status"):
        assert option in out


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path / "p.freelog", [alloc("r", 1, 2), free("r", 1, 2), close()])
    png = tmp_path / "occupancy.png"
    result = _cli("--plot", str(png), str(log))
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- scale: long events, many owners -------------------------------------------------------
def test_events_longer_than_the_fast_table(tmp_path):
    header = {**HEADER, "pools": {"full": {"num_pages": 1024, "page_size": 4,
                                           "reserved": [0]}}}
    pages = list(range(1, 601))
    report = replay(tmp_path, [alloc("big", *pages), pin(1, *pages), free("big", *pages),
                               unpin(1, *pages), release(*reversed(pages)),
                               free("big", 600), close()], header=header)
    v = only_violation(report)
    assert (v.kind, v.seq, v.page) == ("double-free", 5, 600)
    assert report.pools["full"]["pages_released"] == 600


def test_owner_table_is_compacted_and_names_stay_right(tmp_path, monkeypatch):
    import common.freelog.replay as replay_module

    monkeypatch.setattr(replay_module, "CHECK_EVERY", 8)
    events = []
    for i in range(200):  # 200 owners over a 15-page pool: compacted several times
        events += [alloc(f"req-{i}", 1 + i % 15), free(f"req-{i}", 1 + i % 15)]
    events += [alloc("req-last", 5), free("req-199", 5), close("req-last")]
    v = only_violation(replay(tmp_path, events))
    assert (v.kind, v.page, v.owner) == ("foreign-free", 5, "req-199")
    assert v.last == {"seq": 400, "op": "alloc", "owner": "req-last"}


# -- events of many pages ----------------------------------------------------------------
BIG = list(range(1, 15))


def test_bulk_events_pinned_while_freed_release_at_the_last_unpin(tmp_path):
    report = replay(tmp_path, [alloc("req-1", *BIG), pin(1, *BIG), pin(2, *BIG[:12]),
                               free("req-1", *BIG), unpin(2, *BIG[:12]), unpin(1, *BIG),
                               release(*BIG), alloc("req-2", *BIG), free("req-2", *BIG),
                               close()])
    assert report.ok, report.format()
    assert report.pools["full"]["pages_released"] == 14


def test_bulk_double_free_names_the_page(tmp_path):
    v = only_violation(replay(tmp_path, [alloc("req-1", *BIG), free("req-1", *BIG[:13]),
                                         free("req-1", *BIG), close()]))
    assert (v.kind, v.seq, v.page) == ("double-free", 2, 1)


def test_bulk_pin_of_free_pages_and_missing_release_are_caught(tmp_path):
    v = only_violation(replay(tmp_path, [alloc("req-1", *BIG[:13]), pin(1, *BIG),
                                         unpin(1, *BIG), free("req-1", *BIG[:13]), close()]))
    assert (v.kind, v.page) == ("pin-free-page", 14)
    report = replay(tmp_path, [alloc("req-1", *BIG), pin(1, *BIG), free("req-1", *BIG),
                               unpin(1, *BIG), close()])
    assert "missing-release" in report.violations_by_kind, report.format()


# -- lost events (the writer could not write: docs/freelog.md "When the disk fails") ---------
def lost(seq, count, error="ENOSPC (No space left on device)"):
    return {"seq": seq, "op": "lost", "pool": "", "count": count, "error": error}


def test_lost_events_make_a_log_incomplete_and_never_clean(tmp_path):
    report = replay(tmp_path, [
        alloc("req-1", 1),                                # seq 0, judged
        lost(1, 5),                                       # seqs 1..5 never written
        {**free("req-1", 1), "seq": 6},                   # page 1: unknown -> free
        {**alloc("req-2", 1), "seq": 7},                  # free -> owned: fine
        {**free("req-2", 1), "seq": 8},
        {**close(), "seq": 9},
    ])
    assert report.incomplete and not report.ok and report.exit_code == 3
    assert report.num_violations == 0, report.format()
    assert report.lost_events == 5 and report.judged_after_gap == 3
    assert report.unknown_pages_at_end == 14  # 15 allocatable, page 1 seen again
    assert report.gaps == [{"seq": 1, "count": 5, "error": "ENOSPC (No space left on device)"}]
    assert report.closed and report.close_seq == 9
    text = report.format()
    assert "INCOMPLETE: 5 event(s) lost in 1 gap(s), the first at seq 1" in text
    assert "3 event(s) after it judged from what they show" in text
    assert text.endswith("INCOMPLETE (not proven clean)")


def test_a_violation_before_the_gap_still_fails_with_1(tmp_path):
    report = replay(tmp_path, [alloc("r", 1), free("r", 1), free("r", 1), lost(3, 2),
                               {**close(), "seq": 5}])
    assert report.violations_by_kind == {"double-free": 1}
    assert report.incomplete and report.exit_code == 1


def test_a_release_due_at_the_gap_is_not_a_violation(tmp_path):
    report = replay(tmp_path, [alloc("r", 1), pin(1, 1), free("r", 1), unpin(1, 1),
                               lost(4, 1), {**close(), "seq": 5}])
    assert report.num_violations == 0 and report.exit_code == 3, report.format()


def test_seqs_after_a_gap_must_resume_at_seq_plus_count(tmp_path):
    report = replay(tmp_path, [alloc("r", 1), lost(1, 3), {**free("r", 1), "seq": 5},
                               {**lost(6, 2), "error": "EIO (Input/output error)"},
                               {**close(), "seq": 8}])
    assert report.violations_by_kind == {"seq-gap": 1}
    v = report.violations[0]
    assert (v.seq, "expected 4, got 5" in v.message) == (5, True)
    assert report.lost_events == 5 and [g["seq"] for g in report.gaps] == [1, 6]


def _run(capsys, *logs, json_out: bool = False) -> tuple[int, str]:
    """``pdkv replay`` in process (the subprocess path is covered above): status, stdout."""
    code = main(_args(*logs, json=json_out))
    return code, capsys.readouterr().out


def test_cli_exit_3_for_incomplete_and_severity_across_logs(tmp_path, capsys):
    clean = write_log(tmp_path / "a.freelog", [alloc("r", 1), free("r", 1), close()])
    partial = write_log(tmp_path / "b.freelog", [alloc("r", 1), lost(1, 4),
                                                 {**close(), "seq": 5}])
    dirty = write_log(tmp_path / "c.freelog", [alloc("r", 1), close()])
    assert _run(capsys, clean, partial)[0] == 3
    assert _run(capsys, partial, dirty)[0] == 1
    assert _run(capsys, partial, tmp_path / "missing.freelog")[0] == 2
    code, out = _run(capsys, partial, json_out=True)
    doc = json.loads(out)
    log = doc["logs"][0]
    assert (code, doc["ok"], doc["exit_code"]) == (3, False, 3)
    assert (log["ok"], log["incomplete"], log["lost_events"]) == (False, True, 4)
    assert log["gaps"][0]["seq"] == 1
    text = _run(capsys, partial)[1].strip().splitlines()
    assert text[-1] == "  INCOMPLETE (not proven clean)" and "INCOMPLETE: 4 event(s)" in text[-2]


def test_cli_exit_3_in_a_real_process(tmp_path):
    partial = write_log(tmp_path / "b.freelog", [alloc("r", 1), lost(1, 4),
                                                 {**close(), "seq": 5}])
    assert _cli(str(partial)).returncode == 3


def test_cli_replays_every_incarnation_in_a_folder(tmp_path, capsys):
    for name in ("decode0.freelog", "decode0.1.freelog", "prefill0.freelog"):
        write_log(tmp_path / name, [alloc("r", 1), free("r", 1), close()])
    (tmp_path / "decode0.log").write_text("not a free log")
    code, out = _run(capsys, tmp_path, json_out=True)
    assert code == 0, out
    assert [Path(log["log"]).name for log in json.loads(out)["logs"]] == [
        "decode0.1.freelog", "decode0.freelog", "prefill0.freelog"]
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = _run(capsys, empty)
    assert code == 2 and "a folder without *.freelog files" in out


# -- after a gap: judged from what the log shows again (aftergap.py) -------------------------
def test_after_a_gap_a_double_free_is_still_caught(tmp_path):
    report = replay(tmp_path, [alloc("r1", 1, 2), lost(1, 10),
                               {**alloc("r2", 3), "seq": 11},       # unknown -> owned
                               {**free("r2", 3), "seq": 12},
                               {**free("r2", 3), "seq": 13},        # known free: double
                               {**close(), "seq": 14}])
    assert report.violations_by_kind == {"double-free": 1} and report.exit_code == 1
    v = report.violations[0]
    assert (v.seq, v.page, v.owner) == (13, 3, "r2") and "after the gap" in v.message


def test_after_a_gap_pages_learnt_again_are_not_judged_by_their_old_state(tmp_path):
    report = replay(tmp_path, [
        alloc("r1", 1, 2), pin(7, 1),
        lost(2, 6),                                   # r1 freed 1-2, pin 7 ended: lost
        {**alloc("r2", 1), "seq": 8},                 # was owned by r1: now r2's
        {**free("r9", 5), "seq": 9},                  # its alloc was lost: fine
        {**pin(8, 5), "seq": 10},                     # freed, pins unknown: not judged
        {**unpin(7, 1), "seq": 11},                   # a stale pin: not judged
        {**release(1, 5), "seq": 12},                 # frees what it lists after it
        {**unpin(8, 5), "seq": 13},
        {**free("r2", 1), "seq": 14},                 # r2 no longer holds page 1? it does
        {**close(), "seq": 15},
    ])
    assert report.num_violations == 0 and report.exit_code == 3, report.format()


def test_after_a_gap_a_leak_of_a_page_seen_again_is_judged(tmp_path):
    report = replay(tmp_path, [alloc("r1", 1), lost(1, 2), {**alloc("r2", 4, 5), "seq": 3},
                               {**close(), "seq": 4}])
    assert report.violations_by_kind == {"leak": 1}
    assert report.violations[0].owner == "r2" and report.violations[0].pages == [4, 5]
    assert report.unknown_pages_at_end == 13  # page 1 (r1's before the gap) is not a leak


def test_after_a_gap_a_missing_release_of_a_known_pin_is_caught(tmp_path):
    report = replay(tmp_path, [lost(0, 3), {**alloc("r", 2), "seq": 3},
                               {**pin(4, 2), "seq": 4}, {**free("r", 2), "seq": 5},
                               {**unpin(4, 2), "seq": 6}, {**alloc("s", 3), "seq": 7},
                               {**free("s", 3), "seq": 8}, {**close(), "seq": 9}])
    assert report.violations_by_kind == {"missing-release": 1}, report.format()


def _kv_workload(path: Path, seed: int, steps: int = 400) -> str:
    """A real KvCache driven at random: rows, pins across frees, handoffs to a cache."""
    import random

    from common import KvCache

    rng, cache = random.Random(seed), KvCache(48, 4, log_path=path, node="d", max_rows=16)
    rows: dict[str, object] = {}
    pins: list[int] = []
    cached: list[np.ndarray] = []
    for step in range(steps):
        action = rng.random()
        if action < 0.3 and len(rows) < 12 and cache.num_free_pages() > 4:
            kv = rows[f"r{step}"] = cache.open_row(f"r{step}")
            cache.extend(kv, rng.randint(1, 12))
        elif action < 0.45 and rows:
            kv = rng.choice(list(rows.values()))
            if kv.allocated_len > kv.protected_len:
                pins.append(cache.pin(kv, kv.protected_len, kv.allocated_len,
                                      reason="send"))
        elif action < 0.6 and pins:
            cache.unpin(pins.pop(rng.randrange(len(pins))))
        elif action < 0.7 and rows and cache.num_free_pages() > 2:
            kv = rng.choice(list(rows.values()))
            if kv.allocated_len % 4 == 0 or cache.num_free_pages() > 3:
                cache.extend(kv, rng.randint(1, 6))
        elif action < 0.78 and rows:
            kv = rng.choice(list(rows.values()))
            if kv.allocated_len >= 4 and kv.protected_len == 0:
                cached.append(cache.pages(kv, 0, 4))
                cache.handoff(kv, 4, "cache:p")
        elif action < 0.95 and rows:
            owner = rng.choice(list(rows))
            kv = rows.pop(owner)
            cache.free_kv_row(kv, [(kv.protected_len, kv.allocated_len)],
                              reason=rng.choice(["finished", "aborted", "sent"]))
            cache.close_row(kv)
        elif cached:
            cache.free_pages("cache:p", cached.pop(0), reason="evicted")
    for pin_id in pins:
        cache.unpin(pin_id)
    for kv in rows.values():
        cache.free_kv_row(kv, [(kv.protected_len, kv.allocated_len)], reason="finished")
        cache.close_row(kv)
    for pages in cached:
        cache.free_pages("cache:p", pages, reason="evicted")
    cache.close()
    return cache.free_log.path


def _cut(src: str, dst: Path, cuts: list[tuple[int, int]], extra: list[int] = ()) -> Path:
    """Copy a log with events [a, b) of each cut replaced by one lost marker; events whose
    index is in ``extra`` are written twice (a bug replay must still see)."""
    with open(src, "rb") as f:
        header, *events = list(msgpack.Unpacker(f, raw=False))
    packer = msgpack.Packer(use_bin_type=True)
    with open(dst, "wb") as out:
        out.write(packer.pack(header))
        i = 0
        while i < len(events):
            cut = next(((a, b) for a, b in cuts if a == i), None)
            if cut is not None:
                out.write(packer.pack({"seq": events[i]["seq"], "t_ns": events[i]["t_ns"],
                                       "op": "lost", "pool": "", "pages": b"",
                                       "count": cut[1] - cut[0], "error": "cut"}))
                i = cut[1]
                continue
            out.write(packer.pack(events[i]))
            if i in extra:  # the same event again, renumbered so seqs stay continuous
                break
            i += 1
    return dst


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_correct_log_with_any_stretch_cut_out_has_no_violation(tmp_path, seed):
    import random

    path = _kv_workload(tmp_path / "full.freelog", seed)
    assert replay_file(path).ok
    with open(path, "rb") as f:
        num_events = sum(1 for _ in msgpack.Unpacker(f, raw=False)) - 2  # header, close
    rng = random.Random(seed)
    for trial in range(40):
        a = rng.randrange(num_events)
        b = min(num_events, a + rng.randint(1, 60))
        cuts = [(a, b)]
        if trial % 3 == 0 and b + 5 < num_events:  # two gaps
            c = rng.randrange(b + 1, num_events)
            cuts.append((c, min(num_events, c + rng.randint(1, 20))))
        report = replay_file(_cut(path, tmp_path / f"cut{trial}.freelog", cuts))
        assert report.num_violations == 0, (cuts, report.format())
        assert report.exit_code == 3 and report.lost_events == sum(b - a for a, b in cuts)


def test_a_real_double_free_after_a_cut_is_caught(tmp_path):
    path = _kv_workload(tmp_path / "full.freelog", 5)
    with open(path, "rb") as f:
        header, *events = list(msgpack.Unpacker(f, raw=False))
    # a free late in the log, after a gap early on: write it twice
    k = max(i for i, ev in enumerate(events) if ev["op"] == "free" and ev["pool"] == "full"
            and i > 20)
    bad = events[:k + 1] + [{**events[k], "seq": events[k]["seq"] + 1}] + [
        {**ev, "seq": ev["seq"] + 1} for ev in events[k + 1:]]
    packer = msgpack.Packer(use_bin_type=True)
    dst = tmp_path / "bad.freelog"
    with open(dst, "wb") as out:
        out.write(packer.pack(header))
        out.write(packer.pack({"seq": 0, "t_ns": 0, "op": "lost", "pool": "", "pages": b"",
                               "count": 10, "error": "cut"}))
        for ev in bad[10:]:
            out.write(packer.pack(ev))
    report = replay_file(dst)
    assert report.violations_by_kind.get("double-free", 0) >= 1, report.format()
    assert report.exit_code == 1


# -- migrated requests (docs/freelog.md, "migrated") -----------------------------------------
def test_an_attempt_freed_migrated_that_takes_pages_again_is_a_violation(tmp_path):
    report = replay(tmp_path, [alloc("a#r-1", 3, 4), free("a#r-1", 3, 4, reason="migrated"),
                               alloc("a#r-1", 5), free("a#r-1", 5), close()])
    v = only_violation(report)
    assert (v.kind, v.seq, v.owner) == ("alloc-after-migrated", 2, "a#r-1")
    assert report.migrated == ["a#r-1"]


def test_pdkv_replay_follows_each_moved_attempt_to_the_log_that_took_it(tmp_path, capsys):
    left = write_log(tmp_path / "decode0.freelog", [
        alloc("a#r-1", 3, 4), pin(1, 3), free("a#r-1", 3, 4, reason="migrated"),
        unpin(1, 3), release(3), alloc("b#r-2", 7), free("b#r-2", 7, reason="migrated"),
        close()])
    took = write_log(tmp_path / "decode1.freelog", [
        alloc("a#r-1~1", 2, 3), free("a#r-1~1", 2, 3), close()])
    assert main(_args(left, took)) == 0                  # clean: routing is not judged
    out = capsys.readouterr().out
    assert "migrated: 2 request attempt(s) moved on" in out
    assert "a#r-1 (decode0.freelog) -> a#r-1~1 (decode1.freelog)" in out
    assert "b#r-2 (decode0.freelog) -> b#r-2~1 (no log given)" in out
    assert main(_args(left, took, json=True)) == 0
    moves = json.loads(capsys.readouterr().out)["migrations"]
    assert [m["next_log"] for m in moves] == ["decode1.freelog", ""]
