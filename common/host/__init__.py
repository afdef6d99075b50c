"""The host tier: its pool and copy engine, the hash-chained prefix cache, and two-phase
offload of committed pages."""

from common.host.chain import HashChain, chain_keys, prefix_len, root_key
from common.lazy import lazy_names

# the modules that import torch: read on first use (common/lazy.py); the router hashes
# prompts with HashChain and must not pay for torch
__getattr__ = lazy_names(__name__, {
    **dict.fromkeys(["LoadHandle", "Offloader"], "common.host.offload"),
    **dict.fromkeys(["CacheListener", "PrefixCache"], "common.host.prefix_cache"),
    **dict.fromkeys(["CACHE_OWNER", "CopyEngine", "CopyJob", "HostTier"], "common.host.tier")})

__all__ = ["CACHE_OWNER", "CacheListener", "CopyEngine", "CopyJob", "HashChain", "HostTier",
           "LoadHandle", "Offloader", "PrefixCache", "chain_keys", "prefix_len", "root_key"]
