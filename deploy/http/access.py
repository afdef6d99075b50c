"""Who may reach the HTTP front door, and how: its API key, where it may listen, TLS.

The front door is the one plane that faces users, so it is locked unless told otherwise:

- Listening anywhere but loopback needs an API key; ``--allow-no-api-key`` is the one way
  to serve the API open there, and it is named in the refusal.
- The key comes from ``--api-key-file FILE`` or ``$PDKV_API_KEY``; ``--api-key KEY``
  still works, but any local user reads a process's arguments in ``/proc``.
- With ``--ssl-certfile``/``--ssl-keyfile`` the front door speaks HTTPS (uvicorn's TLS);
  the pair is loaded here first, so a wrong path or a key that does not match its
  certificate fails before any worker starts.

docs/security.md, "The HTTP front door", says what each setting guarantees.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "PDKV_API_KEY"


class AccessError(ValueError):
    """A front-door setting that cannot serve as given (one line, names the flag)."""


@dataclass(frozen=True)
class Access:
    """The front door's lock: the API key ('' open), TLS files ('' plain HTTP)."""

    api_key: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.ssl_certfile)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"


def access_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> Access:
    """The lock ``pdkv serve``/``pdkv frontend`` were asked for, checked.

    Raises:
        AccessError: two sources of the key, an unreadable or empty key file, a TLS file
            missing or not matching, or a listen address beyond loopback without a key
            (and without ``--allow-no-api-key``).
    """
    env = os.environ if env is None else env
    key = _api_key(getattr(args, "api_key", None), getattr(args, "api_key_file", None),
                   env.get(API_KEY_ENV))
    access = Access(key, *_tls_files(getattr(args, "ssl_certfile", None),
                                     getattr(args, "ssl_keyfile", None)))
    check_listen(args.host, access, getattr(args, "allow_no_api_key", False))
    return access


def _api_key(flag: str | None, path: str | None, from_env: str | None) -> str:
    given = [name for name, v in (("--api-key", flag), ("--api-key-file", path)) if v]
    if len(given) > 1:
        raise AccessError("give the API key once: --api-key-file FILE (or $PDKV_API_KEY), "
                          "not both --api-key and --api-key-file")
    if path:
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise AccessError(f"--api-key-file {path}: cannot read it ({exc.strerror})"
                              ) from None
        if not key:
            raise AccessError(f"--api-key-file {path} is empty")
        return key
    if flag is not None:
        if not flag.strip():
            raise AccessError("--api-key is empty")
        return flag.strip()
    return (from_env or "").strip()


def _tls_files(certfile: str | None, keyfile: str | None) -> tuple[str, str]:
    if not certfile and not keyfile:
        return "", ""
    if not certfile:
        raise AccessError("--ssl-keyfile needs --ssl-certfile (the certificate it signs)")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:  # what uvicorn will load: a bad pair fails here, before any process starts
        ctx.load_cert_chain(certfile, keyfile or None)
    except FileNotFoundError as exc:
        raise AccessError(f"--ssl-certfile/--ssl-keyfile: {exc.filename}: no such file"
                          ) from None
    except (ssl.SSLError, OSError) as exc:
        raise AccessError(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile or '(none)'}"
                          f": not a certificate and its private key ({exc})") from None
    return certfile, keyfile or ""


def check_listen(host: str, access: Access, allow_open: bool = False) -> None:
    """Refuse to serve the API open beyond loopback.

    Raises:
        AccessError: ``host`` is reachable from other hosts, there is no API key, and
            ``allow_open`` was not given.
    """
    if access.api_key or allow_open or is_loopback(host):
        return
    raise AccessError(
        f"refusing to serve the OpenAI API on {host} without an API key: anyone who "
        f"reaches that address could use the deployment. Give the key with --api-key-file "
        f"FILE or ${API_KEY_ENV}, listen on 127.0.0.1, or pass --allow-no-api-key to "
        "serve it open")


def is_loopback(host: str) -> bool:
    """``host`` is provably this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # 0.0.0.0 parses; a host name or '' does not: not provably local
        return False
