"""The KV memory core: paged pools, kv rows, ``free_kv_row``, pins."""

from common.kv.allocator import PageAllocator
from common.kv.copy_threads import CopyShare, copy_threads, offering, set_copy_threads
from common.kv.errors import OutOfPages, RangeError
from common.kv.layout import DTYPE_BYTES, KvLayout, dtype_of
from common.kv.pool_stats import PAGE_STATES, PoolStats
from common.kv.ranges import ceil_align, ceil_div
from common.kv.reasons import FreeReason
from common.kv.record import KvRecord
from common.kv.segments import deployment_tag, reclaim_orphans, segment_stem
from common.lazy import lazy_names

# the modules that import torch: read on first use (common/lazy.py)
__getattr__ = lazy_names(__name__, {
    "KvCache": "common.kv.cache",
    "DigestMismatch": "common.kv.digest", "RunDigest": "common.kv.digest",
    "digest_of_bytes": "common.kv.digest:of_bytes",
    "digest_of_pages": "common.kv.digest:of_pages",
    "digest_value": "common.kv.digest:value",
    "negotiate_digest": "common.kv.digest:negotiate",
    "preferred_digest": "common.kv.digest:preferred",
    "check_pages": "common.kv.page_copy", "copy_pages": "common.kv.page_copy",
    "copy_pages_fed": "common.kv.page_copy",
    "page_runs": "common.kv.page_copy",
    "SegmentError": "common.kv.shared_tensor", "SharedTensor": "common.kv.shared_tensor",
    "valid_segment_name": "common.kv.shared_tensor"})

__all__ = ["DTYPE_BYTES", "PAGE_STATES", "CopyShare", "FreeReason", "KvCache", "KvLayout",
           "KvRecord", "OutOfPages", "PageAllocator", "PoolStats", "RangeError",
           "SegmentError", "SharedTensor", "ceil_align", "ceil_div", "check_pages",
           "copy_pages", "copy_pages_fed", "copy_threads", "DigestMismatch", "RunDigest",
           "deployment_tag",
           "digest_of_bytes", "digest_of_pages", "digest_value", "negotiate_digest",
           "preferred_digest", "dtype_of", "offering", "page_runs", "reclaim_orphans",
           "segment_stem", "set_copy_threads", "valid_segment_name"]
