"""The KV memory core: paged pools, kv rows, ``free_kv_row``, pins."""

from common.kv.allocator import PageAllocator
from common.kv.cache import KvCache
from common.kv.copy_threads import CopyShare, copy_threads, offering, set_copy_threads
from common.kv.errors import OutOfPages, RangeError
from common.kv.layout import KvLayout
from common.kv.page_copy import check_pages, copy_pages, page_runs
from common.kv.pool_stats import PAGE_STATES, PoolStats
from common.kv.ranges import ceil_align, ceil_div
from common.kv.reasons import FreeReason
from common.kv.record import KvRecord
from common.kv.shared_tensor import SegmentError, SharedTensor, valid_segment_name

__all__ = ["PAGE_STATES", "CopyShare", "FreeReason", "KvCache", "KvLayout", "KvRecord",
           "OutOfPages", "PageAllocator", "PoolStats", "RangeError", "SegmentError",
           "SharedTensor", "ceil_align", "ceil_div", "check_pages", "copy_pages",
           "copy_threads", "offering", "page_runs", "set_copy_threads", "valid_segment_name"]
