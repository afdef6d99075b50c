"""What every worker process shares: the control messages, their sockets, the worker shell."""

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
from common.node.link import Hub, Link, wait_any
from common.node.worker_base import RouterLost, WorkerBase, setup_process

__all__ = ["CODEC", "MAX_CONTROL_BYTES", "Abort", "Bye", "Done", "Error", "Hub", "Link",
           "Load", "Malformed", "Message", "Ping", "Pong", "Prefilled", "Ready", "Register",
           "Registered", "Req", "RouterLost", "Scalar", "Shutdown", "Stats", "Status",
           "StatusReport", "Submit", "Tokens", "WorkerBase", "setup_process", "wait_any"]
