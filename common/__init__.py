"""pdkv common: the ground floor every other package stands on.

Wings, each with its own face: ``common.kv`` (memory core), ``common.freelog`` (recording
and replay), ``common.model``, ``common.host`` (host tier), ``common.node`` (worker
process shell and control plane), ``common.parallel`` (tensor-parallel groups);
``common.request`` and ``common.config`` at the top.
"""

from common.kv import FreeReason, KvCache, KvLayout, KvRecord, OutOfPages, RangeError, ceil_align
from common.request import BadRequest, ReqState, SamplingParams

__all__ = ["BadRequest", "FreeReason", "KvCache", "KvLayout", "KvRecord", "OutOfPages",
           "RangeError", "ReqState", "SamplingParams", "ceil_align"]
