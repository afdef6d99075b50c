"""The one request record: derived counters, checked state moves, one writer per side."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.request import ReqState, Request, SamplingParams, check_transition

ROOT = Path(__file__).resolve().parents[1]


def test_counters_and_derived_properties_follow_the_row():
    req = Request("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=3, stop_token=9))
    assert req.prompt_len == 4 and req.max_len == 6 and req.prompt_remaining == 4
    req.num_computed = 4
    req.output = [1]
    assert req.next_position == 4 and req.committed_tokens == [5, 6, 7, 8]
    assert not req.is_done and req.prompt_remaining == 0
    req.output += [9]
    assert req.is_done and req.finish_reason == "stop"
    assert req.committed_tokens == [5, 6, 7, 8, 1]
    long = Request("l", [1], SamplingParams(max_new_tokens=2), output=[3, 4])
    assert long.is_done and long.finish_reason == "length"
    assert "prompt_len=4" in repr(req) and "[5, 6" not in repr(req)   # short in logs


@pytest.mark.parametrize("path", [
    [ReqState.QUEUED, ReqState.WAITING_KV, ReqState.DECODING, ReqState.RETRACTED,
     ReqState.DECODING, ReqState.FINISHED],                                     # decode
    [ReqState.QUEUED, ReqState.PREFILLING, ReqState.TRANSFERRING, ReqState.FINISHED],
    [ReqState.QUEUED, ReqState.PREFILLING, ReqState.DECODING, ReqState.FINISHED],
    [ReqState.QUEUED, ReqState.ABORTED], [ReqState.RETRACTED, ReqState.FAILED],
])
def test_the_lifecycle_moves_are_transitions(path):
    for old, new in zip(path, path[1:]):
        check_transition(old, new)


@pytest.mark.parametrize("old, new", [
    (ReqState.FINISHED, ReqState.ABORTED), (ReqState.QUEUED, ReqState.DECODING),
    (ReqState.WAITING_KV, ReqState.QUEUED), (ReqState.TRANSFERRING, ReqState.DECODING),
])
def test_anything_else_is_refused(old, new):
    with pytest.raises(AssertionError, match=f"{old.name} -> {new.name}"):
        check_transition(old, new)


def _state_writes(path: Path) -> list[int]:
    """Lines of ``path`` that assign ``<something>.state`` of a request."""
    tree = ast.parse(path.read_text())
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Attribute) and t.attr == "state"
            and not (isinstance(t.value, ast.Name) and t.value.id == "self")]


def test_request_state_has_one_writer_per_side():
    writes = {str(p.relative_to(ROOT)): lines
              for pkg in ("prefill_node", "decode_node", "deploy", "common")
              for p in sorted((ROOT / pkg).rglob("*.py")) if (lines := _state_writes(p))}
    assert sorted(writes) == ["decode_node/scheduler.py", "prefill_node/worker.py"], writes
    assert all(len(lines) == 1 for lines in writes.values()), writes


def test_lifecycle_predicates():
    assert not ReqState.DECODING.is_finished and ReqState.ABORTED.is_finished
    assert ReqState.WAITING_KV.holds_kv and not ReqState.QUEUED.holds_kv
    retracted = ReqState.RETRACTED    # committed KV in the host tier, no device row
    assert retracted.is_retracted and not retracted.holds_kv and not retracted.is_finished
    assert ReqState.DECODING < retracted < ReqState.FINISHED


