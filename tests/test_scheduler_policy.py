"""The scheduler users expect, on a real colocated worker over a fake router link:

- a step's one forward pass carries decode tokens and prompt chunks together (mixed), and
  the outputs still equal the single-process reference;
- admission allocates on demand: the same pool admits more requests than whole-life
  reservation does, retracts under pressure and resumes, with both free logs clean;
- a step's tokens leave in one message, however many requests it ran;
- the batch limit follows the pool, the pool the memory budget, torch threads the cores.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch

from common.config import ServeConfig
from common.control import CODEC, DecodeError, Done, Req, StepTokens, pack_ids
from common.freelog import FreeLogReader, replay_file
from common.model import ModelRunner, generate_greedy
from common.sizing import cuda_kv_budget, device_pool_pages, split_cores, torch_threads
from deploy.launch.colocated import ColocatedWorker
from tests.fakes import FakeLink
from tests.model_helpers import prompt

ROOT = Path(__file__).resolve().parents[1]
CFG = ServeConfig(dtype="float64", page_size=4, decode_pages=64, chunk_size=8,
                  max_prefill_tokens=16, spec_k=0, offload=False, heartbeat_s=0.2,
                  lease_s=3.0)


class ItemWatchingRunner(ModelRunner):
    """``runner``'s model and pool; notes each pass's items as (row, start, tokens) as it
    is planned (every pass is: ``forward`` and the steps' one-upload plans alike)."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner.model, runner.cache, runner.draft)
        self.passes: list[list[tuple[int, int, int]]] = []

    def plan(self, host, batch, *, draft: bool = False, sourced=None):
        self.passes.append([(it.kv.row, it.start, it.num_tokens) for it in batch])
        return super().plan(host, batch, draft=draft, sourced=sourced)


def _worker(tmp_path, cfg: ServeConfig) -> tuple[ColocatedWorker, FakeLink]:
    link = FakeLink()
    worker = ColocatedWorker("c0", link, log_dir=str(tmp_path))
    worker.start(cfg)
    return worker, link


def _req(rid: str, tokens: list[int], max_new: int) -> Req:
    return Req(rid, pack_ids(tokens), {"max_new_tokens": max_new}, prefill="",
               prefill_addr="", decode="c0")


def _run(worker: ColocatedWorker, link: FakeLink, rids: set[str], limit: int = 2000) -> None:
    for _ in range(limit):
        if rids <= {m.rid for m in link.sent if isinstance(m, Done)}:
            return
        worker.tick()
    raise AssertionError(f"not done after {limit} ticks: {link.sent[-3:]}")


def _outputs(link: FakeLink) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for t in link.tokens():
        out.setdefault(t.rid, []).extend(t.ids)
    return out


def _replay_clean(*logs: Path) -> None:
    for log in logs:
        report = replay_file(log)
        assert report.ok, report.format()


def _free_reasons(log: Path) -> set[str]:
    return {e["reason"] for e in FreeLogReader(log).records if e.get("op") == "free"}


def test_one_forward_carries_decode_tokens_and_prompt_chunks_and_outputs_match(tmp_path,
                                                                              model):
    worker, link = _worker(tmp_path, CFG)
    a, b = prompt(12, seed=1), prompt(20, seed=2)
    try:
        assert worker.mixes
        runner = worker.runner = worker.engine.runner = ItemWatchingRunner(worker.runner)
        worker.scheduler.runner = worker.scheduler.batch.runner = runner
        worker.dispatch(_req("a", a, 12))
        while not worker.scheduler.batch.running:          # a's prompt: 2 passes alone
            worker.tick()
        worker.dispatch(_req("b", b, 6))                   # b arrives while a decodes
        _run(worker, link, {"a", "b"})
        row_a, row_b = 0, 1                                # rows in admission order
        mixed = [p for p in runner.passes
                 if (row_a, p[0][1], 1) in p and any(r == row_b and n > 1 for r, _, n in p)]
        # b's 20 prompt tokens: 15 + 5 beside a's decode token (budget 16 - 1)
        assert [[(r, s, n) for r, s, n in p if r == row_b] for p in mixed] == \
            [[(row_b, 0, 8)], [(row_b, 8, 8)], [(row_b, 16, 4)]]
        assert worker.num_mixed_steps == 3
        want = generate_greedy(model, [a, b], 12)
        got = _outputs(link)
        assert got == {"a": want[0], "b": want[1][:6]}
    finally:
        worker.close()
    _replay_clean(tmp_path / "c0.freelog")
    assert _free_reasons(tmp_path / "c0.freelog") == {"finished"}


def test_a_steps_tokens_leave_in_one_message_with_the_first_tokens_it_sampled(tmp_path):
    worker, link = _worker(tmp_path, CFG)
    try:
        for i in range(3):
            worker.dispatch(_req(f"r{i}", prompt(5, seed=i), 8))
        worker.tick()           # a prefill pass over 3 prompts of 5, then a decode step
        first, step = link.take(StepTokens)
        assert first.rids == ["r0", "r1", "r2"] and first.first == 3
        assert step.rids == ["r0", "r1", "r2"] and step.first == 0
        for _ in range(3):
            link.sent.clear()
            worker.tick()                                  # a decode step of 3
            (step,) = [m for m in link.sent if isinstance(m, StepTokens)]
            assert step.rids == ["r0", "r1", "r2"] and step.first == 0
            assert [len(t.ids) for t in step.items()] == [1, 1, 1]
    finally:
        worker.close()


def test_step_tokens_that_do_not_add_up_are_refused_by_the_codec():
    good = StepTokens.of([("a", [1, 2], False), ("b", [3], True)])
    assert good.rids == ["b", "a"] and good.first == 1          # first tokens lead
    assert [(t.rid, t.ids, t.first) for t in CODEC.decode(CODEC.encode(good)).items()] == \
        [("b", [3], True), ("a", [1, 2], False)]
    fields = {"t": "StepTokens", "rids": good.rids, "counts": good.counts, "ids": good.ids}
    for bad in ({"counts": pack_ids([2, 2])},   # 4 counted, 3 held
                {"counts": pack_ids([3, 0])},   # an empty share
                {"first": 3}):                  # more first than rids
        with pytest.raises(DecodeError, match="bad_field"):
            CODEC.decode(msgpack.packb({**fields, **bad}))


# -- admission on demand, preemption ------------------------------------------------------
POOL = dict(page_size=4, decode_pages=21, host_pages=200, max_prefill_tokens=32,
            chunk_size=16)


def test_on_demand_admits_more_than_reservation_and_preempts_and_resumes_cleanly(
        tmp_path, model):
    # 20 usable pages of 4; six 12-token prompts asking for 20 tokens each: a whole life
    # is 31 positions = 8 pages, so reservation admits 2 at once; on demand each is
    # admitted while its prompt and first slot fit (4 pages free) and takes its prompt's
    # 3: all 6 (18 pages), and their growth retracts the youngest later
    prompts = {f"r{i}": prompt(12, seed=10 + i) for i in range(6)}
    admitted = {}
    for mode, over in (("reserve", False), ("on_demand", True)):
        cfg = dataclasses.replace(CFG, offload=True, overcommit=over, **POOL)
        worker, link = _worker(tmp_path / mode, cfg)
        try:
            assert worker.scheduler.admission.whole_life is not over
            for rid, p in prompts.items():
                worker.dispatch(_req(rid, p, 20))
            worker.tick()
            admitted[mode] = len(worker.scheduler.admission.admitted)
            if over:
                _run(worker, link, set(prompts))
                retracted = worker.scheduler.stats({})["retracted"]
        finally:
            worker.close()
    assert admitted == {"reserve": 2, "on_demand": 6}
    assert retracted > 0                                    # the pool ran short: preempted
    want = generate_greedy(model, list(prompts.values()), 20)
    assert _outputs(link) == dict(zip(prompts, want))
    device, host = tmp_path / "on_demand" / "c0.freelog", tmp_path / "on_demand" / "c0.host.freelog"
    _replay_clean(device, host)
    assert _free_reasons(device) == {"finished", "offloaded"}


def test_without_a_host_tier_admission_reserves_whole_lives():
    cfg = dataclasses.replace(CFG, offload=False, overcommit=True)
    assert not cfg.preempts
    assert ServeConfig().preempts                           # the default preempts


# -- sizes: batch limit, pool, threads ----------------------------------------------------
def test_the_batch_limit_follows_the_pool(tmp_path):
    assert ServeConfig(decode_pages=11).batch_limit(11) == 10     # a page each at least
    assert ServeConfig(max_rows=32).batch_limit(4097) == 32
    assert ServeConfig(max_running=7).batch_limit(4097) == 7      # given: kept
    worker, _ = _worker(tmp_path, dataclasses.replace(CFG, decode_pages=24))
    try:
        assert worker.scheduler.admission.max_running == 23
    finally:
        worker.close()


def test_pools_follow_the_memory_budget_and_page_counts_override_it(tmp_path, monkeypatch):
    cfg = dataclasses.replace(CFG, decode_pages=0, kv_memory_mib=3, host_memory_mib=2,
                              offload=True)
    page = cfg.kv_layout().page_bytes(cfg.page_size)
    assert cfg.page_bytes() == page
    assert cfg.pool_pages("decode") == (3 << 20) // page + 1
    assert cfg.host_pool_pages() == (2 << 20) // page + 1
    assert cfg.pool_tokens("decode") == (3 << 20) // page * cfg.page_size
    worker, _ = _worker(tmp_path, cfg)
    try:
        assert worker.cache.num_pages == (3 << 20) // page + 1
        assert worker.scheduler.offloader.host.num_pages == (2 << 20) // page + 1
    finally:
        worker.close()
    assert dataclasses.replace(cfg, decode_pages=40).pool_pages("decode") == 40
    assert dataclasses.replace(cfg, host_pages=9).host_pool_pages() == 9
    # CUDA: the worker's share of the device (at most what is free), less the weights and
    # activations
    gib = 1 << 30
    from common.sizing import activation_bytes, weight_bytes
    m = cfg.model_config()
    rest = weight_bytes(m) + activation_bytes(m, cfg.max_prefill_tokens)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 40 * gib))
    assert cuda_kv_budget(cfg, "decode", "cuda:0") == int(40 * gib * 0.9) - rest
    half = dataclasses.replace(cfg, gpu_memory_utilization=0.45)   # a second worker's share
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (22 * gib, 40 * gib))
    assert cuda_kv_budget(half, "decode", "cuda:0") == int(40 * gib * 0.45) - rest
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 40 * gib))
    budget = cuda_kv_budget(cfg, "decode", "cuda:0")
    assert budget == 30 * gib - rest                                # no more than is free
    assert device_pool_pages(cfg, "decode", "cuda:0") == budget // page + 1
    assert device_pool_pages(dataclasses.replace(cfg, decode_pages=40), "decode",
                             "cuda:0") == 40
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 40 * gib))
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        cuda_kv_budget(cfg, "decode", "cuda:0")


