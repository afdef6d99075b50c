"""Bodies of the ``pdkv router|prefill|decode|colocated`` processes.

Each sets up logging and threads, builds its object, serves until shutdown and returns an
exit status: 0 after a clean shutdown, 3 when the router was lost, 4 when a free log
could not write and ``freelog_on_error`` is ``exit``, 2 when its keys are unusable or it
may not bind where asked (said in one line), 1 on an error (logged with its
traceback). SIGTERM and SIGINT end the loop through the same clean path: rows
freed, free log closed; one that comes while a step runs waits for the step's end
(``common.node.stop_signals``), so no cache operation or tensor-parallel broadcast is
cut in two.
"""

from __future__ import annotations

import argparse
import logging
import socket
from pathlib import Path

from common.config import ServeConfig

logger = logging.getLogger(__name__)


def _setup(args: argparse.Namespace) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from common.node import install_stop_signals
    install_stop_signals()  # SIGTERM: SystemExit(143), after the step under way if any


def _config(args: argparse.Namespace) -> ServeConfig:
    """``--config FILE.json`` or ``--config-json JSON`` (as ``pdkv run``), else the
    default; then the routing flags."""
    from deploy.launch.config_args import config_from_args

    return config_from_args(args)


def _keys(args: argparse.Namespace):
    """The deployment's key directory (``--auth-keys`` or ``PDKV_AUTH_KEYS``), or None."""
    from common.auth import Keys
    return Keys(args.auth_keys) if getattr(args, "auth_keys", None) else None


def run_router(args: argparse.Namespace) -> int:
    _setup(args)
    from common.auth import InsecureBind, KeysError
    from deploy.router.router import serve_router
    try:
        return serve_router(args.bind, _config(args), _keys(args), args.metrics_host,
                            args.metrics_port)
    except (KeysError, InsecureBind) as exc:
        logger.error("router: %s", exc)
        return 2


def run_worker(args: argparse.Namespace) -> int:
    """``pdkv prefill``, ``pdkv decode``, ``pdkv colocated``."""
    from common.sizing import passive_omp_waits
    passive_omp_waits()  # before anything loads torch
    _setup(args)
    from common.auth import InsecureBind, KeysError
    from common.node import FreeLogFailed, RouterLost, setup_process
    from common.node.tp import TpSpec, run_follower
    setup_process(getattr(args, "threads", 0))  # torch threads: only workers import torch
    from deploy.launch.run import check_devices
    check_devices([args.device])  # before anything starts: a one-line error, status 2
    name = args.name or f"{args.command}-{socket.gethostname()}"
    if not args.log_dir:
        logger.warning("%s: no --log-dir: this worker records no free log, so pdkv replay "
                       "cannot check its pages", name)
    try:
        tp = TpSpec(args.tp_size, args.tp_rank, args.tp_address, args.tp_timeout_s,
                    args.tp_rendezvous_timeout_s)
    except ValueError as exc:
        logger.error("%s: %s", name, exc)
        return 2
    if tp.rank > 0:  # a follower: no router; the group's socket and its KV transport
        try:
            return run_follower(tp, name, args.device, args.log_dir,
                                getattr(args, "kv_bind", ""), getattr(args, "kv_advertise", ""),
                                keys=_keys(args), identity=args.identity)
        except (KeyboardInterrupt, SystemExit) as exc:
            logger.info("%s/tp%d: stopped by signal (%s)", name, tp.rank, exc)
            return 0
        except (KeysError, InsecureBind) as exc:
            logger.error("%s/tp%d: %s", name, tp.rank, exc)
            return 2
    try:
        worker = _build(args, name, tp)
    except (KeysError, InsecureBind, ValueError) as exc:  # flags: before anything starts
        logger.error("%s: %s", name, exc)
        return 2
    try:
        worker.serve()
    except RouterLost as exc:
        logger.error("%s", exc)
        return 3
    except FreeLogFailed as exc:
        logger.error("%s", exc)
        return 4
    except (KeysError, InsecureBind) as exc:
        logger.error("%s: %s", name, exc)
        return 2
    except (KeyboardInterrupt, SystemExit) as exc:
        logger.info("%s: stopped by signal (%s)", name, exc)
        return 0
    except Exception:
        logger.exception("%s: fatal error", name)
        return 1
    logger.info("%s: clean shutdown", name)
    return 0


def _events(args: argparse.Namespace, secured: bool):
    """The worker's KV events spec from its flags (None: no events); an address that
    needs keys is refused now, before registering."""
    endpoint = getattr(args, "kv_events_endpoint", "")
    if not endpoint:
        return None
    from common.auth import check_bind
    from common.kv_events import replay_address
    from common.node import EventsSpec

    replay = args.kv_events_replay_endpoint or replay_address(endpoint)
    for address in (endpoint, replay):
        check_bind(address, secured)
    return EventsSpec(endpoint, replay, args.kv_events_advertise_host)


def _build(args: argparse.Namespace, name: str, tp=None):
    local = {field: str(Path(value).expanduser().resolve()) for field, value in
             (("model_path", args.model), ("draft_model_path", args.draft_model)) if value}
    common = dict(name=name, router=args.router, device=args.device, log_dir=args.log_dir,
                  register_timeout_s=getattr(args, "connect_timeout", 60.0),
                  local_models=local, keys=_keys(args), identity=args.identity,
                  events=_events(args, _keys(args) is not None))
    if args.command == "prefill":
        from common.auth import check_bind
        from prefill_node.worker import PrefillWorker
        # say it now, not after registering: without keys the KV port must stay private
        check_bind(args.kv_bind, secured=common["keys"] is not None)
        return PrefillWorker(kv_bind=args.kv_bind, kv_advertise=args.kv_advertise, tp=tp,
                             **common)
    if args.command == "decode":
        from decode_node.worker import DecodeWorker
        return DecodeWorker(**common, tp=tp)
    from deploy.launch.colocated import ColocatedWorker
    return ColocatedWorker(**common, tp=tp)
