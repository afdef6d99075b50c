"""Bringing a tensor-parallel worker back on Ray: all of its ranks, a fresh rendezvous.

A rank cannot rejoin a group whose other ranks left (the group's rendezvous and its gloo
connections are made once, at start), so Ray's own restart of one actor does not fit a
group: its actors have no Ray restarts, and the launcher restarts the group as a whole.
``GroupSupervisor.check`` (called from the launcher's ``check``, never blocking: the
driver's loop keeps serving the other workers meanwhile) moves each group through

    up         every rank runs
    draining   a rank's process exited or its actor died: the others leave on their own
               (rank 0 exits 1 at its next collective, which an idle rank 0 makes every
               quarter of ``tp_timeout_s``; a follower exits 3 once rank 0 is gone); a
               rank still running after ``tp_timeout_s`` + 5 s is sent SIGTERM
    placing    every old actor killed; new actors on the same placement group's bundles
               (rank 0's picks a new rendezvous port on its node and starts at once)
    launching  the followers start with rank 0's new rendezvous address
    up         the new rank 0 registers under the worker's name (the router refuses the
               name until it counts the old incarnation lost, and the worker asks again)

A group goes down at most ``max_restarts`` times and comes back; the next time (or when
its new actors cannot be placed within ``ready_timeout_s``, counted as a try) ``check``
raises ``WorkerDied`` naming the worker, its restarts and why its last rank left.

Every incarnation's ranks write new free logs (``<name>.1.freelog``,
``<name>.tp1.1.freelog``, ...: a free log is never reopened), so ``pdkv replay DIR``
replays each incarnation on its own.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field

from deploy.launch.cluster.ray_host import TP_PLACEHOLDER
from deploy.launch.launcher import RANK, Proc, WorkerDied

logger = logging.getLogger(__name__)

DRAIN_GRACE_S = 5.0
"""Beyond ``tp_timeout_s``: how long the surviving ranks get to leave on their own."""


@dataclass
class Group:
    """One tensor-parallel worker's ranks (rank order) and where its restart stands."""

    name: str
    procs: list[Proc]
    phase: str = "up"
    restarts: int = 0
    since: float = 0.0
    """When its first rank was seen gone."""
    tried: float = 0.0
    """When its current try at new actors began."""
    why: str = ""
    exits: dict[str, int | str] = field(default_factory=dict)
    pending: dict[str, object] = field(default_factory=dict)
    actors: dict[str, object] = field(default_factory=dict)


class GroupSupervisor:
    """Restarts the tensor-parallel groups of a ``RayCluster`` (see the module docstring).

    ``events`` lists every restart: the worker, how each old rank left (its exit status,
    or ``stopped`` when the launcher had to stop it), the try, and how long the group
    took from the first rank's exit to its new ranks running."""

    def __init__(self, cluster, max_restarts: int, drain_s: float, place_s: float) -> None:
        self.cluster, self.max_restarts = cluster, max_restarts
        self.drain_s, self.place_s = drain_s, place_s
        self.groups: dict[str, Group] = {}
        for p in cluster.procs:
            if "--tp-size" in p.argv:
                worker = p.name.split(".tp")[0]
                self.groups.setdefault(worker, Group(worker, [])).procs.append(p)
        self.events: list[dict] = []

    def owns(self, p: Proc) -> bool:
        return "--tp-size" in p.argv

    def check(self) -> None:
        """Advance every group's restart one step; raises ``WorkerDied`` for a group that
        cannot come back."""
        for g in self.groups.values():
            getattr(self, f"_{g.phase}")(g)

    # -- phases ----------------------------------------------------------------------------
    def _up(self, g: Group) -> None:
        dead = [p for p in g.procs if p.popen.poll() is not None]
        if not dead:
            return
        g.phase, g.since, g.why, g.exits = "draining", time.monotonic(), dead[0].why(), {}
        logger.warning("ray: %s's group of %d ranks is down (%s); its other ranks leave, "
                       "then it restarts", g.name, len(g.procs), g.why.splitlines()[0])

    def _draining(self, g: Group) -> None:
        for p in g.procs:
            code = p.popen.poll()
            if code is not None and p.name not in g.exits:
                g.exits[p.name] = code
        if len(g.exits) < len(g.procs) and time.monotonic() - g.since < self.drain_s:
            return
        for p in g.procs:
            if p.name not in g.exits:  # a rank stuck past every deadline of its group
                logger.error("ray: %s did not leave its lost group within %.0f s: stopping "
                             "it", p.name, self.drain_s)
                p.popen.send_signal(signal.SIGTERM)
                g.exits[p.name] = "stopped"
        self.cluster.kill_actors([p.name for p in g.procs])
        if g.restarts >= self.max_restarts:
            g.phase = "failed"
            raise WorkerDied(f"{g.name}: its tensor-parallel group of {len(g.procs)} ranks "
                             f"went down after {g.restarts} restart(s) (--ray-max-restarts "
                             f"{self.max_restarts}) and is not brought back; {g.why}")
        g.restarts += 1
        g.actors = {p.name: self.cluster.create_actor(p, launch=p.role != RANK)
                    for p in g.procs}
        g.pending = {n: a.info.remote() for n, a in g.actors.items()}
        g.phase, g.tried = "placing", time.monotonic()
        logger.info("ray: %s: restart %d of %d, old ranks left with %s", g.name, g.restarts,
                    self.max_restarts, g.exits)

    def _placing(self, g: Group) -> None:
        infos = self._ready(g)
        if infos is None:
            return
        tp = self.cluster.rendezvous(infos[g.procs[0].name]["argv"])
        g.pending = {p.name: g.actors[p.name].launch.remote({TP_PLACEHOLDER: tp})
                     for p in g.procs if p.role == RANK}
        g.pending.update({p.name: infos[p.name] for p in g.procs if p.role != RANK})
        g.phase = "launching"

    def _launching(self, g: Group) -> None:
        infos = self._ready(g)
        if infos is None:
            return
        for p in g.procs:
            self.cluster.bind(p, g.actors[p.name], infos[p.name])
        self.events.append({"worker": g.name, "exits": dict(g.exits), "restart": g.restarts,
                            "back_s": round(time.monotonic() - g.since, 2)})
        logger.warning("ray: %s's group is running again (restart %d, %.1f s after it went "
                       "down)", g.name, g.restarts, time.monotonic() - g.since)
        g.phase, g.pending, g.actors = "up", {}, {}

    def _failed(self, g: Group) -> None:
        raise WorkerDied(f"{g.name}: its tensor-parallel group is down for good; {g.why}")

    def _ready(self, g: Group) -> dict | None:
        """The pending answers once all came; None while waiting. A try that fails or
        outlasts ``place_s`` goes back to draining (which kills its actors and tries
        again, or gives up)."""
        import ray

        refs = [r for r in g.pending.values() if not isinstance(r, dict)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        if len(ready) < len(refs):
            if time.monotonic() - g.tried > self.place_s:
                self._retry(g, f"its new actors did not start within {self.place_s:g} s")
            return None
        try:
            got = {n: r if isinstance(r, dict) else ray.get(r)
                   for n, r in g.pending.items()}
        except ray.exceptions.RayError as exc:
            self._retry(g, f"a new actor failed: {exc}")
            return None
        return got

    def _retry(self, g: Group, why: str) -> None:
        logger.error("ray: %s: restart %d failed: %s", g.name, g.restarts, why)
        # every rank counted as gone: draining kills the try's actors and goes on at once
        g.why, g.phase, g.exits = why, "draining", {p.name: "not started" for p in g.procs}
