"""The control plane: typed messages between clients, the router and workers, the one
msgpack codec they travel in, and the sockets that carry them (``Link``, ``Hub``)."""

from common.control.codec import Codec, DecodeError, pack_ids, unpack_ids
from common.control.link import ControlHub, ControlLink, Hub, Link, poll_for, wait_any
from common.control.messages import (
    CODEC,
    MAX_CONTROL_BYTES,
    Abort,
    Bye,
    Done,
    Drain,
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
    StepTokens,
    Stop,
    Submit,
    Tokens,
)

__all__ = ["Abort", "Bye", "CODEC", "Codec", "ControlHub", "ControlLink", "DecodeError", "Done",
           "Drain", "Error", "Hub", "Link", "Load", "MAX_CONTROL_BYTES", "Malformed", "Message",
           "MetricsQuery", "MetricsReport", "MetricsSnapshot", "Ping", "Pong", "Prefilled",
           "Ready", "Register", "Registered", "Req", "Scalar", "Shutdown", "Stats", "Status",
           "StatusReport", "StepTokens", "Stop", "Submit", "Tokens", "pack_ids",
           "poll_for", "unpack_ids", "wait_any"]
