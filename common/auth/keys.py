"""A deployment's key directory: CURVE key pairs per identity and the deployment id.

``pdkv keys create DIR`` writes one directory per deployment::

    DIR/                      0700
      deployment.json         {"format": "pdkv-keys", "version": 1, "deployment_id": ...}
      router.key              public certificates (pyzmq's format), one per identity
      router.key_secret       0600: the matching secret, only on the hosts that need it
      worker.key  worker.key_secret
      operator.key  operator.key_secret
      client.key  client.key_secret  (client-NAME.key ... for more clients)
      probe.key  probe.key_secret    (readiness checks: may only ask the router's status)

An identity's role is its name up to the first ``-``: ``router``, ``worker``, ``client``,
``operator`` or ``probe`` (``client-alice`` is a client, ``worker-host3`` a worker). The router
accepts exactly the public keys it finds here and knows each peer by its identity name
(ZAP's User-Id). A host needs ``deployment.json``, the public key of the router and the
key pair of the identity it runs as (``pdkv keys export``); nothing else. Key pairs are
made by libzmq (``zmq.curve_keypair``), never here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

KEYS_FORMAT = "pdkv-keys"
KEYS_VERSION = 1
ROLES = ("router", "worker", "client", "operator", "probe")
_NAME = re.compile(r"^(router|worker|client|operator|probe)(-[A-Za-z0-9_.]{1,64})?$")


class KeysError(RuntimeError):
    """A key directory is missing, malformed, too open, or lacks an identity's secret."""


def role_of(name: str) -> str:
    """``client-alice`` -> ``client``; raises ``ValueError`` for a name of no role."""
    if not _NAME.match(name):
        raise ValueError(f"identity name {name!r}: must be one of {ROLES}, optionally "
                         "followed by -NAME (letters, digits, _ and .)")
    return name.split("-", 1)[0]


@dataclass(frozen=True)
class KeyPair:
    """One CURVE identity: z85 public key, z85 secret key (empty when not on this host)."""

    name: str
    public: bytes
    secret: bytes = b""


def create(directory: str | Path, clients: list[str] | None = None) -> str:
    """A new deployment's key directory; returns its deployment id.

    Raises:
        KeysError: ``directory`` exists and is not empty (keys are never overwritten).
    """
    path = Path(directory)
    if path.exists() and any(path.iterdir()):
        raise KeysError(f"{path} exists and is not empty; keys are never overwritten "
                        "(choose a new directory, or remove the old one yourself)")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    deployment_id = secrets.token_hex(16)
    (path / "deployment.json").write_text(json.dumps({
        "format": KEYS_FORMAT, "version": KEYS_VERSION, "deployment_id": deployment_id,
        "created_unix": int(time.time())}) + "\n")
    for name in ("router", "worker", "operator", "probe", *(clients or ["client"])):
        add(path, name)
    return deployment_id


def add(directory: str | Path, name: str) -> KeyPair:
    """Add identity ``name`` (its role from the name) to an existing key directory."""
    role_of(name)
    path = Path(directory)
    _load_meta(path)
    if (path / f"{name}.key").exists():
        raise KeysError(f"{path}: identity {name!r} exists already")
    # the directory is 0700, so the secret is never readable by others, even before chmod
    public_file, secret_file = zmq.auth.create_certificates(path, name)
    os.chmod(secret_file, 0o600)
    os.chmod(public_file, 0o644)
    return load_pair(path, name)


def export(directory: str | Path, names: list[str], out: str | Path) -> None:
    """Copy what a host running ``names`` needs: deployment.json, every public key (the
    router needs them to admit peers; others need the router's), and only the secrets of
    ``names``."""
    src, dst = Path(directory), Path(out)
    _load_meta(src)
    for name in names:
        load_pair(src, name, need_secret=True)
    if dst.exists() and any(dst.iterdir()):
        raise KeysError(f"{dst} exists and is not empty")
    dst.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(dst, 0o700)
    shutil.copy2(src / "deployment.json", dst / "deployment.json")
    for public in src.glob("*.key"):
        shutil.copy2(public, dst / public.name)
    for name in names:
        shutil.copy2(src / f"{name}.key_secret", dst / f"{name}.key_secret")
        os.chmod(dst / f"{name}.key_secret", 0o600)


class Keys:
    """A loaded key directory (read-only)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        meta = _load_meta(self.directory)
        self.deployment_id: str = meta["deployment_id"]

    def pair(self, name: str) -> KeyPair:
        """``name``'s key pair, with its secret (``KeysError`` if absent or too open)."""
        return load_pair(self.directory, name, need_secret=True)

    def public(self, name: str) -> bytes:
        return load_pair(self.directory, name).public

    def principals(self) -> dict[bytes, str]:
        """Every public key here -> its identity name (what the router admits)."""
        out = {}
        for public in sorted(self.directory.glob("*.key")):
            name = public.name[:-len(".key")]
            try:
                role_of(name)
            except ValueError:
                continue  # a stray certificate is no identity of this deployment
            out[load_pair(self.directory, name).public] = name
        return out

    def names(self) -> list[str]:
        return sorted(self.principals().values())


def load_pair(directory: Path, name: str, need_secret: bool = False) -> KeyPair:
    role_of(name)
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    if need_secret:
        if not secret_file.exists():
            raise KeysError(f"{directory} has no secret key for {name!r} "
                            f"({secret_file.name}); copy it from the deployment's key "
                            f"directory (pdkv keys export DIR --for {name} OUT)")
        _check_private(secret_file)
        public, secret = zmq.auth.load_certificate(secret_file)
        return KeyPair(name, public, secret or b"")
    if not public_file.exists():
        raise KeysError(f"{directory} has no identity {name!r} ({public_file.name}); "
                        f"known: {sorted(p.stem for p in directory.glob('*.key'))}")
    public, _ = zmq.auth.load_certificate(public_file)
    return KeyPair(name, public)


def _check_private(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise KeysError(f"{path} is readable by others (mode {mode:o}); "
                        f"run: chmod 600 {path}")


def _load_meta(path: Path) -> dict:
    meta_file = path / "deployment.json"
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise KeysError(f"{path} is not a pdkv key directory (no deployment.json); "
                        "create one with: pdkv keys create DIR") from None
    except (OSError, ValueError) as exc:
        raise KeysError(f"{meta_file}: unreadable ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != KEYS_FORMAT or \
            meta.get("version") != KEYS_VERSION or \
            not isinstance(meta.get("deployment_id"), str):
        raise KeysError(f"{meta_file}: not a version-{KEYS_VERSION} {KEYS_FORMAT} file")
    return meta
