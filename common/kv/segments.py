"""Names of pdkv's shared-memory segments, and reclaiming those whose owner died.

A segment is named ``pdkv.<deployment>.<worker>.<pid>-<start>.<random>``: the
deployment's tag (its key directory's id, ``local`` without keys), the worker that made
it, its process id and that process's start time (clock ticks after boot, from
``/proc/<pid>/stat``: a pid used again by another process does not make a dead owner
look alive), and 8 random hex digits. ``ls /dev/shm`` so says whose each one is.

A worker killed with its whole process group (Python's resource tracker included, which
would otherwise unlink its segments) leaves them behind: gigabytes per killed worker with
a real model. ``reclaim_orphans`` unlinks the deployment's segments whose owner is dead;
a worker calls it as it starts, the router and the workers whenever they declare a peer
lost. A process that still maps such a segment keeps its mapping (unlinking removes the
name, not the memory); nobody can map it any more.

Torch-free: the router uses it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat

logger = logging.getLogger(__name__)

PREFIX = "pdkv"
SHM_DIR = "/dev/shm"
MAGIC = b"PDKVSHM1"
"""The first bytes of every pool segment (``shared_tensor``): only those are reclaimed."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def deployment_tag(deployment_id: str) -> str:
    """The deployment's part of a segment name: its id's first 16 characters, or
    ``local`` for a deployment without keys (loopback only)."""
    return _clean(deployment_id[:16]) if deployment_id else "local"


def segment_stem(deployment_id: str, worker: str) -> str:
    """``pdkv.<deployment>.<worker>``: what every segment of that worker starts with."""
    return f"{PREFIX}.{deployment_tag(deployment_id)}.{_clean(worker)[:64] or 'node'}"


def segment_name(stem: str) -> str:
    """A new segment's name: ``<stem>.<pid>-<start>.<random>``."""
    pid = os.getpid()
    return f"{stem}.{pid}-{_start_time(pid)}.{secrets.token_hex(4)}"


def owner_alive(name: str) -> bool:
    """Whether the process that made segment ``name`` still runs (True when the name
    does not say: never reclaim what we cannot tell is dead)."""
    parts = name.rsplit(".", 2)
    owner = parts[1].split("-") if len(parts) == 3 else []
    if len(owner) != 2 or not owner[0].isdigit():
        return True
    pid, start = int(owner[0]), owner[1]
    return _start_time(pid) == start


def reclaim_orphans(deployment_id: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the deployment's pool segments whose owner process is dead; their names.

    Only regular files of this user that carry a pool's header are touched; a segment
    that is already gone (another process reclaimed it first) is skipped."""
    prefix = f"{PREFIX}.{deployment_tag(deployment_id)}."
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(prefix)]
    except OSError:
        return []
    gone = []
    for name in names:
        if owner_alive(name) or not _is_our_pool(os.path.join(shm_dir, name)):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("shared memory %s of a dead worker: cannot unlink: %s", name, exc)
            continue
        gone.append(name)
    if gone:
        logger.warning("reclaimed %d shared-memory segments of dead workers: %s", len(gone),
                       ", ".join(gone))
    return gone


def _is_our_pool(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        return os.pread(fd, len(MAGIC), 0) == MAGIC
    finally:
        os.close(fd)


def _start_time(pid: int) -> str:
    """Clock ticks after boot at which ``pid`` started ('' when it does not run, or is
    a zombie: dead, its exit not yet collected by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read().decode(errors="replace")
    except OSError:
        return ""
    # the command name (field 2) may hold spaces and parentheses: count after the last ')'
    fields = stat_line[stat_line.rfind(")") + 2:].split()
    if len(fields) <= 19 or fields[0] in ("Z", "X"):
        return ""
    return fields[19]


def _clean(text: str) -> str:
    return _UNSAFE.sub("-", text)
