"""The host tier: its pool and copy engine, the hash-chained prefix cache, and two-phase
offload of committed pages."""

from common.host.offload import LoadHandle, Offloader
from common.host.prefix_cache import HashChain, PrefixCache, prefix_len
from common.host.tier import CACHE_OWNER, CopyEngine, CopyJob, HostTier

__all__ = ["CACHE_OWNER", "CopyEngine", "CopyJob", "HashChain", "HostTier", "LoadHandle",
           "Offloader", "PrefixCache", "prefix_len"]
