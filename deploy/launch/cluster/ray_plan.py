"""Where each worker of a deployment goes on a Ray cluster, decided before anything starts.

Every worker is one placement group with one bundle per tensor-parallel rank
(``{"GPU": 1, "CPU": c}`` on GPU clusters, ``{"CPU": c}`` otherwise), packed on one node
(``STRICT_PACK``: ranks of a group share memory and NVLink, and the transport's
shared-memory path). The planner picks that node for each group:

    spread   each worker on the node holding the fewest workers so far (that fits)
    pack     each worker on the first node that still fits (fewest nodes used)

and then pins the group there with the node-id label, so what Ray does is what the plan
says. A plan that does not fit raises ``PlacementError`` naming what was asked and what
every node has, before any placement group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("spread", "pack")


class PlacementError(RuntimeError):
    """The deployment does not fit the cluster (the message says what was asked and what
    the cluster has)."""


@dataclass(frozen=True)
class WorkerSpec:
    """One process group of the deployment: the router, a front door or a worker."""

    name: str
    role: str
    """router, frontend, prefill, decode or colocated."""
    tp: int = 1
    """Ranks (one bundle, one device each)."""


@dataclass
class NodeInfo:
    """A live Ray node: its id, address and total resources (what the planner uses)."""

    node_id: str
    address: str
    resources: dict[str, float]
    used: dict[str, float] = field(default_factory=dict)
    workers: int = 0

    def fits(self, need: dict[str, float]) -> bool:
        return all(self.resources.get(k, 0.0) - self.used.get(k, 0.0) >= v - 1e-9
                   for k, v in need.items())

    def take(self, need: dict[str, float]) -> None:
        for k, v in need.items():
            self.used[k] = self.used.get(k, 0.0) + v
        self.workers += 1


def bundles(spec: WorkerSpec, gpus: bool, cpus_per_rank: float = 1.0) -> list[dict[str, float]]:
    """One bundle per rank; the router and front door need a CPU, never a GPU."""
    per_rank = {"CPU": cpus_per_rank}
    if gpus and spec.role not in ("router", "frontend"):
        per_rank["GPU"] = 1.0
    return [dict(per_rank) for _ in range(spec.tp)]


def plan(specs: list[WorkerSpec], nodes: list[NodeInfo], strategy: str, gpus: bool,
         cpus_per_rank: float = 1.0) -> dict[str, NodeInfo]:
    """The node of every spec (router and front door first, on the first node that fits).

    Raises:
        PlacementError: a spec fits no node given what the earlier ones took.
        ValueError: unknown strategy.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy {strategy!r}; allowed: {STRATEGIES}")
    if not nodes:
        raise PlacementError("the Ray cluster has no live node")
    out: dict[str, NodeInfo] = {}
    for spec in specs:
        need = _total(bundles(spec, gpus, cpus_per_rank))
        fitting = [n for n in nodes if n.fits(need)]
        if not fitting:
            raise PlacementError(_explain(spec, need, specs, nodes, gpus, cpus_per_rank))
        if strategy == "spread" and spec.role not in ("router", "frontend"):
            node = min(fitting, key=lambda n: n.workers)  # ties: the earlier node
        else:
            node = fitting[0]
        node.take(need)
        out[spec.name] = node
    return out


def _total(bs: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bs:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _explain(spec: WorkerSpec, need: dict[str, float], specs: list[WorkerSpec],
             nodes: list[NodeInfo], gpus: bool, cpus_per_rank: float) -> str:
    asked = _total([b for s in specs for b in bundles(s, gpus, cpus_per_rank)])
    have = "; ".join(f"{n.address} ({n.node_id[:8]}): "
                     f"{_fmt({k: n.resources.get(k, 0.0) for k in need})}" for n in nodes)
    return (f"cannot place {spec.role} {spec.name!r} ({spec.tp} rank(s), {_fmt(need)} on "
            f"one node) after the workers before it: the deployment asks for "
            f"{_fmt(asked)} in all, the cluster's nodes have {have}")


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"
