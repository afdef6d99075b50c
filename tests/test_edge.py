"""One edge for a request, with real processes: ``pdkv serve`` (the router in the front
door's loop, workers as processes, float64) driven over real HTTP (httpx, the openai
client) and, on the same router's socket, by ``pdkv run``'s client
(``deploy.router.client.Client``).

- An ordinary stop is a stop the workers see: a stop token id that is not the first of
  the request's, an end-of-sequence id, and a stop string cut at the router all end the
  request with its decode's row freed ``finished`` (the free log, replayed after a
  clean shutdown, says so request by request); a client that leaves is ``aborted``.
- The same bad request gets the same limit and the same message through HTTP (``pdkv
  serve``, and ``pdkv frontend`` in front of the same router) and straight through the
  router, its code mapped to the status at the HTTP edge alone.
- The fields vLLM's and sglang's clients send are accepted at their neutral values.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch

from common.auth import Keys, create_keys
from common.control import Done, Error, pack_ids
from common.freelog import FreeLogReader
from common.model import Model, Tokenizer, generate_greedy
from deploy.http.errors import STATUS
from deploy.router.client import Client
from deploy.router.params import SAMPLING
from deploy.router.routes import label_of
from tests.http_helpers import (
    CFG,
    GREEDY,
    assert_logs_clean,
    sse_events,
    start_frontend,
    start_serve,
)
from tests.model_helpers import prompt

pytestmark = pytest.mark.timeout(300)
TOK = Tokenizer.for_model(CFG.model_config())
EOS = set(TOK.eos_token_ids)


@pytest.fixture(scope="module")
def model():
    return Model(CFG.model_config())


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """(url of ``pdkv serve --auth-keys``, url of a ``pdkv frontend`` in front of the same
    router over its socket, a ``Client`` of that router); at the end both stop cleanly
    and the free logs replay clean."""
    tmp = tmp_path_factory.mktemp("edge")
    create_keys(tmp / "keys")
    proc, url = start_serve(tmp, "--auth-keys", str(tmp / "keys"))
    router = re.search(r"router in this process at (\S+)$", proc.ready_line).group(1)
    client = Client(router, "test", Keys(tmp / "keys"), identity="client")
    fe, fe_url = start_frontend(router, tmp / "frontend.log", "--auth-keys", str(tmp / "keys"))
    try:
        yield url, fe_url, client
    finally:
        client.close()
        assert fe.stop() == 0
        assert proc.stop() == 0, (tmp / "serve.log").read_text()[-3000:]
        assert_logs_clean(tmp)


@pytest.fixture(scope="module")
def serve(deployment):
    """(url of ``pdkv serve``, a ``Client`` of its router)."""
    return deployment[0], deployment[2]


# -- an ordinary stop is freed 'finished' ---------------------------------------------------
def _eos_prompt(model) -> tuple[list[int], list[int]]:
    """A prompt whose greedy output reaches an end-of-sequence id within 30 tokens, and
    that output up to it (the seeds are searched in order: the same one every run)."""
    for first in range(0, 512, 32):
        prompts = [prompt(12 + s % 20, seed=1000 + s) for s in range(first, first + 32)]
        for p, out in zip(prompts, generate_greedy(model, prompts, 30, page_size=4)):
            at = next((i for i, t in enumerate(out) if t in EOS), None)
            if at is not None and at > 0:
                return p, out[:at + 1]
    raise AssertionError("no prompt of the tiny model reaches eos within 30 tokens")


def _frees(log, owner_label: str) -> set[str]:
    """The reasons with which ``log``'s owner of the client's label freed pages."""
    return {e["reason"] for e in FreeLogReader(log).records
            if e.get("op") == "free" and label_of(str(e.get("owner", ""))) == owner_label}


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_ordinary_stops_are_freed_finished_and_aborts_aborted(tmp_path, model, mode):
    # every disaggregated request through the prefill: "stop_string" repeats "whole"'s
    # prompt, which the decode would otherwise compute itself from its prefix cache
    proc, url = start_serve(tmp_path, *(["--mode", "colocated"] if mode == "colocated"
                                        else ["--local-prefill-tokens", "0"]))
    ids: dict[str, str] = {}
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            def complete(name: str, **body) -> dict:
                r = http.post("/v1/completions", json={"return_token_ids": True, **body})
                assert r.status_code == 200, r.text
                ids[name] = r.json()["id"]
                return r.json()["choices"][0]

            # a stop id that is not the request's first one (the decode stops on it)
            p = prompt(25, seed=8)
            full = generate_greedy(model, [p], 12, page_size=4)[0]
            absent = next(t for t in range(3, 512) if t not in full)
            got = complete("stop_id", prompt=p, max_tokens=12, temperature=0,
                           ignore_eos=True, stop_token_ids=[absent, full[3]])
            assert got["token_ids"] == full[:full.index(full[3]) + 1]
            assert got["finish_reason"] == "stop"
            # the model's end of sequence (no ignore_eos)
            p, want = _eos_prompt(model)
            got = complete("eos", prompt=p, max_tokens=30, temperature=0)
            assert got["token_ids"] == want and got["finish_reason"] == "stop"
            # a stop string, cut at the router
            text = complete("whole", prompt="The quick brown fox", max_tokens=16,
                            **GREEDY)["text"]
            assert len(text) > 8, text
            stop = text[len(text) // 2:len(text) // 2 + 3]
            got = complete("stop_string", prompt="The quick brown fox", max_tokens=16,
                           stop=stop, **GREEDY)
            assert got["text"] == text[:text.index(stop)] and got["finish_reason"] == "stop"
            # a client that leaves mid-stream
            with http.stream("POST", "/v1/completions", json={
                    "prompt": prompt(9, seed=4), "max_tokens": 300, "stream": True,
                    **GREEDY}) as r:
                first = next(line for line in r.iter_lines() if line.startswith("data: "))
                ids["left"] = json.loads(first[len("data: "):])["id"]   # and it leaves
    finally:
        assert proc.stop() == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert_logs_clean(tmp_path)
    decode = tmp_path / ("colocated0.freelog" if mode == "colocated" else "decode0.freelog")
    for name in ("stop_id", "eos", "whole", "stop_string"):
        assert _frees(decode, ids[name]) == {"finished"}, name
    assert _frees(decode, ids["left"]) == {"aborted"}
    if mode == "disagg":
        for name in ("stop_id", "eos", "stop_string"):
            assert _frees(tmp_path / "prefill0.freelog", ids[name]) == {"sent"}, name


# -- one set of limits, one vocabulary of refusals ------------------------------------------
BAD = {   # name: (router Submit: prompt ids, params, text/messages/stop)
    "temperature 50": ([5] * 8, {"temperature": 50}, {}),
    "prompt too long": ([5] * 600, {}, {}),
    "prompt outside the vocabulary": ([5, 512], {}, {}),
    "unknown field": ([5] * 8, {"whatever": 1}, {}),
    "bad stop id": ([5] * 8, {"stop_token_ids": [512]}, {}),
    "no output": ([5] * 8, {"max_new_tokens": 0}, {}),
    "row too long": ([5] * 300, {"max_new_tokens": 400}, {}),
    "two choices": ([5] * 8, {"n": 2}, {}),
    "another model": ([5] * 8, {"model": "gpt-4"}, {}),
    "five stop strings": ([], {}, {"text": "hello", "stop": list("abcde")}),
    "text too long": ([], {}, {"text": "x" * 80_000}),
    "a robot's message": ([], {}, {"messages": [{"role": "robot", "content": "hi"}]}),
}


def _http_body(ids: list[int], params: dict, kw: dict) -> tuple[str, dict]:
    """The OpenAI request of a router submission: (path, body)."""
    body = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in params.items()}
    if "messages" in kw:
        return "/v1/chat/completions", {**body, "messages": kw["messages"]}
    body["prompt"] = kw.get("text") or ids
    if "stop" in kw:
        body["stop"] = kw["stop"]
    return "/v1/completions", body


@pytest.mark.parametrize("name", list(BAD))
def test_the_same_bad_request_gets_the_same_answer_through_http_and_the_router(deployment,
                                                                              name):
    """Through the router's socket (``pdkv run``'s client), through ``pdkv serve`` (the
    router in its loop) and through ``pdkv frontend`` (over the router's socket)."""
    url, fe_url, client = deployment
    ids, params, kw = BAD[name]
    client.submit(f"bad-{name}", ids, params, **kw)
    answer = next(m for m in _poll(client) if getattr(m, "rid", "") == f"bad-{name}")
    assert isinstance(answer, Error), answer
    path, body = _http_body(ids, params, kw)
    for front in (url, fe_url):
        r = httpx.post(front + path, json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == STATUS[answer.code] >= 400, (front, answer, err)
        assert err["message"] == answer.error, front
        want_param = "max_tokens" if answer.param == "max_new_tokens" else answer.param
        assert err["param"] == want_param and answer.param, (front, answer, err)


def _poll(client: Client):
    for _ in range(100):
        yield from client.poll(0.1)
    raise AssertionError("the router never answered")


def test_the_limits_are_the_same_for_a_good_request_too(serve, model):
    """The longest prompt the door lets in passes both ways, and gives the same tokens."""
    url, client = serve
    longest = CFG.pool_tokens("prefill")   # a prefill row holds the prompt
    p = prompt(longest, seed=21)
    client.submit("edge-long", p, {"max_new_tokens": 2, "ignore_eos": True})
    done = next(m for m in _poll(client) if isinstance(m, (Done, Error))
                and m.rid == "edge-long")
    assert isinstance(done, Done) and done.reason == "length", done
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": p, "max_tokens": 2, **GREEDY, "return_token_ids": True})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": p + [5]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded"


# -- what vLLM's and sglang's clients send ----------------------------------------------------
def test_what_vllm_and_sglang_benchmark_clients_send_is_served(serve):
    url, _ = serve
    text = "The quick brown fox jumps over the lazy dog"
    bodies = {
        "vllm bench serve, completions": ("/v1/completions", {
            "model": "tiny", "prompt": text, "temperature": 0.0, "repetition_penalty": 1.0,
            "max_tokens": 8, "logprobs": None, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}),
        "vllm bench serve, chat": ("/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": [
                {"type": "text", "text": text}]}], "temperature": 0.0,
            "max_completion_tokens": 8, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "repetition_penalty": 1.0}),
        "sglang bench_serving": ("/v1/completions", {
            "model": "tiny", "prompt": text, "temperature": 0.0, "best_of": 1,
            "max_tokens": 8, "stream": True, "ignore_eos": True}),
        "every neutral extra": ("/v1/completions", {
            "model": "tiny", "prompt": text, "max_tokens": 8, "ignore_eos": True,
            "temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 7,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "stop_token_ids": [], "skip_special_tokens": True,
            "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
            "min_tokens": 0, "n": 1, "echo": False, "logit_bias": None, "user": "bench",
            "stop": None, "stream": True}),
    }
    for name, (path, body) in bodies.items():
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            assert r.status_code == 200, (name, r.read())
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]", name
        if body.get("stream_options"):
            assert events[-2]["usage"]["completion_tokens"] == 8, name
        assert events[-3 if body.get("stream_options") else -2]["choices"][0][
            "finish_reason"] == "length", name


