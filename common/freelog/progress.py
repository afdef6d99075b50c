"""A one-line progress bar on stderr (no dependency), for long offline jobs."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """A one-line progress bar on stderr, driven by a byte offset; redrawn at most 10x a second."""

    def __init__(self, label: str, total: int, stream=None, width: int = 30):
        self.label, self.total, self.width = label, max(total, 1), width
        self.stream = stream or sys.stderr
        self.t0 = self._drawn_at = time.perf_counter()

    def update(self, offset: int, events: int) -> None:
        now = time.perf_counter()
        if now - self._drawn_at < 0.1:
            return
        self._drawn_at = now
        frac = min(offset / self.total, 1.0)
        filled = int(frac * self.width)
        rate = events / max(now - self.t0, 1e-9)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}]"
                          f" {frac:4.0%} {events:,} events {rate / 1e3:,.0f}k ev/s ")
        self.stream.flush()

    def close(self) -> None:
        if self._drawn_at > self.t0:
            self.stream.write("\r" + " " * (self.width + 80) + "\r")
            self.stream.flush()
