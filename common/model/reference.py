"""Single-process greedy generation: the correctness anchor (docs/design.md, "Correctness anchor").

Each request runs alone, prefilled in one shot and decoded one token per step through a
real ``KvCache``, so any disaggregated run (chunked prefill, transfer, batching,
speculation, offload) must reproduce these tokens exactly at float64 on CPU.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from common.kv import KvCache, ceil_div
from common.model.model import Model
from common.model.runner import BatchItem, ModelRunner


def generate_greedy(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                    page_size: int = 16, stop_token: int | None = None,
                    stop_token_ids: Collection[int] = ()) -> list[list[int]]:
    """Greedy outputs of each prompt, one request at a time.

    Args:
        model: the target model (the draft is not used: greedy output is the target's).
        prompts: token-id lists, each non-empty.
        max_new_tokens: tokens to generate per prompt (>= 0).
        page_size: slots per page of the reference's pool.
        stop_token, stop_token_ids: generation of a request ends after it emits one of
            these tokens (e.g. a checkpoint's eos ids); the stop token is included in its
            output.

    Returns:
        One list of generated token ids per prompt (the prompt excluded).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    cache = KvCache(ceil_div(longest, page_size) + 1, page_size,
                    layout=model.config.kv_layout(with_draft=False), device=model.device,
                    max_rows=1, node="reference")
    runner = ModelRunner(model, cache)
    stops = frozenset(stop_token_ids) | ({stop_token} if stop_token is not None else set())
    outputs = [_generate_one(runner, list(p), max_new_tokens, stops) for p in prompts]
    cache.check_integrity()
    cache.close()
    return outputs


def _generate_one(runner: ModelRunner, prompt: list[int], max_new_tokens: int,
                  stops: frozenset[int]) -> list[int]:
    cache = runner.cache
    kv = cache.open_row("ref")
    out: list[int] = []
    # Row positions: [0, len(prompt)) prompt | then one per generated token except the last,
    # whose KV is never needed.
    tokens, start = prompt, 0
    while len(out) < max_new_tokens and (not out or out[-1] not in stops):
        cache.extend(kv, len(tokens))
        logits = runner.forward([BatchItem(kv, tokens, start)])
        cache.commit(kv, len(tokens))
        start += len(tokens)
        out.append(runner.model.greedy(logits)[0])
        tokens = out[-1:]
    cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="finished")
    cache.close_row(kv)
    return out
