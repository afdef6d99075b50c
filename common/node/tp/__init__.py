"""Tensor parallelism as one wing: rank 0 records each stateful part (lockstep.py: its KV
cache and runner; host.py: its host tier and copies), each follower replays it beside
(mirror.py, host.py), and worker.py runs a follower rank; metrics.py carries a
follower's figures to rank 0."""

from common.lazy import lazy_names

# every module here imports torch: read on first use (common/lazy.py)
__getattr__ = lazy_names(__name__, {
    **dict.fromkeys(["TAG_CONFIG", "TAG_STEP", "LeaderKvCache", "LeaderRunner", "Lockstep",
                     "RankPins", "RankReport", "TpKvOp"], "common.node.tp.lockstep"),
    **dict.fromkeys(["HostOps", "Mirror", "RankTransfer"], "common.node.tp.mirror"),
    **dict.fromkeys(["HostMirror", "LeaderHostTier", "LockstepCopies", "follower_host"],
                    "common.node.tp.host"),
    **dict.fromkeys(["RankSetup", "TpSpec", "check_draft_split", "leader_cache",
                     "run_follower"], "common.node.tp.worker"),
    **dict.fromkeys(["RankMetrics", "rank_stats"], "common.node.tp.metrics")})

__all__ = ["HostMirror", "HostOps", "LeaderHostTier", "LeaderKvCache", "LeaderRunner",
           "Lockstep", "LockstepCopies", "Mirror", "RankMetrics", "RankPins", "RankReport",
           "RankSetup", "RankTransfer", "TAG_CONFIG", "TAG_STEP", "TpKvOp", "TpSpec",
           "check_draft_split", "follower_host", "leader_cache", "rank_stats", "run_follower"]
