"""The host tier: its pool, the copy engine, the prefix cache, two-phase offload and the
one prefix reuse of prefill, decode and colocated workers, and the host tier of each rank
of a tensor-parallel group."""

from common.host.offload import LoadHandle, Offloader
from common.host.prefix_cache import HashChain, PrefixCache, prefix_len
from common.host.prefix_reuse import PrefixLoadTimeout, PrefixReuse
from common.host.setup import close_offloader, follower_host, host_salt, make_offloader
from common.host.tier import CACHE_OWNER, CopyEngine, CopyJob, HostTier
from common.host.tp import HostMirror, LeaderHostTier, LockstepCopies

__all__ = ["CACHE_OWNER", "CopyEngine", "CopyJob", "HashChain", "HostMirror", "HostTier",
           "LeaderHostTier", "LoadHandle", "LockstepCopies", "Offloader", "PrefixCache",
           "PrefixLoadTimeout", "PrefixReuse", "close_offloader", "follower_host", "host_salt",
           "make_offloader", "prefix_len"]
