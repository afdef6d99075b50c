"""Tensor parallelism as one wing: rank 0 records each stateful part and a follower
replays it beside it (cache.py: the KV pool; host.py: the host tier and its copies;
mirror.py: the passes and the follower's step), over the lockstep's steps (lockstep.py);
endpoints.py builds each rank's KV endpoint, worker.py rank 0's group and a follower's
process, metrics.py a follower's figures for rank 0."""

from common.lazy import lazy_names

# every module here imports torch: read on first use (common/lazy.py)
__getattr__ = lazy_names(__name__, {
    **dict.fromkeys(["TAG_CONFIG", "TAG_STEP", "Lockstep", "RankReport", "TpKvOp",
                     "read_step"], "common.node.tp.lockstep"),
    **dict.fromkeys(["CacheMirror", "LeaderKvCache", "RankPins"], "common.node.tp.cache"),
    **dict.fromkeys(["LeaderRunner", "Mirror"], "common.node.tp.mirror"),
    **dict.fromkeys(["HostMirror", "LeaderHostTier", "LockstepCopies", "follower_host"],
                    "common.node.tp.host"),
    **dict.fromkeys(["follower_endpoint", "kv_config"], "common.node.tp.endpoints"),
    **dict.fromkeys(["TpLeader", "TpSpec", "check_draft_split", "leader_cache",
                     "run_follower"], "common.node.tp.worker"),
    **dict.fromkeys(["RankMetrics", "rank_stats"], "common.node.tp.metrics")})

__all__ = ["CacheMirror", "HostMirror", "LeaderHostTier", "LeaderKvCache", "LeaderRunner",
           "Lockstep", "LockstepCopies", "Mirror", "RankMetrics", "RankPins", "RankReport",
           "TAG_CONFIG", "TAG_STEP", "TpKvOp", "TpLeader", "TpSpec", "check_draft_split",
           "follower_endpoint", "follower_host", "kv_config", "leader_cache", "rank_stats",
           "read_step", "run_follower"]
