"""What every worker process shares: the control plane to the router and the worker shell."""

from common.node.control import Hub, Link, decode, encode, pack_ids, unpack_ids, wait_any
from common.node.worker_base import RouterLost, WorkerBase, setup_process

__all__ = ["Hub", "Link", "RouterLost", "WorkerBase", "decode", "encode", "pack_ids",
           "setup_process", "unpack_ids", "wait_any"]
