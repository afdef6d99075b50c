"""How pdkv's sockets prove who is on the other end: a deployment's key directory (keys.py)
and CURVE/PLAIN authentication of each plane, with the loopback rule for sockets that have
none (planes.py)."""

from common.auth.handoff import SecretOffer, fetch_secret
from common.auth.keys import Keys, KeysError, role_of
from common.auth.keys import add as add_key
from common.auth.keys import create as create_keys
from common.auth.keys import export as export_keys
from common.auth.planes import (
    CONTROL_DOMAIN,
    EVENTS_DOMAIN,
    INSECURE,
    KV_DOMAIN,
    InsecureBind,
    PlaneAuth,
    ServerGuard,
    check_bind,
    control_client,
    control_server,
    events_client,
    events_server,
    handshake_check,
    kv_plane,
    new_kv_plane,
    principal,
)

__all__ = ["CONTROL_DOMAIN", "EVENTS_DOMAIN", "INSECURE", "InsecureBind", "KV_DOMAIN", "Keys",
           "KeysError", "PlaneAuth", "SecretOffer", "ServerGuard", "add_key", "check_bind",
           "control_client", "control_server", "create_keys", "events_client",
           "events_server", "export_keys", "fetch_secret", "handshake_check", "kv_plane",
           "new_kv_plane", "principal", "role_of"]
