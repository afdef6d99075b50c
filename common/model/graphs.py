"""CUDA graphs of decode passes, one per batch bucket: a step replays ~10 kernels per layer
as one launch instead of issuing them from Python.

A decode pass (every item one token, the target model, no token ids from the device) is
padded to a bucket (``graph_bucket``): items to the next of ``ROW_BUCKETS``, pages per item
to the next power of two. Padding items hold one token at position 0 of page 0 (reserved,
never allocated), so their K/V writes land where no row reads, and the runner cuts their
logits off. The pass's arrays then have the same shapes and the same place in the step's
plan for every step of the bucket.

The first pass of a bucket is captured (after a warm-up on a side stream, so that lazy
initialisation and compilation happen outside the capture) reading its arrays from a
static device buffer; later passes copy their plan's bytes into that buffer (a device to
device copy of the one upload) and replay. Graphs share one memory pool. A capture that
fails (an op that cannot be captured) turns graphs off for the runner, with a warning: the
passes run eagerly, as on CPU.

On CPU (and with ``PDKV_CUDA_GRAPHS=0``) nothing is captured; ``DecodeGraphs(capture=False)``
still pads, which is how tests check the padding on CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.model.plan import DevicePlan

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Batch sizes a decode pass is padded to (larger batches run eagerly)."""


def graphs_wanted(device: torch.device) -> bool:
    """On CUDA unless ``PDKV_CUDA_GRAPHS=0``."""
    return device.type == "cuda" and os.environ.get("PDKV_CUDA_GRAPHS", "1") != "0"


def graph_bucket(lengths: np.ndarray, pages: Sequence[int]) -> tuple[int, int] | None:
    """(items, pages per item) a decode pass is padded to; None: not a decode pass, or
    too large a batch."""
    if not len(lengths) or (lengths != 1).any() or len(lengths) > ROW_BUCKETS[-1]:
        return None
    rows = next(b for b in ROW_BUCKETS if b >= len(lengths))
    return rows, 1 << max(int(max(pages)) - 1, 0).bit_length()


class DecodeGraphs:
    """The captured decode passes of one runner (see the module doc).

    Args:
        capture: capture and replay (CUDA); False: pad only, run eagerly.
    """

    def __init__(self, capture: bool = True) -> None:
        self.capture = capture
        self.failed = False
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def logits(self, runner: Any, pp: Any, dev: DevicePlan) -> torch.Tensor:
        """Logits of the padded pass ``pp`` (a ``PassPlan``) of ``runner`` (the
        ``ModelRunner`` that owns these graphs), padding rows included."""
        if not self.capture or self.failed or runner.device.type != "cuda":
            return runner.logits(pp, dev, runner.run(pp, dev))
        key = (pp.bucket, pp.span)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._graphs[key] = self._capture(runner, pp, dev)
            except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly
                logger.warning("CUDA graph capture of a %s-item decode pass failed (%s); "
                               "decode passes run without graphs", pp.bucket, exc)
                self.failed = True
                return runner.logits(pp, dev, runner.run(pp, dev))
        graph, static, out = entry
        start, end = pp.span
        static[start:end].copy_(dev.data[start:end], non_blocking=True)
        graph.replay()
        return out

    def _capture(self, runner: Any, pp: Any, dev: DevicePlan) -> tuple:
        start, end = pp.span
        static = torch.zeros(end, dtype=torch.uint8, device=runner.device)
        static[start:end].copy_(dev.data[start:end])
        plan = DevicePlan(static)
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm-up: lazy init, autotuning, compilation
                runner.logits(pp, plan, runner.run(pp, plan), padded=True)
        torch.cuda.current_stream(runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            out = runner.logits(pp, plan, runner.run(pp, plan), padded=True)
        logger.info("captured a CUDA graph for %s-item decode passes (%d so far)",
                    pp.bucket, len(self._graphs) + 1)
        return graph, static, out
