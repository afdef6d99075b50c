"""What every worker process shares: the control plane to the router, the worker shell,
and how sockets authenticate (keys.py: a deployment's key directory; auth.py: CURVE/ZAP)."""

from common.node.auth import (
    INSECURE,
    InsecureBind,
    PlaneAuth,
    ServerGuard,
    check_bind,
    control_client,
    control_server,
    new_kv_plane,
    principal,
)
from common.node.control import Hub, Link, decode, encode, pack_ids, unpack_ids, wait_any
from common.node.keys import Keys, KeysError, role_of
from common.node.worker_base import RouterLost, WorkerBase, setup_process

__all__ = ["INSECURE", "Hub", "InsecureBind", "Keys", "KeysError", "Link", "PlaneAuth",
           "RouterLost", "ServerGuard", "WorkerBase", "check_bind", "control_client",
           "control_server", "decode", "encode", "new_kv_plane", "pack_ids", "principal",
           "role_of", "setup_process", "unpack_ids", "wait_any"]
