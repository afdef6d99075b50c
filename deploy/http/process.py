"""``pdkv frontend`` as a child process (benchmarks and tests): start, URL, stop."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_URL = re.compile(r"(http://[0-9.]+:[0-9]+)/v1")


class FrontendProcess:
    """A front door on 127.0.0.1 (a free port) in front of ``router``.

    Args:
        router: the router's address.
        args: more ``pdkv frontend`` flags (``--api-key``, ``--max-waiting``...).
        log: where its stderr goes (default: a temporary file).
    """

    def __init__(self, router: str, *args: str, log: Path | None = None) -> None:
        self.argv = [sys.executable, "-m", "deploy.cli", "frontend", "--router", router,
                     "--host", "127.0.0.1", "--port", "0", *args]
        self.log = log or Path(tempfile.mkstemp(prefix="pdkv-frontend-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float = 60.0) -> str:
        """Start and wait until it prints its URL; raises ``RuntimeError`` with its log
        otherwise."""
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=err,
                                         stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if sel.select(0.2) and (m := _URL.search(self.proc.stdout.readline().decode())):
                self.url = m.group(1)
                return self.url
        self.stop()
        raise RuntimeError(f"pdkv frontend did not start within {timeout_s}s (exit "
                           f"{self.proc.returncode}); log {self.log}:\n"
                           f"{self.log.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """Signal it, wait, SIGKILL past the deadline; its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
