"""``pdkv frontend`` or ``pdkv serve`` as a child process (benchmarks and tests): start,
wait for the URL it prints, stop."""

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

_URL = re.compile(r"(https?://[0-9.]+:[0-9]+)/v1")


class ServerProcess:
    """``pdkv ARGS...`` serving HTTP; ``start`` returns the URL it prints.

    Args:
        args: the command line after ``pdkv`` (``serve --port 0 ...``).
        log: where its stderr goes (default: a temporary file).
    """

    def __init__(self, args: list[str], log: Path | None = None) -> None:
        self.argv = [sys.executable, "-m", "deploy.cli", *args]
        self.log = log or Path(tempfile.mkstemp(prefix="pdkv-frontend-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.ready_line = ""
        """The line that carried the URL (``pdkv serve`` names its router there)."""

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
            if sel.select(0.2) and (m := _URL.search(
                    line := self.proc.stdout.readline().decode())):
                self.url, self.ready_line = m.group(1), line.strip()
                return self.url
        self.stop()
        raise RuntimeError(f"pdkv {self.argv[3]} did not start within {timeout_s}s (exit "
                           f"{self.proc.returncode}); log {self.log}:\n"
                           f"{self.log.read_text()[-2000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
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


def frontend_process(router: str, *args: str, log: Path | None = None) -> ServerProcess:
    """A front door on 127.0.0.1 (a free port) in front of ``router``; ``args``: more
    ``pdkv frontend`` flags (``--api-key``, ``--max-waiting``...)."""
    return ServerProcess(["frontend", "--router", router, "--host", "127.0.0.1", "--port", "0",
                          *args], log)
