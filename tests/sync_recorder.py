"""Records every place where a step would make the host wait for the device.

On CPU nothing waits, so the recorder looks for what would wait on a GPU:

- at the dispatcher (``TorchDispatchMode``): ops whose result the host must read
  (``_local_scalar_dense``/``item``/``is_nonzero``: ``.item()``, ``int(t)``, ``if t``),
  ops whose output shape depends on data (``nonzero``, ``masked_select``, ``unique``,
  boolean indexing, ``repeat_interleave`` by a tensor), comparisons returning a Python
  bool (``equal``), and tensors made from host data (``lift_fresh``: ``torch.tensor``,
  ``torch.from_numpy``, ``as_tensor``), which on a GPU are copies in;
- at the Python API (``TorchFunctionMode``): ``tolist``, ``numpy``, ``cpu``, ``to`` a
  device, ``__bool__``/``__int__``/``__float__``/``__index__``, which are copies out.

The two transfers a step may make are the step's plan going up (``HostPlan.upload``) and
its results coming down (``common.model.plan.download``); what happens inside those two
functions is counted as one transfer per call, and anything anywhere else is a violation.
``sampling.exact_rows`` (CPU only: draws outside their nucleus drawn again) is counted
apart, as ``redraws``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from common.model import plan as plan_module
from common.model import sampling as sampling_module

_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select",
             "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "equal",
             "allclose", "lift_fresh", "lift_fresh_copy", "masked_scatter"}
_READS = {"tolist", "numpy", "cpu", "cuda", "__bool__", "__int__", "__float__", "__index__",
          "item"}
_TRANSFERS = {plan_module.HostPlan.upload.__code__: "upload",
              plan_module.download.__code__: "download",
              # CPU only: draws outside their nucleus drawn again, after the step's download
              sampling_module.exact_rows.__code__: "redraw"}


@dataclass
class SyncRecorder:
    """Collects violations and transfers while active (``with recorder:``)."""

    violations: list[str] = field(default_factory=list)
    transfers: dict[str, dict[int, object]] = field(
        default_factory=lambda: {"upload": {}, "download": {}, "redraw": {}})
    """Each transfer's frame by id (kept alive, so that no later call reuses its id)."""

    def __enter__(self) -> SyncRecorder:
        self._modes = [_Functions(self), _Dispatch(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    @property
    def uploads(self) -> int:
        return len(self.transfers["upload"])

    @property
    def downloads(self) -> int:
        return len(self.transfers["download"])

    @property
    def redraws(self) -> int:
        return len(self.transfers["redraw"])

    def note(self, what: str) -> None:
        """Counts ``what`` as part of a transfer, or records it as a violation."""
        frame = inspect.currentframe()
        caller, within = "", None
        while frame is not None:
            kind = _TRANSFERS.get(frame.f_code)
            if kind is not None and (within is None or kind == "redraw"):
                within = (kind, frame)  # a redraw's own upload and download are its
            name = frame.f_code.co_filename
            if not caller and "/torch/" not in name and name != __file__:
                caller = f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
            frame = frame.f_back
        if within is not None:
            self.transfers[within[0]][id(within[1])] = within[1]
        else:
            self.violations.append(f"{what} at {caller}")


class _Functions(TorchFunctionMode):
    def __init__(self, recorder: SyncRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS or (name == "to" and _names_device(args[1:], kwargs)):
            self.recorder.note(f"Tensor.{name}")
        return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, recorder: SyncRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self.recorder.note(f"aten.{name}")
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and \
                _bool_index(args):
            self.recorder.note(f"aten.{name} with a boolean index")
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and \
                len(args) > 1 and isinstance(args[1], torch.Tensor) and \
                kwargs.get("output_size") is None:
            self.recorder.note("aten.repeat_interleave by a tensor")
        return func(*args, **kwargs)


def _names_device(args, kwargs) -> bool:
    values = list(args) + list(kwargs.values())
    return any(isinstance(v, (torch.device, str)) for v in values)


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
               for i in (indices or ()) if i is not None)
