"""Building a worker's host tier from the serving config.

Shared by the prefill, decode and colocated workers so that every worker keys its prefix
cache the same way (``host_salt``) and writes its host pool's free log next to the
device pool's (``<log_dir>/<name>.host.freelog``, replayed by ``pdkv run``). Rank 0 of a
tensor-parallel group gets a host tier and copy engine that its followers repeat, and
``common.node.tp.host.follower_host`` builds a follower's.

Who frees what: the returned ``Offloader`` never frees device pages (the worker does);
its host pages belong to the prefix cache. The worker calls ``close_offloader`` at
shutdown, after its rows are freed and before it closes its device pool, so copies in
flight end (pins drop) before either free log is closed.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from common.config import ServeConfig
from common.freelog import freelog_file
from common.host import CopyEngine, HostTier, Offloader
from common.kv import KvCache, copy_pages
from common.node.tp import LeaderHostTier, LockstepCopies

logger = logging.getLogger(__name__)




def host_salt(cfg: ServeConfig, cache: KvCache) -> bytes:
    """Mixed into every hash chain: the model, its dtype and the KV layout, so a host
    tier never matches KV of another model or layout."""
    return f"{cfg.model}|{cfg.dtype}|{cache.layout}".encode()


def make_offloader(cfg: ServeConfig, cache: KvCache, device: str, log_dir: str | None,
                   name: str) -> Offloader | None:
    """The worker's host tier and offloader, or None when ``cfg.offload`` is off."""
    if not cfg.offload:
        return None
    lockstep = getattr(cache, "lockstep", None)  # rank 0 of a TP group (LeaderKvCache)
    tier = HostTier if lockstep is None else partial(LeaderHostTier, lockstep=lockstep)
    host = tier(cfg.host_pool_pages(), cache.page_size, cache.layout, device=device,
                log_path=freelog_file(log_dir, f"{name}.host"), node=name)
    engine = _SlowCopyEngine(device, cfg.debug_copy_delay_s) if cfg.debug_copy_delay_s \
        else CopyEngine(device)
    if lockstep is not None:
        engine = LockstepCopies(engine, lockstep, host)
    return Offloader(cache, host, engine=engine)



def close_offloader(off: Offloader | None, timeout_s: float) -> None:
    """Wait for copies in flight (their pins), stop the copy engine, close the host log."""
    if off is None:
        return
    if not off.close(timeout_s):
        logger.error("host copies still running after %.1f s at shutdown", timeout_s)
    off.host.close()


class _SlowCopyEngine(CopyEngine):
    """``CopyEngine`` whose CPU copies each start ``delay_s`` late (tests only)."""

    steal = False  # a waiter must not run a delayed copy early

    def __init__(self, device: str, delay_s: float) -> None:
        self.delay_s = delay_s
        super().__init__(device)

    def _copy(self, src, src_pages, dst, dst_pages) -> None:
        time.sleep(self.delay_s)
        copy_pages(src, src_pages, dst, dst_pages)
