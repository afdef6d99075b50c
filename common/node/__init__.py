"""The worker runtime every worker process shares: registration with the router, the
worker shell (build, loop, heartbeats, shutdown), its metrics, its host tier, prefix
reuse, chunked prefill and KV events; tensor parallelism is the ``tp`` wing inside it."""

from common.lazy import lazy_names
from common.node.events import EventsSpec, WorkerEvents, state_digest
from common.node.registration import RouterLost

# the modules that import torch: read on first use (common/lazy.py)
__getattr__ = lazy_names(__name__, {
    **dict.fromkeys(["FreeLogFailed", "WorkerBase", "setup_process"], "common.node.worker_base"),
    **dict.fromkeys(["close_offloader", "host_salt", "make_offloader"], "common.node.host_setup"),
    **dict.fromkeys(["PrefixLoadTimeout", "PrefixReuse"], "common.node.prefix_reuse"),
    "PrefillEngine": "common.node.prefill_engine",
    "install_stop_signals": "common.node.stop_signals:install"})

__all__ = ["EventsSpec", "FreeLogFailed", "PrefillEngine", "PrefixLoadTimeout", "PrefixReuse",
           "RouterLost", "WorkerBase", "WorkerEvents", "close_offloader", "host_salt",
           "install_stop_signals", "make_offloader", "setup_process", "state_digest"]
