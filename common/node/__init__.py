"""What every worker process shares: the control messages and their sockets, the worker
shell, and how sockets authenticate (keys.py: a deployment's key directory; auth.py:
CURVE/ZAP)."""

from common.lazy import lazy_names
from common.node.auth import (
    CONTROL_DOMAIN,
    INSECURE,
    KV_DOMAIN,
    InsecureBind,
    PlaneAuth,
    ServerGuard,
    check_bind,
    control_client,
    control_server,
    kv_plane,
    new_kv_plane,
    principal,
)
from common.node.control import (
    CODEC,
    MAX_CONTROL_BYTES,
    Abort,
    Bye,
    Done,
    Error,
    Load,
    Malformed,
    Message,
    MetricsQuery,
    MetricsReport,
    MetricsSnapshot,
    Ping,
    Pong,
    Prefilled,
    Ready,
    Register,
    Registered,
    Req,
    Scalar,
    Shutdown,
    Stats,
    Status,
    StatusReport,
    Submit,
    Tokens,
)
from common.node.keys import Keys, KeysError, role_of
from common.node.keys import add as add_key
from common.node.keys import create as create_keys
from common.node.keys import export as export_keys
from common.node.link import ControlHub, ControlLink, Hub, Link, poll_for, wait_any
from common.node.registration import RouterLost

# the modules that import torch: read on first use (common/lazy.py)
__getattr__ = lazy_names(__name__, {
    **dict.fromkeys(["RankSetup", "TpSpec", "run_follower"], "common.node.tp_worker"),
    **dict.fromkeys(["FreeLogFailed", "WorkerBase", "setup_process"], "common.node.worker_base")})

__all__ = ["Abort", "Bye", "CODEC", "CONTROL_DOMAIN", "ControlHub", "ControlLink", "Done",
           "Error", "FreeLogFailed", "Hub", "INSECURE", "InsecureBind", "KV_DOMAIN", "Keys",
           "KeysError", "Link", "Load", "MAX_CONTROL_BYTES", "Malformed", "Message",
           "MetricsQuery", "MetricsReport", "MetricsSnapshot", "Ping", "PlaneAuth", "Pong",
           "Prefilled", "RankSetup", "Ready", "Register", "Registered", "Req", "RouterLost",
           "Scalar", "ServerGuard", "Shutdown", "Stats", "Status", "StatusReport", "Submit",
           "Tokens", "TpSpec", "WorkerBase", "add_key", "check_bind", "control_client",
           "control_server", "create_keys", "export_keys", "kv_plane", "new_kv_plane",
           "poll_for", "principal", "role_of", "run_follower", "setup_process", "wait_any"]
