"""The host tier: its pool, the copy engine, the prefix cache and two-phase offload."""

from common.host.offload import LoadHandle, Offloader
from common.host.prefix_cache import HashChain, PrefixCache, prefix_len
from common.host.setup import close_offloader, host_salt, make_offloader
from common.host.tier import CACHE_OWNER, CopyEngine, CopyJob, HostTier

__all__ = ["CACHE_OWNER", "CopyEngine", "CopyJob", "HashChain", "HostTier", "LoadHandle",
           "Offloader", "PrefixCache", "close_offloader", "host_salt", "make_offloader",
           "prefix_len"]
