"""Serving checkpoints: speculation kinds in process, and colocated and 1P1D deployments of
a Hugging Face checkpoint whose outputs equal transformers' greedy generate; every free log
replays clean."""

from __future__ import annotations

import pytest

from common.config import ServeConfig, resolve_model
from common.freelog import replay_file
from common.kv import KvCache
from common.model import BatchItem, Model, ModelRunner
from common.request import Request, SamplingParams
from decode_node.batch import DecodeBatch, finish_ranges
from decode_node.ngram import NgramProposer
from decode_node.speculative import make_step
from deploy.launch.launcher import Cluster
from deploy.launch.run import serve_workload
from deploy.loadgen.workload import WorkloadSpec, make_workload
from tests.checkpoint_helpers import hf_checkpoint, hf_generate

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)

SPEC = WorkloadSpec(requests=5, seed=11, rate=50.0, prompt_len=(3, 60), output_len=(2, 14))


def _cfg(**changes) -> ServeConfig:
    return ServeConfig(model_path=str(hf_checkpoint("llama")), page_size=4, prefill_pages=96,
                       decode_pages=160, chunk_size=16, max_prefill_tokens=32, heartbeat_s=0.2,
                       lease_s=3.0, debug_integrity=True, **changes)


def _decode_in_process(cfg: ServeConfig, prompts: list[list[int]], max_new: int, tmp_path
                       ) -> tuple[list[list[int]], object]:
    """Prefill (target and draft) and decode with ``make_step(cfg)`` in one process."""
    log = tmp_path / f"{cfg.spec_kind or 'plain'}.freelog"
    cache = KvCache(200, cfg.page_size, layout=cfg.kv_layout(), log_path=log, node="d")
    dcfg = cfg.draft_model_config()
    runner = ModelRunner(Model(cfg.model_config()), cache, Model(dcfg) if dcfg else None)
    step = make_step(cfg)
    batch, outs = DecodeBatch(runner, step), {}
    for i, p in enumerate(prompts):
        kv = cache.open_row(f"r{i}")
        cache.extend(kv, len(p))
        first = int(runner.forward([BatchItem(kv, p, 0)])[0].argmax())
        if cfg.with_draft:
            runner.forward([BatchItem(kv, p, 0)], draft=True)
        cache.commit(kv, len(p))
        batch.add(Request(f"r{i}", p, SamplingParams(max_new_tokens=max_new), kv=kv,
                          output=[first], num_computed=len(p)))
    while len(batch):
        for s in batch.step()[1]:
            cache.free_kv_row(s.kv, finish_ranges(s.kv, cfg.page_size), reason="finished")
            cache.close_row(s.kv)
            outs[s.rid] = s.output
    cache.check_integrity()
    cache.close()
    assert replay_file(log).ok
    return [outs[f"r{i}"] for i in range(len(prompts))], getattr(step, "stats", None)


def _prompts() -> list[list[int]]:
    reqs = make_workload(SPEC, 384)
    return [r.prompt for r in reqs]


@pytest.mark.parametrize("changes", [
    {}, {"spec_ngram": 3}, {"draft_model_path": "llama-draft"},
    {"draft_model_path": "llama"}])
def test_speculation_kinds_equal_transformers_in_process(tmp_path, changes) -> None:
    if "draft_model_path" in changes:
        changes = {"draft_model_path": str(hf_checkpoint(changes["draft_model_path"]))}
    cfg = _cfg(**changes)
    prompts = _prompts()
    outs, stats = _decode_in_process(cfg, prompts, 16, tmp_path)
    assert outs == [hf_generate("llama", p, 16) for p in prompts]
    if not changes:
        assert cfg.spec_kind == "" and stats is None  # a checkpoint does not speculate
        return
    assert stats.num_proposed > 0
    if changes.get("draft_model_path", "").endswith("llama-float64"):
        # the target as its own draft: every proposal is right, which needs its draft KV
        assert stats.num_accepted == stats.num_proposed


def test_ngram_proposer_finds_the_latest_longest_match() -> None:
    ng = NgramProposer(3)
    assert ng.propose([5, 6, 7, 8, 9, 1, 6, 7], 2) == [8, 9]
    assert ng.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]  # latest match
    assert ng.propose([4, 5, 6, 4, 5, 6], 5) == [4, 5, 6]  # copies up to the tail
    assert ng.propose([1, 2, 3], 4) == [] and ng.propose([7], 2) == []
    assert ng.propose([1, 2, 1], 0) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(2, 3)


