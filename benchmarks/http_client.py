"""A streaming client of any OpenAI-compatible server, for benchmarks (like ``vllm bench
serve``): sends a seeded workload at its arrival times to ``/v1/completions`` with
token-id prompts, and records when each chunk arrived.

Per request: TTFT = first chunk carrying output - sent; inter-token latency = gaps
between chunks carrying output (a chunk may carry several tokens: speculative decoding);
TPOT = (last output chunk - first) / (output tokens - 1). Output tokens come from the
stream's ``token_ids`` (pdkv, vLLM: ``return_token_ids``) or else from the final usage.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from deploy.loadgen.workload import WorkRequest


@dataclass
class Record:
    """What the client saw of one request (monotonic seconds)."""

    prompt_len: int
    t_submit: float = 0.0
    t_chunks: list[float] = field(default_factory=list)
    """Arrival of every chunk that carried output."""
    t_done: float = 0.0
    output_tokens: int = 0
    finish_reason: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.t_chunks)

    @property
    def ttft_s(self) -> float:
        return self.t_chunks[0] - self.t_submit if self.t_chunks else 0.0

    @property
    def tpot_s(self) -> float:
        n = self.output_tokens
        return (self.t_chunks[-1] - self.t_chunks[0]) / (n - 1) if n > 1 else 0.0

    @property
    def itls_s(self) -> list[float]:
        return list(np.diff(self.t_chunks)) if len(self.t_chunks) > 1 else []


@dataclass(frozen=True)
class Target:
    """Where and how to send."""

    url: str
    """Base URL, e.g. http://127.0.0.1:8000 (``/v1/completions`` is appended)."""
    model: str = ""
    """Sent as ``model``; empty asks the server's first model (GET /v1/models)."""
    api_key: str = ""
    token_ids: bool = True
    """Ask for ``return_token_ids`` (exact token counts per chunk)."""
    ignore_eos: bool = False
    timeout_s: float = 600.0


async def _model_of(session: aiohttp.ClientSession, target: Target) -> str:
    if target.model:
        return target.model
    async with session.get(f"{target.url}/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


def _body(target: Target, model: str, req: WorkRequest) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_new_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if target.token_ids:
        body["return_token_ids"] = True
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


def _apply(rec: Record, chunk: dict, now: float) -> None:
    for choice in chunk.get("choices") or []:
        ids = choice.get("token_ids")
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if ids or text:
            rec.t_chunks.append(now)
            rec.output_tokens += len(ids) if ids is not None else 0
        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    usage = chunk.get("usage")
    if usage and not rec.output_tokens:
        rec.output_tokens = int(usage.get("completion_tokens", 0))
    if "error" in chunk:
        rec.error = str(chunk["error"].get("message", chunk["error"]))


async def _one(session: aiohttp.ClientSession, target: Target, body: dict,
               rec: Record) -> None:
    rec.t_submit = time.monotonic()
    try:
        async with session.post(f"{target.url}/v1/completions", json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                _apply(rec, json.loads(line[6:]), time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.t_done = time.monotonic()


async def run_async(target: Target, requests: list[WorkRequest]) -> list[Record]:
    """Send ``requests`` at their arrival times; one ``Record`` each, in order."""
    headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=connector) as session:
        model = await _model_of(session, target)
        records = [Record(len(r.prompt)) for r in requests]
        tasks = []
        t0 = time.monotonic()
        for req, rec in zip(requests, records):
            delay = t0 + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, target, _body(target, model, req),
                                                  rec)))
        await asyncio.gather(*tasks)
    return records


def run(target: Target, requests: list[WorkRequest]) -> list[Record]:
    """``run_async`` in a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
        return uvloop.run(run_async(target, requests))
    except ImportError:
        return asyncio.run(run_async(target, requests))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize_records(records: list[Record], ttft_target_s: float,
                      tpot_target_s: float) -> dict:
    """TTFT/TPOT/ITL p50 and p99 (ms), tokens/s, request rate, goodput (requests/s that
    met both targets)."""
    ok = [r for r in records if r.ok]
    wall = (max(r.t_done for r in records) - min(r.t_submit for r in records)
            if records else 0.0)
    itls = [x for r in ok for x in r.itls_s]
    good = [r for r in ok if r.ttft_s <= ttft_target_s and r.tpot_s <= tpot_target_s]
    tokens = sum(r.output_tokens for r in ok)

    def per_s(n: int) -> float:
        return n / wall if wall > 0 else 0.0

    out = {"requests": len(records), "ok": len(ok), "wall_s": wall, "output_tokens": tokens,
           "tokens_per_s": per_s(tokens), "requests_per_s": per_s(len(ok)),
           "goodput_rps": per_s(len(good)),
           "errors": sorted({r.error for r in records if r.error})[:5]}
    for name, values in (("ttft", [r.ttft_s for r in ok]),
                         ("tpot", [r.tpot_s for r in ok if r.output_tokens > 1]),
                         ("itl", itls)):
        out[f"{name}_p50_ms"] = pct(values, 50) * 1e3
        out[f"{name}_p99_ms"] = pct(values, 99) * 1e3
    return out