def test_a_budget_of_zero_or_a_one_page_pool_is_refused():
    from common.config import ConfigError
    for bad in ({"kv_memory_mib": 0}, {"decode_pages": 1}, {"gpu_memory_utilization": 1.5},
                {"max_running": -1}):
        with pytest.raises(ConfigError):
            ServeConfig.from_dict(bad)


def test_threads_follow_the_cores_a_worker_is_given():
    assert torch_threads(3) == 3
    assert torch_threads(0) == len(os.sched_getaffinity(0))
    assert split_cores(2, [0, 1]) == [[0], [1]]
    assert split_cores(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert split_cores(3, [0, 1]) == [[0], [1], [0]]
    # a worker process pinned to one core runs one torch thread
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from common.node import setup_process; setup_process(0); "
            "import torch; print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=True)
    assert out.stdout.strip() == "1"


def test_the_launcher_shares_the_cores_out_between_cpu_workers():
    from deploy.launch.launcher import Cluster
    cores = sorted(os.sched_getaffinity(0))
    cluster = Cluster(CFG, "disagg", 1, 1, secure=False)
    try:
        workers = [p for p in cluster.procs if p.role != "router"]
        assert [p.cores for p in workers] == split_cores(2, cores)
        # the router beside the prefill, off the decode's cores
        assert [p.cores for p in cluster.procs if p.role == "router"] == [workers[0].cores]
        assert cluster.router_cores == workers[0].cores
    finally:
        _discard(cluster)
    if len(cores) == 2:   # one colocated worker: the router gets a core of its own
        alone = Cluster(CFG, "colocated", 0, 1, secure=False)
        try:
            assert alone.router_cores == cores[:1]
            assert [p.cores for p in alone.procs if p.role != "router"] == [cores[1:]]
        finally:
            _discard(alone)
    given = Cluster(CFG, "disagg", 1, 1, secure=False, threads=2)   # threads set: no pins
    try:
        assert all(p.cores is None for p in given.procs)
    finally:
        _discard(given)


def _discard(cluster) -> None:
    """A cluster never started: its temporary directories go."""
    import shutil
    cluster.cleanup()
    shutil.rmtree(cluster.sock_dir, ignore_errors=True)