def test_model_flag_and_config_refusals(tmp_path) -> None:
    d = hf_checkpoint("llama")
    assert resolve_model(str(d)) == {"model_path": str(d.resolve())}
    assert resolve_model("small") == {"model": "small", "model_path": ""}
    with pytest.raises(ValueError, match="neither a directory nor a built-in model"):
        resolve_model("meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match="model_path=.*is not a directory"):
        ServeConfig(model_path=str(tmp_path / "missing"))
    wide = str(hf_checkpoint("qwen2"))  # 1 KV head of 16: narrower than llama's 2 x 16
    with pytest.raises(ValueError, match="exceeds the target's"):
        ServeConfig(model_path=wide, draft_model_path=str(d))
    with pytest.raises(ValueError, match="choose one kind"):
        _cfg(spec_ngram=2, draft_model_path=str(d))
    assert ServeConfig().spec_kind == "layers" and _cfg().spec_kind == ""
    assert _cfg(spec_ngram=2).spec_kind == "ngram" and not _cfg(spec_ngram=2).with_draft
    layout = _cfg(draft_model_path=str(hf_checkpoint("llama-draft"))).kv_layout()
    assert (layout.num_layers, layout.num_draft_layers, layout.dtype) == (3, 1, "float64")


@pytest.fixture(scope="module")
def hf_reference() -> dict[str, list[int]]:
    return {r.rid: hf_generate("llama", r.prompt, r.max_new_tokens)
            for r in make_workload(SPEC, 384)}


@pytest.mark.parametrize("mode, changes", [
    ("colocated", {"spec_ngram": 2}),
    ("disagg", {}),
    ("disagg", {"draft_model_path": "llama-draft"})])
def test_served_checkpoint_equals_transformers(tmp_path, hf_reference, mode, changes) -> None:
    if "draft_model_path" in changes:
        changes = {"draft_model_path": str(hf_checkpoint(changes["draft_model_path"]))}
    cfg = _cfg(**changes)
    n = 0 if mode == "colocated" else 1
    cluster = Cluster(cfg, mode, n, 1, log_dir=str(tmp_path)).start()
    results, stats, _ = serve_workload(cluster, SPEC)
    assert {rid: r.output_ids for rid, r in results.items()} == hf_reference
    proposed = sum(s.get("spec_proposed", 0) for s in stats.values())
    assert (proposed > 0) == bool(changes), stats
    for log in cluster.freelogs():
        report = replay_file(log)
        assert report.ok, report.format()


def test_workers_with_different_weights_refuse_each_other() -> None:
    from transport import TransportConfig
    from transport.handshake import HandshakeError, check, make_hello

    plain = _cfg()
    drafted = _cfg(draft_model_path=str(hf_checkpoint("llama-draft")))
    digests = []
    for cfg in (plain, drafted):
        cache = KvCache(8, 4, layout=cfg.kv_layout())
        dcfg = cfg.draft_model_config()
        runner = ModelRunner(Model(cfg.model_config()), cache, Model(dcfg) if dcfg else None)
        digests.append(runner.fingerprint)
    assert digests[0] != digests[1] and len(set(digests[0])) > 1
    layout = plain.kv_layout()
    mine = make_hello(TransportConfig(node="d", model_digest=digests[0]), layout, 4, "decode")
    same = make_hello(TransportConfig(node="p", model_digest=digests[0]), layout, 4, "prefill")
    other = make_hello(TransportConfig(node="p", model_digest=digests[1]), layout, 4,
                       "prefill")
    check(mine, same)
    with pytest.raises(HandshakeError, match="mismatch on model_digest"):
        check(mine, other)


def _hf_until_eos(prompt: list[int], max_new: int, eos: tuple[int, ...]) -> list[int]:
    import torch

    from tests.checkpoint_helpers import _fresh

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _fresh("llama", "float64").generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
            eos_token_id=list(eos), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_text_requests_through_a_deployment(tmp_path) -> None:
    """Chat messages and plain text in, text out: the router encodes with the checkpoint's
    tokenizer and chat template, decode stops on any eos id of generation_config.json,
    the stream joins to the final text, and a stop string ends the output before it."""
    import transformers

    from common.model import Tokenizer
    from deploy.loadgen.driver import drive
    from deploy.loadgen.workload import WorkRequest

    path = hf_checkpoint("llama")
    tok, hf_tok = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    msgs = [[{"role": "user", "content": f"Tell me about cache pages, part {i}."}]
            for i in range(6)]
    want_ids = []
    for m in msgs:
        ids = hf_tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False)
        want_ids.append(_hf_until_eos(list(ids), 24, tok.eos_token_ids))
    texts = [tok.decode(w) for w in want_ids]
    # a stop string from the middle of the first output that is long enough
    i, text = next((i, t) for i, t in enumerate(texts) if len(t) >= 8)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    reqs = [WorkRequest(f"m{j}", [], 24, 0.0, messages=m, stop=[stop] if j == i else [])
            for j, m in enumerate(msgs)]
    reqs.append(WorkRequest("plain", [], 5, 0.0, text="The quick brown fox"))
    cluster = Cluster(_cfg(), "colocated", 0, 1, log_dir=str(tmp_path)).start()
    try:
        results = drive(cluster.client, reqs, timeout_s=120)
    finally:
        cluster.stop()
    for j, want in enumerate(want_ids):
        r = results[f"m{j}"]
        assert r.text == r.final_text, (r.text, r.final_text)
        if j == i:
            assert r.reason == "stop" and r.final_text == text[:text.index(stop)]
            assert r.output_ids == want[:len(r.output_ids)]
            continue
        assert r.output_ids == want, j
        assert r.final_text == texts[j]
        assert r.reason == ("stop" if want[-1] in tok.eos_token_ids else "length")
    plain = results["plain"]
    assert plain.prompt_tokens == len(hf_tok.encode("The quick brown fox"))
    assert len(plain.output_ids) <= 5 and plain.final_text == tok.decode(plain.output_ids)
    for log in cluster.freelogs():
        assert replay_file(log).ok


