"""A worker's registration with the router, with its deadline and its words."""

from __future__ import annotations

import logging
import os
import time

from common.control import ControlLink, Error, Register, Registered

logger = logging.getLogger(__name__)


class RouterLost(RuntimeError):
    """The router went silent past the lease or never answered the registration."""


def register(link: ControlLink, role: str, name: str, address: str, timeout_s: float,
             deployment: str = "") -> Registered:
    """Register until the router answers (its config, deployment id and KV-plane
    credentials) or ``timeout_s`` passes. ``deployment``: the id of our key directory
    ('' without keys); a router of another deployment is refused.

    The DEALER holds the message until a router binds; it is sent again now and then (the
    router answers a repeated ``Register`` of a worker not yet ready with the same
    ``Registered``). A name still held by our previous incarnation (``name_taken``) is
    asked for again shortly: the router releases it once the old process is gone.

    Raises:
        RouterLost: no answer in time (the message names the address).
        RuntimeError: the router refused the registration (the message says why), or it
            serves another deployment.
    """
    where = address or "the router"
    logger.info("%s: registering with the router at %s (up to %.0f s)", name, where,
                timeout_s)
    start = time.monotonic()
    next_try = next_note = start
    while (now := time.monotonic()) < start + timeout_s:
        if now >= next_try:
            link.send(Register(role, name, os.getpid(), deployment))
            next_try = now + 10.0
        if now >= next_note + 10.0:
            next_note = now
            logger.warning("%s: no answer from the router at %s yet (%.0f s of %.0f s)",
                           name, where, now - start, timeout_s)
        msg = link.recv(0.2)
        if isinstance(msg, Registered):
            check_deployment(name, msg, deployment)
            return msg
        if isinstance(msg, Error) and msg.code == "name_taken":
            logger.warning("%s: %s", name, msg.error)
            next_try = min(next_try, now + 1.0)
        elif isinstance(msg, Error):
            raise RuntimeError(f"{name}: router refused registration: {msg.error}")
    keys = (" (with keys, a router whose --auth-keys lack ours never completes the "
            "handshake: use the key directory of its deployment)") if deployment else ""
    raise RouterLost(f"{name}: no router answered at {where} within {timeout_s:.0f} s; "
                     "start `pdkv router --bind ...` there, or pass the address it binds "
                     f"(--router){keys}")


def check_deployment(name: str, msg: Registered, deployment: str) -> None:
    """CURVE proved the router holds our deployment's router key; its id must match too.

    Raises:
        RuntimeError: the router serves another deployment (or runs without keys).
    """
    if msg.deployment != deployment:
        raise RuntimeError(f"{name}: the router serves deployment {msg.deployment!r}, "
                           f"ours is {deployment!r}")
