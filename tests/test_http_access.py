"""The front door's lock (deploy/http/access.py), with real ``pdkv frontend`` processes on
loopback and real HTTP clients: beyond loopback it refuses to serve without an API key
and names the flag that allows it; the key comes from a file or ``$PDKV_API_KEY`` and
never shows in the process's arguments; ``/metrics`` is behind the key; TLS serves a real
TLS client against a certificate made here.

No router runs behind these front doors: a request that passed the key is answered 503
("the router is not answering"), one that did not 401, which tells the two apart."""

from __future__ import annotations

import argparse
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deploy.http.access import AccessError, access_from_args
from deploy.http.process import frontend_process
from tests.tp_helpers import free_port

pytestmark = pytest.mark.timeout(180)
KEY = "sk-from-a-secret"


def _pdkv(*args: str, env: dict | None = None, timeout: float = 60
          ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _nobody_router() -> str:
    return f"tcp://127.0.0.1:{free_port()}"   # nothing listens there


@pytest.mark.parametrize("command", [["frontend", "--router", "tcp://127.0.0.1:9"],
                                     ["serve"]])
def test_beyond_loopback_without_a_key_is_refused_naming_the_flag(command):
    env = {k: v for k, v in os.environ.items() if k != "PDKV_API_KEY"}
    r = _pdkv(*command, "--host", "0.0.0.0", "--port", "0", env=env)
    assert r.returncode == 2, r
    assert "without an API key" in r.stderr and "--allow-no-api-key" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    if command[0] == "serve":  # refused before anything started
        assert "ready" not in r.stdout


def _args(**kw) -> argparse.Namespace:
    base = dict(host="127.0.0.1", api_key=None, api_key_file=None, allow_no_api_key=False,
                ssl_certfile=None, ssl_keyfile=None)
    return argparse.Namespace(**{**base, **kw})


def test_the_lock_reads_its_key_from_a_file_or_the_environment(tmp_path):
    keyfile = tmp_path / "api-key"
    keyfile.write_text(KEY + "\n")  # a Secret file often ends in a newline
    assert access_from_args(_args(api_key_file=str(keyfile)), env={}).api_key == KEY
    assert access_from_args(_args(), env={"PDKV_API_KEY": KEY}).api_key == KEY
    assert access_from_args(_args(host="0.0.0.0"), env={"PDKV_API_KEY": KEY}).api_key == KEY
    assert access_from_args(_args(host="0.0.0.0", allow_no_api_key=True), env={}).api_key == ""
    with pytest.raises(AccessError, match="--allow-no-api-key"):
        access_from_args(_args(host="10.1.2.3"), env={})
    with pytest.raises(AccessError, match="not both"):
        access_from_args(_args(api_key="a", api_key_file=str(keyfile)), env={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AccessError, match="is empty"):
        access_from_args(_args(api_key_file=str(tmp_path / "empty")), env={})


@pytest.mark.parametrize("source", ["file", "env"])
def test_the_key_from_a_file_or_env_guards_v1_and_metrics_and_stays_off_argv(
        tmp_path, source, monkeypatch):
    extra: list[str] = []
    if source == "file":
        (tmp_path / "api-key").write_text(KEY + "\n")
        extra = ["--api-key-file", str(tmp_path / "api-key")]
        monkeypatch.delenv("PDKV_API_KEY", raising=False)
    else:
        monkeypatch.setenv("PDKV_API_KEY", KEY)
    proc = frontend_process(_nobody_router(), "--router-timeout-s", "1", *extra,
                            log=tmp_path / "fe.log")
    url = proc.start(120.0)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 401, path
            wrong = httpx.get(f"{url}{path}", headers={"Authorization": "Bearer nope"},
                              timeout=10)
            assert wrong.status_code == 401, path
            right = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"},
                              timeout=10)
            assert right.status_code == 503, (path, right.text)  # past the lock: no router
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # open, says little
    finally:
        proc.stop()


def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made now by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl binary is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_tls_serves_a_real_tls_client_and_refuses_a_bad_pair(tmp_path, monkeypatch):
    cert, key = _certificate(tmp_path)
    monkeypatch.setenv("PDKV_API_KEY", KEY)
    proc = frontend_process(_nobody_router(), "--router-timeout-s", "1", "--ssl-certfile",
                            str(cert), "--ssl-keyfile", str(key), log=tmp_path / "fe.log")
    url = proc.start(120.0)
    try:
        assert url.startswith("https://127.0.0.1:"), url
        trusted = ssl.create_default_context(cafile=str(cert))
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                      verify=trusted, timeout=10)
        assert r.status_code == 503 and r.http_version == "HTTP/1.1"  # TLS, then the app
        with pytest.raises(httpx.ConnectError):  # a client that does not trust it
            httpx.get(f"{url}/health", timeout=10)
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    finally:
        proc.stop()
    (tmp_path / "other").mkdir()
    _, other_key = _certificate(tmp_path / "other")  # a key that did not sign ``cert``
    bad = _pdkv("frontend", "--router", _nobody_router(), "--port", "0", "--ssl-certfile",
                str(cert), "--ssl-keyfile", str(other_key))
    assert bad.returncode == 2 and "not a certificate and its private key" in bad.stderr, bad
