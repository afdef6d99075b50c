"""How big a worker is: its KV pool from a memory budget, its torch threads from its cores.

Pools are sized in bytes, not tokens, so the same defaults fit a 135M model and an 8B one:

| device | budget of the device pool (``prefill_pages``/``decode_pages`` override it) |
| --- | --- |
| CPU | ``kv_memory_mib`` |
| CUDA | ``gpu_memory_utilization`` of the device's total (at most what is free), less |
|      | the model's weights and an activation margin |

The host tier is ``host_memory_mib`` (or ``host_pages``) on either. A worker's torch
threads default to the cores it may run on (its CPU affinity), which the launcher splits
between the workers it starts on one host.
"""

from __future__ import annotations

import logging
import os

from common.config import ServeConfig
from common.model import ModelConfig

logger = logging.getLogger(__name__)

ACTIVATION_FLOOR_BYTES = 256 << 20
"""CUDA: kept free beyond the estimated activations (allocator slack, kernels' workspaces)."""


def device_pool_pages(cfg: ServeConfig, role: str, device: str) -> int:
    """Pages of a ``role`` worker's pool on ``device`` (call before its model loads)."""
    if device.startswith("cuda") and not (cfg.prefill_pages if role == "prefill"
                                          else cfg.decode_pages):
        return cfg.pool_pages(role, cuda_kv_budget(cfg, role, device))
    return cfg.pool_pages(role)


def cuda_kv_budget(cfg: ServeConfig, role: str, device: str) -> int:
    """Bytes a CUDA worker's KV pool may take: its share, ``gpu_memory_utilization`` of
    the device's total (no more than is free now), less the weights this rank will load
    and the activations of one forward pass. Workers sharing a device each take their
    share (two on one GPU: 0.45 each, say), as vLLM instances do.

    Raises:
        ValueError: nothing is left for even two pages; the message names the figures.
    """
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    tp = cfg.role_tp(role)
    weights = weight_bytes(cfg.model_config()) // tp
    draft = cfg.draft_model_config()
    if draft is not None and cfg.with_draft:
        weights += weight_bytes(draft) // tp
    acts = activation_bytes(cfg.model_config(), cfg.max_prefill_tokens) // tp
    share = min(int(total * cfg.gpu_memory_utilization), free)
    budget = share - weights - acts
    if budget < 2 * cfg.page_bytes(role):
        raise ValueError(
            f"{device}: no room for a KV pool: gpu_memory_utilization="
            f"{cfg.gpu_memory_utilization} of {total >> 20} MiB ({free >> 20} MiB free), "
            f"weights {weights >> 20} MiB, activations {acts >> 20} MiB; raise "
            "gpu_memory_utilization (workers sharing a device each need their share: two "
            "on one GPU, 0.45 each) or give decode_pages/prefill_pages")
    logger.info("%s: KV pool budget %d MiB (%.2f of %d MiB, %d free, weights %d, "
                "activations %d)", device, budget >> 20, cfg.gpu_memory_utilization,
                total >> 20, free >> 20, weights >> 20, acts >> 20)
    return budget


def weight_bytes(m: ModelConfig) -> int:
    """Bytes of a Llama-style decoder's weights (norms ignored)."""
    attn = m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim \
        + m.num_heads * m.head_dim * m.hidden_size
    mlp = 3 * m.hidden_size * m.intermediate_size
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return (m.num_layers * (attn + mlp) + embed) * _dtype_bytes(m)


def activation_bytes(m: ModelConfig, tokens: int) -> int:
    """A generous bound on one forward pass's live activations over ``tokens`` tokens:
    the residual, q/k/v, the MLP's three widths and one row of logits per token."""
    per_token = 6 * m.hidden_size + 3 * m.intermediate_size + m.vocab_size
    return tokens * per_token * max(4, _dtype_bytes(m)) + ACTIVATION_FLOOR_BYTES


def _dtype_bytes(m: ModelConfig) -> int:
    from common.kv import DTYPE_BYTES
    return DTYPE_BYTES[m.dtype]


def passive_omp_waits() -> None:
    """Let OpenMP threads sleep, not spin, between parallel regions (``OMP_WAIT_POLICY``
    PASSIVE unless set), before torch loads its OpenMP runtime.

    A torch thread that spins on a core which the router, the HTTP front door or another
    worker also needs holds up every parallel region of the step: measured on 2 cores, a
    2-thread colocated worker beside its router took 0.5-3.8 s per 8-token request
    spinning and 13-31 ms sleeping (1 thread: 21-50 ms)."""
    import sys
    if "torch" in sys.modules:
        logger.debug("torch already loaded: OMP_WAIT_POLICY is what it was")
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def affinity_cores() -> int:
    """Cores this process may run on (its CPU affinity; all where the OS cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def torch_threads(requested: int) -> int:
    """Torch threads of a worker: ``requested``, or (0) one per core it may run on."""
    return requested if requested > 0 else affinity_cores()


def split_cores(num_workers: int, cores: list[int] | None = None) -> list[list[int]]:
    """The host's cores shared out between ``num_workers`` workers, as even contiguous
    blocks (more workers than cores: round-robin, one core each)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if num_workers >= len(cores):
        return [[cores[i % len(cores)]] for i in range(num_workers)]
    base, extra = divmod(len(cores), num_workers)
    out, at = [], 0
    for i in range(num_workers):
        n = base + (i < extra)
        out.append(cores[at:at + n])
        at += n
    return out