def test_a_field_that_would_change_the_output_is_never_ignored(serve):
    url, _ = serve
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        out = oai.completions.create(model="tiny", prompt=[5] * 8, max_tokens=4,
                                     temperature=0, extra_body={
                                         "repetition_penalty": 1.0, "top_k": -1,
                                         "min_p": 0.0, "ignore_eos": True})
        assert out.usage.completion_tokens == 4
        for name, value in (("repetition_penalty", 1.3), ("presence_penalty", 0.5),
                            ("frequency_penalty", 0.5), ("min_p", 0.2)):
            assert name in SAMPLING, name   # the sampler serves it (its effect: below)
            out = oai.completions.create(model="tiny", prompt=[5] * 8, max_tokens=4,
                                         extra_body={name: value, "ignore_eos": True})
            assert out.usage.completion_tokens == 4, name
        for name, value in (("repetition_penalty", 0), ("presence_penalty", 2.5),
                            ("frequency_penalty", -3), ("min_p", 1.5)):
            with pytest.raises(openai.BadRequestError, match=f"{name}={value}") as exc:
                oai.completions.create(model="tiny", prompt=[5] * 8, max_tokens=4,
                                       extra_body={name: value})
            assert exc.value.body["param"] == name
    finally:
        oai.close()


def _penalised_greedy(model: Model, p: list[int], n: int, presence: float, frequency: float,
                      repetition: float) -> list[int]:
    """Greedy decoding with vLLM's penalties written out on the host, a dense forward of
    the whole sequence per token (float64): the reference for the served sampler."""
    out: list[int] = []
    for _ in range(n):
        x = model.forward_dense(p + out)[-1].double().clone()
        seen = torch.tensor(sorted(set(p) | set(out)), dtype=torch.int64)
        x[seen] = torch.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64),
                                minlength=len(x)).double()
        x -= frequency * counts + presence * (counts > 0).double()
        out.append(int(x.argmax()))
    return out


