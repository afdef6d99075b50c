"""A step's plan: every index and parameter array of one step, built on the host in one
buffer and copied to the device once.

A step (a prefill pass, a decode step, a speculative step with its draft passes) needs
token ids, positions, pool rows, page tables, attention bounds and sampling parameters.
Each array is ``add``-ed here as numpy, packed 8-byte aligned into one host buffer (pinned
memory on CUDA), and ``upload`` copies the buffer to the device in one non-blocking copy;
views of the device buffer (``DevicePlan[slot]``) are the step's index tensors. The step's
results come back with ``download``, the one copy out.

Those two functions are the only places where a step's data crosses between host and
device (tests/test_sync_free.py counts them and fails on any other transfer or sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
           np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
           np.dtype(np.uint8): torch.uint8}


@dataclass(frozen=True)
class Slot:
    """Where one array lies in a plan's buffer."""

    offset: int
    """Byte offset (a multiple of 8)."""
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class HostPlan:
    """Arrays of one step, gathered on the host before the one copy to ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._parts: list[tuple[int, np.ndarray]] = []
        self._size = 0

    @property
    def nbytes(self) -> int:
        return self._size

    def add(self, array: np.ndarray | list, dtype: np.dtype | type | None = None) -> Slot:
        """Adds ``array`` (copied when the plan is uploaded) and returns its slot."""
        a = np.ascontiguousarray(array, dtype=dtype)
        if a.dtype not in _DTYPES:
            raise TypeError(f"plan arrays are int64, int32, float32, float64 or uint8, "
                            f"not {a.dtype}")
        slot = Slot(self._size, _DTYPES[a.dtype], a.shape)
        self._parts.append((self._size, a))
        self._size += -(-a.nbytes // 8) * 8
        return slot

    def upload(self) -> DevicePlan:
        """The one copy of the step's plan to its device (pinned and non-blocking on
        CUDA; on CPU the host buffer is the device buffer)."""
        cuda = self.device.type == "cuda"
        host = torch.empty(max(self._size, 8), dtype=torch.uint8, pin_memory=cuda)
        raw = host.numpy()
        for offset, a in self._parts:
            raw[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        if self.device.type == "cpu":
            return DevicePlan(host)
        # The caching host allocator keeps a pinned block until the copy that reads it has
        # run on its stream, so the next step's plan never overwrites this one in flight.
        return DevicePlan(host.to(self.device, non_blocking=True))


class DevicePlan:
    """The uploaded buffer; ``plan[slot]`` is the array of ``slot`` as a device tensor."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data  # [nbytes] uint8 on the device

    def __getitem__(self, slot: Slot) -> torch.Tensor:
        raw = self.data[slot.offset:slot.offset + slot.nbytes]
        return raw.view(slot.dtype).view(slot.shape)


def download(t: torch.Tensor) -> np.ndarray:
    """The one copy of a step's results to the host: waits for the device to finish the
    step (the step's one sync)."""
    return t.detach().cpu().numpy()
