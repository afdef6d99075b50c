"""pdkv common: the ground floor every other package stands on.

Wings, each with its own face: ``common.kv`` (memory core), ``common.freelog`` (recording
and replay), ``common.model``, ``common.host`` (host tier), ``common.node`` (worker
process shell and control plane), ``common.parallel`` (tensor-parallel groups);
``common.request`` and ``common.config`` at the top.
"""

from common.kv import FreeReason, KvLayout, KvRecord, OutOfPages, RangeError, ceil_align
from common.lazy import lazy_names
from common.request import BadRequest, ReqState, SamplingParams

__getattr__ = lazy_names(__name__, {"KvCache": "common.kv.cache"})  # torch: on first use

__all__ = ["BadRequest", "FreeReason", "KvCache", "KvLayout", "KvRecord", "OutOfPages",
           "RangeError", "ReqState", "SamplingParams", "ceil_align"]
