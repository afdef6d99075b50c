"""Who may send what to the router (docs/security.md, "Roles on the control plane").

A sender's identity is the name its CURVE key has in the deployment's key directory
(ZAP ``User-Id``, never anything the sender writes); its role is that name up to the
first ``-``. Without keys every identity is '' and may send anything: such a router binds
only loopback, so only local processes of its user reach it.

The per-request rules (a worker only about requests it was given, a client only about
its own) are checked by the router's handlers, which know the requests.
"""

from __future__ import annotations

from common.auth import role_of
from common.control import (
    Abort,
    Done,
    Drain,
    Error,
    Load,
    Malformed,
    MetricsQuery,
    MetricsReport,
    Ping,
    Prefilled,
    Ready,
    Register,
    Shutdown,
    Stats,
    Status,
    StepTokens,
    Submit,
    Tokens,
)

_WORKER = ("worker",)
_CLIENT = ("client", "operator")
# A probe (``pdkv probe``, an orchestrator's readiness check) reads the deployment's
# status and nothing else: it runs where a worker runs, so it must not need the worker's
# rights, and whoever holds its key learns who is ready, never a prompt or a credential.
_READER = (*_CLIENT, "probe")
MAY_SEND: dict[type, tuple[str, ...]] = {
    Register: _WORKER, Ready: _WORKER, Load: _WORKER, Stats: _WORKER, Tokens: _WORKER,
    StepTokens: _WORKER,
    Done: _WORKER, Prefilled: _WORKER, Error: _WORKER, MetricsReport: _WORKER,
    Submit: _CLIENT, Abort: _CLIENT, Status: _READER, Ping: _READER, MetricsQuery: _CLIENT,
    Shutdown: ("operator",),
    Drain: ("operator", "worker"),   # a worker only itself (SIGTERM): the handler checks
    Malformed: ("worker", "client", "operator", "probe"),  # answered with its error only
}


def may_send(identity: str, kind: type) -> bool:
    """``identity`` (an identity name, '' without keys) may send a ``kind`` message."""
    if not identity:
        return True
    try:
        role = role_of(identity)
    except ValueError:
        return False
    return role in MAY_SEND.get(kind, ())


def is_operator(identity: str) -> bool:
    """An identity of role ``operator`` (no one is, without keys)."""
    return identity.split("-", 1)[0] == "operator"
