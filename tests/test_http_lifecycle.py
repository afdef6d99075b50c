"""Front-door lifecycle with real processes: many concurrent streams, clients that leave
at random moments, and SIGTERM of ``pdkv serve`` under load. Every story ends with the
free logs replaying clean; aborted requests show as frees with reason ``aborted``."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from common.auth import Keys
from deploy.launch.launcher import Cluster
from deploy.router.client import Client
from tests.http_helpers import (
    CFG,
    GREEDY,
    assert_logs_clean,
    children_of,
    sse_events,
    start_frontend,
    start_serve,
)
from tests.model_helpers import prompt

pytestmark = pytest.mark.timeout(300)


async def _stream(client: httpx.AsyncClient, body: dict, leave_after: int | None = None
                  ) -> list:
    """The SSE payloads of one streaming completion; with ``leave_after`` the client
    closes the connection after that many chunks (0: before the first token)."""
    events = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        if leave_after == 0:
            return events
        async for line in r.aiter_lines():
            events += sse_events([line])
            if leave_after is not None and len(events) >= leave_after:
                return events
    return events


def _wait_router_idle(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """No request left in flight at the router (so none is held by a worker)."""
    client = Client(cluster.router_addr, "test", Keys(cluster.keys_dir))
    try:
        deadline = time.monotonic() + timeout_s
        while (n := client.status(2.0).in_flight) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert n == 0, f"{n} requests still in flight at the router"
    finally:
        client.close()


@pytest.fixture
def frontdoor(tmp_path):
    """A fresh 1P1D deployment behind ``pdkv frontend``: (cluster, url, log dir)."""
    cluster = Cluster(CFG, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    proc, url = start_frontend(cluster.router_addr, tmp_path / "frontend.log", "--auth-keys",
                               str(cluster.keys_dir))
    try:
        yield cluster, url, tmp_path
    finally:
        proc.stop()
        cluster.stop()


def test_200_concurrent_streams_all_complete(frontdoor):
    cluster, url, tmp = frontdoor

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
            bodies = [{"prompt": prompt(4 + i % 29, seed=i), "max_tokens": 2 + i % 5,
                       **GREEDY, "return_token_ids": True} for i in range(200)]
            return bodies, await asyncio.gather(*(_stream(client, b) for b in bodies))

    bodies, streams = asyncio.run(main())
    for body, events in zip(bodies, streams):
        assert events[-1] == "[DONE]"
        assert all("choices" in e for e in events[:-1]), events[-2]
        ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
        assert len(ids) == body["max_tokens"]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert len({e[0]["id"] for e in streams}) == 200
    _wait_router_idle(cluster)
    cluster.stop()
    cluster.check_exit_codes()
    assert_logs_clean(tmp)


def test_clients_leaving_at_random_moments_leak_nothing(frontdoor):
    cluster, url, tmp = frontdoor
    rng = random.Random(0)

    async def one(client: httpx.AsyncClient, i: int):
        body = {"prompt": prompt(rng.randint(4, 80), seed=100 + i),
                "max_tokens": rng.randint(8, 60), "temperature": 0}
        kind = rng.choice(["before-first", "mid-stream", "mid-stream", "whole", "impatient"])
        if kind == "impatient":  # a non-streaming client that gives up before the answer
            try:
                await client.post("/v1/completions", json=body, timeout=rng.uniform(0.005,
                                                                                      0.1))
            except httpx.TimeoutException:
                pass
            return kind, None
        leave = {"before-first": 0, "mid-stream": rng.randint(1, 6), "whole": None}[kind]
        return kind, await _stream(client, body, leave)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(40)))

    outcomes = asyncio.run(main())
    assert all(ev[-1] == "[DONE]" for kind, ev in outcomes if kind == "whole")
    _wait_router_idle(cluster)
    health = httpx.get(f"{url}/health").json()
    assert health["open"] == 0 and health["in_flight"] == 0, health
    cluster.stop()
    cluster.check_exit_codes()
    reasons = assert_logs_clean(tmp)
    assert reasons.get("aborted", 0) > 0, reasons


def test_sigterm_of_pdkv_serve_ends_every_stream_with_an_error(tmp_path):
    proc, url = start_serve(tmp_path, "--decode-pages", "2400")
    children = children_of(proc.pid)
    assert len(children) >= 2, children  # prefill, decode
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children]
    assert not [c for c in commands if b"router" in c], commands  # it runs in serve's loop
    assert "router in this process" in proc.ready_line, proc.ready_line

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            started = asyncio.Event()
            n_started = 0

            async def one(i: int):
                nonlocal n_started
                events = []
                body = {"prompt": prompt(8, seed=200 + i), "max_tokens": 1500,
                        **GREEDY, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        events += sse_events([line])
                        if len(events) == 1:
                            n_started += 1
                            if n_started == 5:
                                started.set()
                return events

            async def whole():
                await started.wait()
                return await client.post("/v1/completions", json={
                    "prompt": prompt(8, seed=300), "max_tokens": 1500, "ignore_eos": True})

            tasks = [asyncio.create_task(one(i)) for i in range(5)]
            plain = asyncio.create_task(whole())
            await asyncio.wait_for(started.wait(), 120)
            await asyncio.sleep(0.2)  # the plain request is in flight too
            proc.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks), await plain

    streams, plain = asyncio.run(main())
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        assert "error" in events[-2] and "shutting down" in events[-2]["error"]["message"]
        assert all("choices" in e for e in events[:-2])
    assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
    assert proc.proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    out = proc.proc.stdout.read().decode()
    proc.stop()
    assert "free logs replayed, clean" in out, out
    left = {pid for pid in children if _alive(pid)}
    assert not left, f"processes left behind: {left}"
    reasons = assert_logs_clean(tmp_path)
    assert reasons.get("aborted", 0) > 0, reasons
    assert json.loads((tmp_path / "serve.json").read_text())["dtype"] == "float64"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_no_router_is_a_503_with_the_reason(tmp_path):
    proc, url = start_frontend(f"ipc://{tmp_path}/nobody.sock", tmp_path / "fe.log")
    try:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "not answering" in health.json()["reason"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert r.status_code == 503 and "not answering" in r.json()["error"]["message"]
    finally:
        assert proc.stop() == 0


def test_a_lost_router_ends_open_streams_with_an_error(tmp_path):
    cluster = Cluster(CFG, "disagg", 1, 1, log_dir=str(tmp_path)).start()
    proc, url = start_frontend(cluster.router_addr, tmp_path / "fe.log",
                               "--router-timeout-s", "1.5", "--auth-keys",
                               str(cluster.keys_dir))
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            body = {"prompt": prompt(8, seed=400), "max_tokens": 620, "stream": True,
                    "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                lines = r.iter_lines()
                next(lines)
                router = next(p for p in cluster.procs if p.role == "router")
                router.popen.send_signal(signal.SIGKILL)
                events = sse_events(lines)
            assert len(events) >= 2 and events[-1] == "[DONE]", events
            assert "silent" in events[-2]["error"]["message"], events[-2]
            assert http.get("/health").status_code == 503
    finally:
        assert proc.stop() == 0
        cluster.stop()
