"""The ``--cluster`` flags of ``pdkv run`` and ``pdkv serve``, and the launcher they ask
for."""

from __future__ import annotations

import argparse

from common.config import ServeConfig


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (docs/cluster.md)")
    g.add_argument("--cluster", choices=["local", "ray"], default="local",
                   help="local: processes on this machine (default); ray: router, front "
                        "door and every worker as Ray actors, one placement group per "
                        "worker (pip install 'pdkv[ray]')")
    g.add_argument("--ray-address", default="", metavar="ADDR",
                   help="the Ray cluster to join (HEAD:PORT or auto; default: start Ray on "
                        "this machine for the run)")
    g.add_argument("--placement", choices=["spread", "pack"], default="spread",
                   help="ray: workers on as many nodes as possible (spread, default) or on "
                        "as few as possible (pack)")
    g.add_argument("--ray-max-restarts", type=int, default=3, metavar="N",
                   help="ray: how often a worker that died comes back: Ray restarts a "
                        "one-rank worker's actor, the launcher all ranks of a "
                        "tensor-parallel group (default 3; then the run fails)")


def make_cluster(args: argparse.Namespace, cfg: ServeConfig, devices: list[str], **kw):
    """The launcher the flags ask for (``Cluster`` or ``RayCluster``)."""
    from deploy.launch.launcher import Cluster

    if getattr(args, "cluster", "local") != "ray":
        return Cluster(cfg, args.mode, args.prefill, args.decode, devices, args.log_dir,
                       threads=args.threads, **kw)
    from deploy.launch.cluster.ray_launch import RayCluster

    if args.devices != "cpu":
        raise ValueError("--devices is for one machine; with --cluster ray each worker gets "
                         "the GPU of its placement group (or the CPU)")
    return RayCluster(cfg, args.mode, args.prefill, args.decode, args.log_dir,
                      threads=args.threads, ray_address=args.ray_address,
                      placement=args.placement, max_restarts=args.ray_max_restarts, **kw)