def test_stop_token_ids_round_trip_and_validate() -> None:
    from common.request import BadRequest, validate

    p = SamplingParams.from_dict({"max_new_tokens": 4, "stop_token_ids": [2, 4]})
    assert p.stop_token_ids == (2, 4) and p.is_stop(4) and not p.is_stop(3)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert "stop_token_ids" not in SamplingParams().to_dict()  # the old wire form
    assert p.stop_ids == {2, 4} and SamplingParams(stop_token=7).stop_ids == {7}
    with pytest.raises(BadRequest, match="stop_token_ids must be integers"):
        validate([1], SamplingParams(4, stop_token_ids=(999,)), vocab_size=384, max_tokens=99,
                 max_new_tokens_limit=9)
    with pytest.raises(BadRequest, match="must be a list"):
        SamplingParams.from_dict({"stop_token_ids": 3})


def test_hosts_with_their_own_copies_and_different_weights(tmp_path) -> None:
    """pdkv prefill/decode --model DIR: a copy of the checkpoint elsewhere serves; a decode
    whose weights differ is refused by the KV handshake, naming model_digest."""
    import json
    import shutil
    import socket
    import subprocess
    import sys
    import time

    import torch

    from deploy.router.client import Client
    from tests.checkpoint_helpers import hf_model

    src = hf_checkpoint("llama")
    copy = shutil.copytree(src, tmp_path / "copy")
    other = tmp_path / "other"
    shutil.copytree(src, other)
    model = hf_model("llama")
    with torch.no_grad():  # same shapes, one weight changed
        model.model.norm.weight.add_(1.0)
        model.save_pretrained(other)
        model.model.norm.weight.sub_(1.0)

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    router, kv = f"tcp://127.0.0.1:{port()}", port()
    base = [sys.executable, "-m", "deploy.cli"]
    cfg = _cfg(offload=False)
    cmds = {"router": [*base, "router", "--bind", router, "--config-json",
                       json.dumps(cfg.to_dict())],
            "p": [*base, "prefill", "--router", router, "--name", "p", "--model", str(copy),
                  "--kv-bind", f"tcp://127.0.0.1:{kv}", "--log-dir", str(tmp_path)],
            "d": [*base, "decode", "--router", router, "--name", "d", "--model", str(other),
                  "--log-dir", str(tmp_path)]}
    procs = {n: subprocess.Popen(c, stdout=subprocess.DEVNULL,
                                 stderr=open(tmp_path / f"{n}.log", "w"))
             for n, c in cmds.items()}
    client = Client(router)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                workers = client.status(0.5).workers
            except TimeoutError:
                continue
            if len(workers) == 2 and all(w["ready"] for w in workers.values()):
                break
        client.submit("r", [5, 6, 7, 8], {"max_new_tokens": 4})
        done = None
        while done is None and time.monotonic() < deadline:
            done = next((m for m in client.poll(0.5) if type(m).__name__ in ("Done", "Error")),
                        None)
        assert done is not None and done.reason not in ("stop", "length"), done
        client.shutdown(30)
        assert all(p.wait(30) == 0 for p in procs.values())
    finally:
        client.close()
        for p in procs.values():
            p.kill()
    logs = (tmp_path / "d.log").read_text() + (tmp_path / "p.log").read_text()
    assert "mismatch on model_digest" in logs, logs[-2000:]
    for name in ("p", "d"):
        assert replay_file(tmp_path / f"{name}.freelog").ok