def test_penalties_and_min_p_take_effect_through_the_front_door(serve, model):
    """vLLM's penalties and min_p, sent over HTTP, reach the workers' device sampler:
    greedy with all three penalties equals a host-side reference (and differs from plain
    greedy), and a seeded draw at temperature 1 with min_p 1 (only the most likely token
    kept) is greedy decoding."""
    url, _ = serve
    p = prompt(12, seed=41)
    n = 16

    def tokens(**body) -> list[int]:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": p, "max_tokens": n, "ignore_eos": True, "return_token_ids": True,
            **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    plain = generate_greedy(model, [p], n, page_size=4)[0]
    penalties = {"presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.5}
    want = _penalised_greedy(model, p, n, 0.4, 0.3, 1.5)
    assert want != plain   # the penalties change this output: the check can fail
    assert tokens(temperature=0, **penalties) == want
    assert tokens(temperature=1.0, min_p=1.0, seed=3) == plain
    assert tokens(temperature=1.0, seed=3) != plain   # without min_p the draw is not greedy


def test_stop_token_ids_and_prompt_ids_round_trip_through_both_paths(serve, model):
    url, client = serve
    p = prompt(20, seed=31)
    full = generate_greedy(model, [p], 10, page_size=4)[0]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True,
              "stop_token_ids": [511 if full[5] != 511 else 510, full[5]],
              "return_token_ids": True}
    client.submit("edge-ids", p, params)
    got, done = [], None
    for m in _poll(client):
        if getattr(m, "rid", "") == "edge-ids":
            if isinstance(m, (Done, Error)):
                done = m
                break
            got += m.ids
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        "stop_token_ids": params["stop_token_ids"], "return_token_ids": True}).json()
    want = full[:full.index(full[5]) + 1]
    assert got == r["choices"][0]["token_ids"] == want
    assert done.reason == "stop" and r["choices"][0]["finish_reason"] == "stop"
    assert done.prompt_ids == pack_ids(p) and r["prompt_token_ids"] == p
