"""The OpenAI API over real HTTP: ``pdkv serve`` (a 1P1D deployment of real processes,
float64, the router in the front door's loop), driven with raw HTTP (httpx) and with the
official ``openai`` client; a second front door (``pdkv frontend``) shares its router.

Greedy outputs must equal the single-process reference token by token, and the same
prompts through ``pdkv run`` must give the same tokens as through HTTP.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from common.auth import create_keys
from common.model import Tokenizer, generate_greedy
from deploy.loadgen.workload import WorkloadSpec, make_workload
from tests.http_helpers import (
    CFG,
    GREEDY,
    KEY,
    assert_logs_clean,
    sse_events,
    start_frontend,
    start_serve,
)
from tests.metrics_helpers import parse
from tests.model_helpers import prompt

pytestmark = pytest.mark.timeout(240)
AUTH = {"authorization": f"Bearer {KEY}"}
TEXT = Tokenizer.for_model(CFG.model_config())
needs_text = pytest.mark.skipif(TEXT is None, reason="the model has no tokenizer")
ids_only = pytest.mark.skipif(TEXT is not None, reason="the served model has a tokenizer")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """(router address, key directory, url of ``pdkv serve --api-key``); at the end it
    stops on SIGTERM with exit 0 (clean shutdown, clean free logs), replayed here too."""
    tmp = tmp_path_factory.mktemp("http-api")
    create_keys(tmp / "keys")
    proc, url = start_serve(tmp, "--api-key", KEY, "--auth-keys", str(tmp / "keys"))
    router = re.search(r"router in this process at (\S+)$", proc.ready_line)
    try:
        assert router is not None, proc.ready_line
        yield router.group(1), tmp / "keys", url
    finally:
        assert proc.stop() == 0, (tmp / "serve.log").read_text()[-3000:]
        assert_logs_clean(tmp)


@pytest.fixture
def url(deployment) -> str:
    return deployment[2]


@pytest.fixture
def http(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture
def oai(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield client
    client.close()


def greedy(model, ids: list[int], n: int) -> list[int]:
    return generate_greedy(model, [ids], n, page_size=CFG.page_size)[0]


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == CFG.pool_tokens("decode")
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_with_token_ids_equals_the_reference(http, model):
    ids = prompt(37, seed=5)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 9,
                                           **GREEDY, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["token_ids"] == greedy(model, ids, 9)
    assert choice["finish_reason"] == "length"
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"] == {"prompt_tokens": 37, "completion_tokens": 9, "total_tokens": 46,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["prompt_token_ids"] == ids


def test_a_follow_up_turn_reports_its_cached_prefix(oai, model):
    """The second turn repeats the first's prompt and output: the workers load those pages
    from their host tiers, usage says how many prompt tokens were cached (whole pages of
    the shared prefix), and the output still equals the reference."""
    first = prompt(30, seed=12)
    r1 = oai.completions.create(model="tiny", prompt=first, max_tokens=6, temperature=0,
                                extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    follow = first + r1.choices[0].token_ids + prompt(9, seed=13)
    page = CFG.page_size
    deadline = time.monotonic() + 20  # the host copies of the first turn complete async
    while True:
        r2 = oai.completions.create(model="tiny", prompt=follow, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r2.choices[0].token_ids == greedy(model, follow, 5)
        cached = r2.usage.prompt_tokens_details.cached_tokens
        if cached or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert page * (len(first) // page) <= cached < len(follow), cached
    assert cached % page == 0


def test_stream_is_openai_sse_with_usage_last(http, model):
    ids = prompt(20, seed=6)
    body = {"prompt": ids, "max_tokens": 7, **GREEDY, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    streamed = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
    assert streamed == greedy(model, ids, 7)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_openai_client_completions_stream_and_not(oai, model):
    ids = prompt(15, seed=7)
    want = greedy(model, ids, 6)
    whole = oai.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].model_extra["token_ids"] == want
    assert whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens == 15
    stream = oai.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    chunks = list(stream)
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] \
        == want
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_stop_token_ids_end_the_output(http, model):
    ids = prompt(25, seed=8)
    full = greedy(model, ids, 12)
    absent = next(t for t in range(CFG.model_config().vocab_size) if t not in full)
    # every stop id travels to the decode, which stops there by itself
    for stops in ([full[4]], [absent, full[3]]):
        want = full[:full.index(next(t for t in full if t in stops)) + 1]
        r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 12,
                                               **GREEDY, "stop_token_ids": stops,
                                               "return_token_ids": True}).json()
        assert r["choices"][0]["token_ids"] == want, stops
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == len(want)


def test_top_k_1_and_a_tiny_top_p_sample_the_greedy_token(http, model):
    ids = prompt(18, seed=12)
    want = greedy(model, ids, 8)
    for extra in ({"top_k": 1}, {"top_p": 1e-9}, {"top_k": 1, "top_p": 0.5}):
        r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 8,
                                               "temperature": 1.0, "seed": 3,
                                               "return_token_ids": True, **extra}).json()
        assert r["choices"][0]["token_ids"] == want, extra


def test_a_seed_repeats_its_samples_across_requests(http):
    ids = prompt(14, seed=15)

    def sampled(**extra) -> list[int]:
        r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 12,
                                               "temperature": 1.0, "ignore_eos": True,
                                               "return_token_ids": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    assert sampled(seed=21) == sampled(seed=21)
    assert sampled(seed=21) != sampled(seed=22)
    assert sampled() != sampled()  # unseeded: each request draws its own


def test_request_ids_are_the_front_doors_own(http):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "user": "same-client"}
    a, b = (http.post("/v1/completions", json=body).json() for _ in range(2))
    assert a["id"] != b["id"]


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": [1, 2], "n": 2}, 400, "n"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1, 2], "top_p": 1.5}, 400, "top_p"),
    ({"prompt": [1, 2], "top_k": -5}, 400, "top_k"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1, 2], "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"prompt": [1, 2], "temperature": 50}, 400, "temperature"),
    ({"prompt": [1, 2], "logprobs": 3}, 400, "logprobs"),
    ({"prompt": [1, 2], "echo": True}, 400, "echo"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": [1, 2], "whatever": 1}, 400, "whatever"),
    ({"prompt": [1, 2], "stop_token_ids": [512]}, 400, "stop_token_ids"),
    ({"prompt": [1, 512]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[1], [2]]}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": [1] * 600}, 413, "prompt"),
    ({"prompt": [1] * 300, "max_tokens": 400}, 400, "max_tokens"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_openai_errors_naming_the_parameter(http, body, status, param):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"] and err["type"]


def test_body_that_is_not_json_is_a_400(http):
    r = http.post("/v1/completions", content=b"{not json", headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@ids_only
def test_text_needs_a_tokenizer_and_says_so(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                              "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "token ids" in r.json()["error"]["message"]
    for body, param in (({"prompt": "some text"}, "prompt"),
                        ({"prompt": [1, 2], "stop": "x"}, "stop")):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


@needs_text
def test_a_text_prompt_is_encoded_and_its_output_decoded(http, model):
    ids = TEXT.encode("The quick brown fox")
    body = {"prompt": "The quick brown fox", "max_tokens": 10, **GREEDY,
            "return_token_ids": True}
    whole = http.post("/v1/completions", json=body).json()
    assert whole["prompt_token_ids"] == ids
    assert whole["choices"][0]["token_ids"] == greedy(model, ids, 10)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert whole["choices"][0]["text"]


@needs_text
def test_chat_streams_text_and_stops_before_a_stop_string(http, oai):
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hello!"}], "max_tokens": 16, **GREEDY}
    full = http.post("/v1/chat/completions", json=body).json()
    text = full["choices"][0]["message"]["content"]
    assert full["object"] == "chat.completion" and len(text) > 6, text
    stop = text[3:6]
    want = text[:text.index(stop)]
    cut = http.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()
    assert cut["choices"][0]["message"]["content"] == want
    assert cut["choices"][0]["finish_reason"] == "stop"
    stream = oai.chat.completions.create(model="tiny", messages=body["messages"],
                                         max_tokens=16, temperature=0, stop=[stop],
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_api_key_is_required(url, oai):
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1]}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").status_code == 200  # health stays open
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        oai.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, top_p=7)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other", prompt=[1, 2], max_tokens=2)


def test_a_full_front_door_answers_429(deployment, tmp_path):
    """With room for one waiting request: A runs and fills the decode pool, B waits for
    the pool (no first token while A runs), C is refused with 429."""
    router, keys, _ = deployment   # a second front door, sharing serve's router
    proc, url = start_frontend(router, tmp_path / "fe.log", "--max-waiting", "1",
                               "--auth-keys", str(keys))
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            a = {"prompt": prompt(300, seed=9), "max_tokens": 300, **GREEDY,
                 "stream": True}
            b = {"prompt": prompt(10, seed=10), "max_tokens": 300, "stream": True,
                 "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=a) as ra:
                lines_a = ra.iter_lines()
                next(lines_a)  # A holds most of the decode pool now
                with http.stream("POST", "/v1/completions", json=b) as rb:
                    assert rb.status_code == 200
                    rc = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
                    assert rc.status_code == 429, rc.text
                    assert rc.json()["error"]["code"] == "rate_limit_exceeded"
                    assert rc.headers["retry-after"] == "1"
                    assert sse_events(rb.iter_lines())[-1] == "[DONE]"
                assert sse_events(lines_a)[-1] == "[DONE]"
    finally:
        assert proc.stop() == 0


def test_greedy_output_through_http_equals_pdkv_run(url, tmp_path):
    spec = WorkloadSpec(requests=5, seed=11, rate=0.0, prompt_len=(4, 60), output_len=(3, 10))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CFG.to_dict()))
    out = tmp_path / "run.jsonl"
    subprocess.run([sys.executable, "-m", "deploy.cli", "run", "--config", str(cfg),
                    "--requests", "5", "--seed", "11", "--rate", "0", "--prompt-len", "4",
                    "60", "--output-len", "3", "10", "--output", str(out)],
                   check=True, timeout=180, capture_output=True)
    ran = {r["rid"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        for req in make_workload(spec, CFG.model_config().vocab_size):
            r = http.post("/v1/completions", json={
                "prompt": req.prompt, "max_tokens": req.max_new_tokens, **GREEDY,
                "return_token_ids": True}).json()
            assert r["choices"][0]["token_ids"] == ran[req.rid], req.rid


def test_bench_serve_drives_an_endpoint_over_streaming_http(url):
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "serve", "--endpoint", url,
                        "--api-key", KEY, "--ignore-eos", "--repeats", "1", "--requests", "6",
                        "--rates", "20", "40", "--prompt-len", "4", "30", "--output-len", "2",
                        "6", "--json"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    points = out["deployments"][url]["points"]
    assert sorted(points) == ["20.0", "40.0"]
    for rate, p in points.items():
        spec = WorkloadSpec(requests=6, seed=1000 * (rate == "40.0"), rate=float(rate),
                            prompt_len=(4, 30), output_len=(2, 6))
        want = sum(q.max_new_tokens for q in make_workload(spec, CFG.model_config().vocab_size))
        assert p["ok"] == p["requests"] == 6
        assert p["output_tokens"] == want
        assert p["ttft_p50_ms"] > 0 and p["itl_p50_ms"] > 0


def test_metrics_are_scraped_through_the_front_door(http, url, model):
    """GET /metrics (behind the API key, which a scraper sends as a bearer token) is the
    router's view of the deployment in the Prometheus text format: every worker's
    families, labelled by worker; the tokens a request generated show in the decode's
    counter."""
    ids = prompt(11, seed=8)
    assert httpx.get(f"{url}/metrics").status_code == 401

    def generated() -> float:
        r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = parse(r.text)
        workers = {labels["worker"] for labels, _ in samples["pdkv_kv_pages"]}
        assert any(w.startswith("prefill") for w in workers), workers
        assert any(w.startswith("decode") for w in workers), workers
        return sum(v for labels, v in samples["pdkv_generation_tokens_total"])

    before = generated()
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, **GREEDY})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30  # workers report on their heartbeat
    while generated() < before + 5:
        assert time.monotonic() < deadline, "generated tokens never reached /metrics"
        time.sleep(0.2)
