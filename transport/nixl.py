"""NIXL data path, the shared parts: importing NIXL, one agent per endpoint, the registered
pool and the descriptors of a page run (docs/protocol.md, "NIXL").

The decode registers its KV pool with its agent and offers the agent's metadata and the
pool's place in its ``Hello``; a prefill that also speaks NIXL loads that metadata and,
from then on, WRITEs each run of blocks straight into the decode's destination pages
with a notification (the run's ``KvWritten``, msgpack) that the decode counts
(``nixl_channel.NixlChannel`` on the prefill, ``nixl_target.NixlTarget`` on the decode).
Control (the decode's Register; Abort, AbortAck, heartbeats on failure paths and per
peer) stays on ZMQ; a write's notification is its completion.

Memory is registered as DRAM for a CPU pool and VRAM for a CUDA pool (device id from the
tensor); only DRAM is exercised by the tests.
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from common.kv import DTYPE_BYTES, KvLayout, page_runs

from .messages import Hello

logger = logging.getLogger(__name__)

MODES = ("zmq", "nixl", "auto")
"""``kv_transport`` values: zmq (frames, or same-host shared memory), nixl (required: the
handshake fails unless both ends use NIXL), auto (NIXL when both ends offer it, else zmq)."""
SLICE_S = 0.0001
"""Longest wait between progress calls while NIXL writes are in flight, on both ends.
With UCX over TCP the bytes leave the prefill and land in the decode's pool only inside
progress calls (NIXL's own progress thread would spin a core). Alternating runs over TCP
at 1k tokens, pdkv / raw NIXL (whose decode polls every 0.1 ms): 0.63-0.88x with 1 ms
slices, 0.80-1.02x with 0.2 ms, 0.94-1.00x with 0.1 ms (docs/benchmarks.md). An idle
agent's slices cost 16% of a core at 0.1 ms (10% at 0.2 ms), only while a write is in
flight."""
_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the wheels' import names


def nixl_wheel(cuda: str | None = None) -> str:
    """The NIXL wheel (and pdkv extra) built for this torch's CUDA: ``nixl-cu13`` for
    CUDA 13, ``nixl-cu12`` for CUDA 12 and for a CPU-only torch (it imports without a
    GPU, for DRAM pools). ``cuda``: a version such as "13.0" (default: torch's own)."""
    cuda = torch.version.cuda if cuda is None else cuda
    major = (cuda or "12").split(".", 1)[0]
    return f"nixl-cu{major}"


def _module_order() -> tuple[str, ...]:
    """The import names to try, the wheel matching torch's CUDA first."""
    mine = nixl_wheel().replace("-", "_")
    return (mine, *(m for m in _MODULES if m != mine))


@cache
def _load() -> tuple[object | None, str]:
    """``(nixl API module, "")`` or ``(None, why it cannot be imported)``."""
    errors = []
    for name in _module_order():
        try:
            module = importlib.import_module(name)
            if hasattr(module, "nixl_agent"):
                _quiet_logging()
                if name != nixl_wheel().replace("-", "_") and torch.version.cuda:
                    logger.warning("NIXL: %s is installed, this torch is built for CUDA %s: "
                                   "install pip install 'pdkv[%s]'", name,
                                   torch.version.cuda, nixl_wheel())
                return module, ""
            errors.append(f"{name}: no nixl_agent")
        except Exception as exc:  # a broken wheel raises more than ImportError
            errors.append(f"{name}: {exc!r}")
    return None, "; ".join(errors)


def _quiet_logging() -> None:
    """NIXL's Python logger prints INFO lines to stdout (it would corrupt ``--json``
    output): route it through ours (stderr, the worker log) at WARNING, unless
    ``NIXL_LOG_LEVEL`` asks for more."""
    nixl_logger = logging.getLogger("nixl")
    nixl_logger.handlers.clear()
    nixl_logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


UCX_DEVICES = "UCX_NET_DEVICES"
"""UCX's list of the network devices it may use (interfaces such as ``eth0``, RDMA ports
such as ``mlx5_0:1``). Memory transports (shared memory, CUDA IPC) are not devices."""


def restrict_ucx(env: dict[str, str] | None = None) -> str:
    """Keep UCX to the interfaces the deployment names, before an agent creates its UCX
    context (which reads the environment once).

    UCX otherwise listens on every interface it finds and puts their addresses in the
    agent's metadata, and its connections carry no pdkv authentication. So an unset
    ``UCX_NET_DEVICES`` becomes ``lo``: NIXL between workers of this host only, as every
    other pdkv socket without a named address. A deployment on several hosts names its
    interfaces (Kubernetes: ``eth0`` in the worker pods; ``--cluster ray``: the node's
    interface; by hand: ``UCX_NET_DEVICES=eth1`` or an RDMA port); ``all`` lets UCX take
    every one. Returns the setting in force."""
    env = os.environ if env is None else env
    if not env.get(UCX_DEVICES):
        env[UCX_DEVICES] = "lo"
        logger.info("NIXL: UCX restricted to loopback (set %s to name the interfaces of a "
                    "deployment on several hosts)", UCX_DEVICES)
    return env[UCX_DEVICES]


def import_error() -> str:
    """Why NIXL cannot be used here ("" when it can)."""
    return _load()[1]


def require(node: str) -> None:
    """Raise ``RuntimeError`` with an actionable message when NIXL is missing."""
    why = import_error()
    if why:
        raise RuntimeError(f"{node}: kv_transport=nixl needs NIXL; install the wheel for "
                           f"this torch's CUDA ({torch.version.cuda or 'none: CPU'}) with "
                           f"pip install 'pdkv[{nixl_wheel()}]' (import failed: {why})")


@dataclass(frozen=True)
class PoolGeom:
    """Where a pool lies in memory and how a page is laid out.

    A page is ``rows`` rows (``total_layers * 2 * page_size``) of ``num_heads`` heads of
    ``head_bytes`` each: ``[num_pages, total_layers, 2, page_size, num_heads, head_dim]``.
    """

    mem: str          # "DRAM" or "VRAM"
    addr: int         # address of page 0
    dev: int          # device id (0 for DRAM)
    num_pages: int
    rows: int
    num_heads: int
    head_bytes: int

    @property
    def page_bytes(self) -> int:
        return self.rows * self.num_heads * self.head_bytes

    @classmethod
    def of(cls, data: torch.Tensor) -> PoolGeom:
        """Geometry of a contiguous pool tensor on any device."""
        assert data.is_contiguous(), data.stride()
        num_pages, layers, two, page_size, heads, head_dim = data.shape
        mem = "VRAM" if data.device.type == "cuda" else "DRAM"
        return cls(mem, data.data_ptr(), data.device.index or 0, num_pages,
                   layers * two * page_size, heads, head_dim * data.element_size())

    @classmethod
    def of_peer(cls, hello: Hello) -> PoolGeom:
        """The decode pool a ``Hello`` offers (its head count is that rank's share)."""
        layout = KvLayout(num_layers=hello.num_layers, num_draft_layers=hello.num_draft_layers,
                          num_kv_heads=hello.total_kv_heads // hello.tp_size,
                          head_dim=hello.head_dim, dtype=hello.dtype)
        return cls(hello.nixl_mem, hello.nixl_addr, hello.nixl_dev, hello.nixl_pages,
                   layout.total_layers * 2 * hello.page_size, layout.num_kv_heads,
                   hello.head_dim * DTYPE_BYTES[layout.dtype])


def run_descs(geom: PoolGeom, first_pages: list[int], lengths: list[int]) -> np.ndarray:
    """``[N, 3]`` uint64 descriptors ``(address, length, device)`` of whole-page runs:
    ``lengths[i]`` pages from ``first_pages[i]``."""
    addr = geom.addr + np.asarray(first_pages, np.uint64) * geom.page_bytes
    nbytes = np.asarray(lengths, np.uint64) * geom.page_bytes
    return np.stack([addr, nbytes, np.full_like(addr, geom.dev)], axis=1)


def row_descs(geom: PoolGeom, pages: np.ndarray, heads: slice) -> np.ndarray:
    """``[N, 3]`` descriptors of heads ``heads`` of ``pages``: one per page row
    (``[layers, 2, page_size]`` rows; a head slice is strided within a page). Two ends
    with the same page count and head count pair up one to one."""
    nh = heads.stop - heads.start
    row = geom.num_heads * geom.head_bytes
    addr = (geom.addr + np.asarray(pages, np.uint64)[:, None] * geom.page_bytes
            + np.arange(geom.rows, dtype=np.uint64)[None, :] * row
            + heads.start * geom.head_bytes).reshape(-1)
    return np.stack([addr, np.full_like(addr, nh * geom.head_bytes),
                     np.full_like(addr, geom.dev)], axis=1)


def write_descs(src: PoolGeom, src_pages: np.ndarray, src_heads: slice, dst: PoolGeom,
                dst_pages: np.ndarray, dst_heads: slice) -> tuple[np.ndarray, np.ndarray]:
    """Paired local and remote descriptors moving heads ``src_heads`` of ``src_pages``
    into heads ``dst_heads`` of ``dst_pages``: one per run consecutive on both sides when
    both ends move whole pages, else one per page row."""
    nh = src_heads.stop - src_heads.start
    if nh == src.num_heads == dst.num_heads:
        runs = page_runs(src_pages, dst_pages)
        lengths = [n for _, _, n in runs]
        return (run_descs(src, [s for s, _, _ in runs], lengths),
                run_descs(dst, [d for _, d, _ in runs], lengths))
    return row_descs(src, src_pages, src_heads), row_descs(dst, dst_pages, dst_heads)


class Agent:
    """One NIXL agent (UCX backend, no progress thread: progress happens in ``poll``).

    NIXL's progress thread busy-polls a core; pdkv's endpoints are poll-driven already, so
    the sender progresses its writes and the decode its notifications inside ``poll``.
    """

    def __init__(self, node: str):
        module, why = _load()
        if module is None:
            raise RuntimeError(f"NIXL unavailable: {why}")
        self.name = f"{node}/{uuid.uuid4().hex[:8]}"
        restrict_ucx()
        config = module.nixl_agent_config(enable_prog_thread=False,
                                          enable_listen_thread=False, backends=["UCX"])
        self.agent = module.nixl_agent(self.name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"{node}: NIXL has no UCX backend here "
                               f"(plugins {self.agent.get_plugin_list()})")
        self._registered = []

    def register(self, data: torch.Tensor) -> PoolGeom:
        """Register a pool tensor (DRAM or VRAM) for remote access; returns its geometry."""
        geom = PoolGeom.of(data)
        nbytes = geom.num_pages * geom.page_bytes
        self._registered.append(self.agent.register_memory(
            [(geom.addr, nbytes, geom.dev, "")], geom.mem))
        return geom

    def metadata(self) -> bytes:
        """Connection info and registrations, for a peer's ``add_peer``."""
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer agent's name."""
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # already disconnected: nothing left to drop
            logger.debug("remove_remote_agent(%s): %r", name, exc)

    def write(self, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str,
              peer: str, notif: bytes):
        """Post a WRITE of ``local`` descriptors into ``remote`` ones on ``peer`` with
        ``notif``; returns ``(handle, state)`` with state ``DONE``, ``PROC`` or ``ERR``."""
        a = self.agent
        handle = a.initialize_xfer("WRITE", a.get_xfer_descs(local, local_mem),
                                   a.get_xfer_descs(remote, remote_mem), peer, notif)
        return handle, a.transfer(handle)

    def prep(self, geom: PoolGeom, agent: str = "NIXL_INIT_AGENT"):
        """A prepared descriptor list of one whole-page descriptor per page of ``geom``'s
        pool (local with ``NIXL_INIT_AGENT``, else the named peer's): made once per peer,
        so that a request posts index arrays only (``write_prepped``)."""
        descs = run_descs(geom, list(range(geom.num_pages)), [1] * geom.num_pages)
        return self.agent.prep_xfer_dlist(agent, descs, geom.mem)

    def write_prepped(self, local, src_pages: np.ndarray, remote, dst_pages: np.ndarray,
                      notif: bytes):
        """Post a WRITE of pages ``src_pages`` into ``dst_pages`` (indices into the prepared
        lists ``local`` and ``remote``) with ``notif``; returns ``(handle, state)``."""
        handle = self.agent.make_prepped_xfer(
            "WRITE", local, np.asarray(src_pages, np.int32), remote,
            np.asarray(dst_pages, np.int32), notif)
        return handle, self.agent.transfer(handle)

    def unprep(self, dlist) -> None:
        try:
            self.agent.release_dlist_handle(dlist)
        except Exception as exc:  # closing anyway
            logger.debug("%s: release_dlist_handle: %r", self.name, exc)

    def state(self, handle) -> str:
        return self.agent.check_xfer_state(handle)

    def release(self, handle) -> bool:
        """Free a handle; an active transfer is cancelled. False when it cannot be."""
        try:
            self.agent.release_xfer_handle(handle)
            return True
        except Exception as exc:  # NIXL refuses to free a transfer it cannot cancel
            logger.warning("%s: cannot release a NIXL transfer yet: %r", self.name, exc)
            return False

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sending agent (this call also progresses the backend)."""
        return self.agent.get_new_notifs()

    def close(self) -> None:
        """Deregister the pools; the agent itself goes with the object."""
        for reg in self._registered:
            try:
                self.agent.deregister_memory(reg)
            except Exception as exc:  # closing anyway: log, keep going
                logger.warning("%s: deregister failed: %r", self.name, exc)
        self._registered.clear()


def side_for(side: type, config, cache, stats):
    """``side(node, pool, stats)`` (a prefill's or a decode's NIXL side) when
    ``config.kv_transport`` asks for NIXL; None for ``zmq``, and for ``auto`` where NIXL
    is missing or cannot serve the pool (logged); ``nixl`` then raises ``RuntimeError``."""
    if config.kv_transport == "zmq":
        return None
    if config.kv_transport == "nixl":
        require(config.node)
    elif import_error():
        logger.info("%s: kv_transport=auto without NIXL (%s): zmq", config.node,
                    import_error())
        return None
    try:
        return side(config.node, cache.data(), stats)
    except Exception as exc:  # no UCX plugin, registration refused, ...
        if config.kv_transport == "nixl":
            raise RuntimeError(f"{config.node}: kv_transport=nixl, but NIXL cannot serve "
                               f"this pool: {exc!r}") from exc
        logger.warning("%s: kv_transport=auto, NIXL unusable (%r): zmq", config.node, exc)
        return None


def offered(hello: Hello) -> bool:
    """This ``Hello`` offers (decode) or accepts (prefill) the NIXL data path."""
    return bool(hello.nixl_agent)


def negotiate(mine: Hello, theirs: Hello) -> bool:
    """Whether this leg uses NIXL; both ends compute the same answer from the two Hellos.

    Raises:
        HandshakeError: one end requires NIXL (``kv_transport=nixl``) and the other does
            not offer it (``zmq``, NIXL not installed there, or its metadata was refused).
    """
    from .handshake import HandshakeError  # noqa: PLC0415  (handshake imports this module)
    if offered(mine) and offered(theirs):
        return True
    for hello, other in ((mine, theirs), (theirs, mine)):
        if hello.kv_transport == "nixl":
            raise HandshakeError(
                f"handshake mismatch on kv_transport: {hello.node} requires nixl, "
                f"{other.node} (kv_transport={other.kv_transport!r}) "
                f"{'offers' if offered(other) else 'does not offer'} it and "
                f"{hello.node} {'offers' if offered(hello) else 'does not offer'} it "
                "(see both logs: NIXL not installed, or the peer's metadata refused)",
                "kv_transport")
    return False
