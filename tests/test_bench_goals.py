"""Benchmark goals: every bench prints its baseline and ratio and exits 1 on a missed goal
unless told to only report. The shared flags have the same names on every bench."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.allocator import TorchPagedAllocator
from benchmarks.goals import EXIT_MISSED, Goals, add_bench_flags, paired_ratio
from benchmarks.http_client import summarize_records
from benchmarks.serve import records_of
from deploy.cli.main import build_parser
from deploy.loadgen.driver import Result

REPO = Path(__file__).resolve().parents[1]


def test_goals_judge_ratios_both_ways_and_say_so():
    goals = Goals("demo")
    fast = goals.at_least("speedup", 1.2, 1.0, measured="pdkv 1 ms", baseline="torch 1.2 ms")
    slow = goals.at_most("overhead", 1.4, 1.3, measured="recorded 1.4 s",
                         baseline="plain 1.0 s")
    assert fast.met and not slow.met and goals.missed == [slow]
    text = goals.format()
    assert "speedup: 1.2x (pdkv 1 ms, torch 1.2 ms); goal >= 1x: met" in text
    assert "overhead: 1.4x (recorded 1.4 s, plain 1.0 s); goal <= 1.3x: MISSED" in text
    assert "1 of 2 goal(s) MISSED: overhead" in text
    assert goals.exit_status(argparse.Namespace(report_only=False)) == EXIT_MISSED
    assert goals.exit_status(argparse.Namespace(report_only=True)) == 0
    doc = goals.to_dict()
    assert doc["goals_met"] is False and [g["met"] for g in doc["goals"]] == [True, False]


def test_all_goals_met_exits_0():
    goals = Goals("demo")
    goals.at_least("a", 2.0, 1.0)
    assert goals.all_met and goals.exit_status() == 0
    assert goals.format().endswith("pdkv bench demo: all 1 goal(s) met")


def test_bench_flags_are_the_same_on_every_bench():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    benches = bench._subparsers._group_actions[0].choices
    assert {"allocator", "replay", "transfer", "serve", "spec"} <= set(benches)
    for name, parser in benches.items():
        flags = {s for a in parser._actions for s in a.option_strings}
        assert {"--quick", "--repeats", "--json", "--report-only"} <= flags, name


def test_add_bench_flags_parses_the_shared_flags():
    p = argparse.ArgumentParser()
    add_bench_flags(p, quick="q", repeats="3")
    args = p.parse_args(["--quick", "--repeats", "5", "--json", "--report-only"])
    assert (args.quick, args.repeats, args.json, args.report_only) == (True, 5, True, True)


def test_an_offload_round_is_the_median_of_its_paired_tries():
    """One lucky try of the plain copy (6 ms among 10s) does not decide a round, and the
    pairs stay pairs: the offload 20% slower in every try is 0.8x, whatever the drift."""
    plain, offload = [6.0, 10.0, 10.0, 20.0, 10.0], [12.5, 12.5, 12.5, 25.0, 12.5]
    assert paired_ratio(plain, offload) == pytest.approx(0.8)
    assert min(plain) / min(offload) == pytest.approx(0.48)   # the old fastest-try figure


def test_torch_baseline_frees_exactly_the_rows_pages():
    alloc = TorchPagedAllocator(num_pages=11, page_size=4, max_rows=1, max_row_len=40)
    alloc.allocate_row(0, 22)  # pages 1..6, the last one half full
    assert alloc.free_pages.tolist() == [7, 8, 9, 10]
    alloc.free_row(0, [(0, 20), (20, 22)])  # touching: one slice, page 5 once
    assert alloc.free_pages.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def _bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", "bench", *argv],
                          capture_output=True, text=True, cwd=REPO, timeout=600)


def test_bench_replay_prints_baseline_ratio_and_exits_by_its_goals():
    out = _bench("replay", "--quick", "--events", "20000", "--repeats", "1", "--json")
    doc = json.loads(out.stdout)
    (goal,) = doc["goals"]
    assert goal["name"] == "replay vs bare msgpack decode" and goal["target"] == 0.25
    assert goal["ratio"] == doc["ratio"] and "bare decode" in goal["baseline"]
    assert out.returncode == (0 if doc["goals_met"] else EXIT_MISSED), out.stderr
    text = _bench("replay", "--events", "20000", "--repeats", "1", "--report-only")
    assert text.returncode == 0, text.stderr
    assert "goal replay vs bare msgpack decode:" in text.stdout
    assert "bare msgpack decode:" in text.stdout


def test_bench_allocator_quick_reports_the_torch_baseline():
    out = _bench("allocator", "--quick", "--repeats", "1", "--json", "--report-only")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rows = {r["page_size"]: r for r in doc["free_kv_row"]}
    assert set(rows) == {1, 16, 64} and all(r["torch_ms"] > 0 for r in rows.values())
    names = [g["name"] for g in doc["goals"]]
    assert names == ["free_kv_row page 1 vs torch", "free_kv_row page 16 vs torch",
                     "free_kv_row page 16 vs naive loop", "recording overhead"]
    assert doc["goals"][0]["ratio"] == pytest.approx(rows[1]["vs_torch"])


def test_served_figures_count_every_token_message():
    # 5 tokens in 3 messages (the second one a speculative step's 3 tokens): the ITLs are
    # the gaps between messages, TPOT the span over the tokens after the first
    res = Result("r0", 8, 5, output_ids=[1, 2, 3, 4, 5], reason="length", t_submit=1.0,
                 t_tokens=[1.1, 1.12, 1.16], t_done=1.17)
    fig = summarize_records(records_of({"r0": res}), ttft_target_s=1.0, tpot_target_s=0.1)
    assert fig["ttft_p50_ms"] == pytest.approx(100.0)
    assert fig["tpot_p50_ms"] == pytest.approx(60.0 / 4)
    assert fig["itl_p50_ms"] == pytest.approx(30.0)   # gaps of 20 and 40 ms
    assert fig["itl_p99_ms"] == pytest.approx(39.8)
