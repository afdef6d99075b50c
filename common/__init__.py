"""pdkv common: the KV memory core shared by prefill and decode workers."""

from common.errors import OutOfPages, RangeError
from common.kv_cache import KvCache
from common.kv_record import KvRecord
from common.layout import KvLayout
from common.ranges import ceil_align

__all__ = ["KvCache", "KvLayout", "KvRecord", "OutOfPages", "RangeError", "ceil_align"]
