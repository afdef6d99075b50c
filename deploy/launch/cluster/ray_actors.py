"""The Ray objects of one deployment: its placement groups and the actors on them.

One placement group per worker, one bundle per rank, pinned to the node the plan chose
(``ray_plan``); one ``ProcHost`` actor per process on its bundle. Every actor gets a name
of its own (``pdkv-<process>-<deployment>-<n>``): a group restarted by the launcher gets
new actors while Ray may still be tearing down the old ones under their old names.
"""

from __future__ import annotations

import itertools
import logging
import time

from deploy.launch.cluster.ray_host import ProcHost
from deploy.launch.cluster.ray_plan import NodeInfo, PlacementError, WorkerSpec, bundles

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"


class RayActors:
    """Placement groups (``groups``, by worker) and actors (``actors``, by process)."""

    def __init__(self, ray, gpus: bool, tag: str, restart_delay_s: float) -> None:
        self.ray, self.gpus, self.tag = ray, gpus, tag
        self.restart_delay_s = restart_delay_s
        self.groups: dict[str, object] = {}
        self.actors: dict[str, object] = {}
        self._names = itertools.count()

    def place(self, specs: list[WorkerSpec], where: dict[str, NodeInfo],
              timeout_s: float) -> None:
        """A placement group per spec on its planned node, all ready within ``timeout_s``.

        Raises:
            PlacementError: a group was not ready in time (what it asked, what is free).
        """
        from ray.util.placement_group import placement_group

        for spec in specs:
            bs = bundles(spec, self.gpus)
            self.groups[spec.name] = placement_group(
                bs, strategy="STRICT_PACK", name=f"pdkv-{spec.name}-{self.tag}",
                bundle_label_selector=[{NODE_ID_LABEL: where[spec.name].node_id}] * len(bs))
        deadline = time.monotonic() + timeout_s
        for name, pg in self.groups.items():
            try:
                self.ray.get(pg.ready(), timeout=max(0.1, deadline - time.monotonic()))
            except self.ray.exceptions.GetTimeoutError:
                raise PlacementError(
                    f"placement group of {name} ({pg.bundle_specs}) on node "
                    f"{where[name].address} ({where[name].node_id[:8]}) not ready within "
                    f"{timeout_s:g} s; the cluster has {self.ray.cluster_resources()} in "
                    f"all, {self.ray.available_resources()} free") from None

    def create(self, name: str, role: str, worker: str, rank: int, argv: list[str],
               log: str, launch: bool, restarts: int, env: dict[str, str] | None = None):
        """A ``ProcHost`` actor for process ``name`` on bundle ``rank`` of ``worker``'s
        group; ``launch``: it starts ``argv`` at once (else at its ``launch``). ``env``:
        more environment for the process (a secret that must not sit in its argv, which
        any local user reads in /proc)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = bundles(WorkerSpec(name, role), self.gpus)[0]
        extra = {"runtime_env": {"env_vars": dict(env)}} if env else {}
        host = self.ray.remote(ProcHost).options(
            name=f"pdkv-{name}-{self.tag}-{next(self._names)}", num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0), max_restarts=restarts, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.groups[worker], placement_group_bundle_index=rank), **extra)
        actor = host.remote(argv, log, self.restart_delay_s, launch)
        self.actors[name] = actor
        return actor

    def get(self, refs: dict[str, object], timeout_s: float) -> dict:
        """Every answer of ``refs`` (by the same keys), within ``timeout_s``."""
        return dict(zip(refs, self.ray.get(list(refs.values()), timeout=timeout_s)))

    def kill(self, names: list[str]) -> None:
        """Kill these processes' actors for good (their processes get SIGTERM)."""
        for name in names:
            try:
                self.ray.kill(self.actors[name], no_restart=True)
            except Exception:  # already gone
                logger.debug("ray: kill of %s failed", name, exc_info=True)

    def release(self) -> None:
        """Every actor killed, every placement group removed."""
        from ray.util.placement_group import remove_placement_group

        self.kill(list(self.actors))
        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:
                logger.debug("ray: remove_placement_group failed", exc_info=True)
        self.actors.clear()
        self.groups.clear()
