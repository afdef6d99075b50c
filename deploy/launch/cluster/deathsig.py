"""``python -m deploy.launch.cluster.deathsig PARENT_PID ARGV...``: exec ARGV so that it gets
SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``, kept across ``execve``).

A Ray actor starts its pdkv process through this instead of ``Popen(preexec_fn=...)``:
code run between ``fork`` and ``exec`` of a process with many threads (a Ray worker has
dozens) can deadlock on a lock another thread held at the fork, and did, hanging actor
creation. Here the new process sets the signal itself, single-threaded, then checks that
its parent is still the one that started it (it may have died in between) and execs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m deploy.launch.cluster.deathsig PARENT_PID ARGV...", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[1:]
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the actor still stops its child on the way out
        pass
    if os.getppid() != parent:  # the parent died before the signal was set
        return 143
    os.execv(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
