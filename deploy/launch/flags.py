"""Flag groups that several ``pdkv`` commands share (serving config, workload,
deployment, HTTP, keys, metrics, log level); each command's own flags live with it."""

from __future__ import annotations

import argparse
import os


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """Serving-config flags shared by ``run`` and ``bench serve`` (defaults: common/config.py)."""
    g = p.add_argument_group("serving config (defaults from common/config.py)")
    add_config_source(g, "flags below override it")
    g.add_argument("--model", metavar="NAME|DIR",
                   help="a local checkpoint directory in the Hugging Face layout (config.json, "
                        "*.safetensors, tokenizer files; Llama, Qwen2, Mistral; never "
                        "downloaded; docs/models.md) or a built-in model: tiny (default), "
                        "small, llama-1b-shape, llama-8b-shape")
    g.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "float64"],
                   help="override the model's dtype (default: the checkpoint's own; float64: "
                        "exact comparisons on CPU)")
    g.add_argument("--page-size", type=int, help="slots per KV page (default 16)")
    g.add_argument("--prefill-pages", type=int,
                   help="pages per prefill pool (default 0: from --kv-memory-mib on CPU, "
                        "--gpu-memory-utilization on CUDA)")
    g.add_argument("--decode-pages", type=int,
                   help="pages per decode (or colocated) pool (default 0: from the budget)")
    g.add_argument("--kv-memory-mib", type=int, metavar="MIB",
                   help="CPU: MiB of each worker's KV pool (default 1024)")
    g.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                   help="CUDA: share of the device a worker fills, its weights, activations "
                        "and KV pool together (default 0.9)")
    g.add_argument("--chunk-size", type=int, help="prefill chunk in tokens (default 256)")
    g.add_argument("--max-running", type=int,
                   help="requests a worker admits at once (default 0: one per usable page "
                        "of its pool, at most 256)")
    g.add_argument("--transport", choices=["ipc", "tcp"],
                   help="addresses on one machine: ipc (default) or tcp on 127.0.0.1")
    g.add_argument("--kv-transport", choices=["zmq", "nixl", "auto"],
                   help="KV data path: zmq (default: frames, or shared memory on one "
                        "host), nixl (required: needs pdkv[nixl] on every worker), auto "
                        "(nixl where both ends have it)")
    g.add_argument("--kv-security", choices=["curve", "plain"],
                   help="KV connections: curve (default: encrypted and authenticated) or "
                        "plain (authenticated, KV bytes in the clear: a private data "
                        "network only; docs/security.md)")
    g.add_argument("--debug-integrity", action="store_true", default=None,
                   help="workers run check_integrity() whenever idle")
    g.add_argument("--prefill-tp", type=int, metavar="N",
                   help="tensor-parallel ranks (processes, devices) per prefill worker "
                        "(default 1; each rank offloads its own KV heads; docs/cluster.md)")
    g.add_argument("--decode-tp", type=int, metavar="M",
                   help="tensor-parallel ranks per decode or colocated worker (default 1; "
                        "each rank offloads its own KV heads; docs/cluster.md)")
    g.add_argument("--tp-timeout-s", type=float, metavar="S",
                   help="deadline of every collective of a tensor-parallel group; a rank "
                        "silent this long takes its group down (default 30)")
    add_routing_flags(p)
    add_spec_host_flags(p)


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing (docs/routing.md)")
    g.add_argument("--routing", choices=["prefix", "least-loaded"],
                   help="prefix (default): send each request where its prompt's blocks are "
                        "cached (the workers' KV events), against load; least-loaded: by "
                        "load alone")
    g.add_argument("--local-prefill-tokens", type=int, metavar="N",
                   help="prefix routing: a decode that holds most of the prompt computes "
                        "up to N uncached prompt tokens itself, without a prefill (default "
                        "256; 0: always a prefill)")


def add_config_source(g, note: str) -> None:
    """``--config FILE.json`` and ``--config-json JSON``, the same on run, router, bench."""
    g.add_argument("--config", metavar="FILE.json",
                   help=f"a JSON file: an object of ServeConfig fields ({note})")
    g.add_argument("--config-json", metavar="JSON",
                   help="the same object given inline, e.g. '{\"page_size\": 32}'")


def add_spec_host_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding and host tier (docs/host_tier.md)")
    g.add_argument("--spec-k", type=int, metavar="K",
                   help="draft tokens per step for greedy requests; 0 turns speculation off "
                        "(default 3: the tiny model's best decode tokens/s). A checkpoint "
                        "speculates only with --draft-model or --spec-ngram")
    g.add_argument("--draft-model", metavar="DIR",
                   help="draft checkpoint for speculative decoding (same tokenizer as "
                        "--model; its KV is computed by prefill and sent with the target's)")
    g.add_argument("--spec-ngram", type=int, metavar="N",
                   help="speculate by n-gram prompt lookup: propose the tokens that followed "
                        "the latest earlier match of the sequence's last N..1 tokens (no "
                        "draft weights; default 0 = off)")
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="offload committed KV to a host tier and reuse cached prompt "
                        "prefixes on prefill and decode (default on)")
    g.add_argument("--host-pages", type=int, metavar="N",
                   help="pages of each worker's host tier (default 0: --host-memory-mib)")
    g.add_argument("--host-memory-mib", type=int, metavar="MIB",
                   help="MiB of each worker's host tier (default 1024)")
    g.add_argument("--overcommit", action=argparse.BooleanOptionalAction, default=None,
                   help="allocate on demand: admit on the prompt's pages and retract the "
                        "youngest request to the host tier when the pool runs out (default "
                        "on; needs --offload, else whole-life reservation)")
    g.add_argument("--prefix-load-timeout-s", type=float, metavar="S",
                   help="longest wait for a prefix load from the host tier; past it the "
                        "request is served without the cached prefix (default 2.0)")


def add_workload_flags(p: argparse.ArgumentParser, requests: int | None,
                        default_help: str = "") -> None:
    g = p.add_argument_group("workload (seeded; rids are a pure function of the seed)")
    g.add_argument("--requests", type=int, default=requests, metavar="R",
                   help=f"requests to send (default {default_help or requests})")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="workload seed (default 0)")
    g.add_argument("--rate", type=float, default=8.0,
                   help="mean arrival rate, requests/s, Poisson (default 8; 0 = all at once)")
    g.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="prompt length range, log-uniform (default 16 256)")
    g.add_argument("--output-len", type=int, nargs=2, default=[8, 48], metavar=("MIN", "MAX"),
                   help="max_new_tokens range, uniform (default 8 48)")
    g.add_argument("--turns", type=int, default=1, metavar="N",
                   help="turns per conversation: each turn's prompt extends the previous "
                        "one (prefix reuse); --requests counts turns (default 1)")
    g.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="system prompt every conversation begins with (default 0)")
    g.add_argument("--turn-gap", type=float, default=1.0, metavar="S",
                   help="seconds between a conversation's turns (default 1.0)")


def add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """What ``run`` and ``serve`` launch on this machine."""
    p.add_argument("--prefill", type=int, default=1, metavar="N",
                   help="prefill workers (disagg; default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M",
                   help="decode workers (disagg) or colocated workers (default 1)")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg",
                   help="disagg: separate prefill and decode workers (default); colocated: "
                        "one process does both (the reference)")
    p.add_argument("--devices", default="cpu", metavar="LIST",
                   help="comma-separated devices given to workers round-robin, e.g. "
                        "cuda:0,cuda:1 (default cpu)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="keep free logs (<worker>.freelog) and process logs (<name>.log) "
                        "here (default: a temporary directory, removed when all is clean)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (default 0: one per core the worker may "
                        "run on; CPU workers then share this host's cores out between them)")
    from deploy.launch.cluster.commands import add_cluster_flags

    add_cluster_flags(p)


def add_http_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP front door (OpenAI API; docs/http.md)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every "
                        "interface, which needs an API key or --allow-no-api-key)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks one)")
    add_api_key_flags(g)
    g.add_argument("--served-model-name", metavar="NAME",
                   help="model name in /v1/models and in requests (default: the model's)")
    g.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="requests the front door holds without a first token; beyond them "
                        "a 429 (default 256)")
    g.add_argument("--router-timeout-s", type=float, default=10.0, metavar="S",
                   help="the router silent this long ends every open request with an error "
                        "and answers 503 until it is back (default 10)")
    g.add_argument("--http-log-level", default="warning",
                   choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level (default warning; info logs each connection)")
    add_log_level(p)


def add_api_key_flags(g) -> None:
    """The front door's lock (deploy/http/access.py; docs/security.md)."""
    g.add_argument("--api-key-file", metavar="FILE",
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics, KEY "
                        "being this file's content (default: $PDKV_API_KEY; neither: open, "
                        "which only loopback allows)")
    g.add_argument("--api-key", metavar="KEY",
                   help="the same key given inline (any local user can read a process's "
                        "arguments: prefer --api-key-file or $PDKV_API_KEY)")
    g.add_argument("--allow-no-api-key", action="store_true",
                   help="serve the API without a key on an address beyond loopback "
                        "(anyone who reaches it may use the deployment)")
    g.add_argument("--ssl-certfile", metavar="FILE",
                   help="serve HTTPS with this certificate (PEM; the chain after it)")
    g.add_argument("--ssl-keyfile", metavar="FILE",
                   help="the certificate's private key (PEM; default: in --ssl-certfile)")


def add_auth_flags(p: argparse.ArgumentParser, identity: str | None, what: str) -> None:
    g = p.add_argument_group("authentication (docs/security.md)")
    g.add_argument("--auth-keys", metavar="DIR", default=os.environ.get("PDKV_AUTH_KEYS"),
                   help=f"{what} (made by pdkv keys create; default $PDKV_AUTH_KEYS). "
                        "Without keys nothing is authenticated and only loopback or a "
                        "private ipc directory may be bound")
    g.add_argument("--identity", metavar="NAME", default=identity,
                   help="identity of the key directory to run as (default "
                        f"{identity or 'operator with --shutdown, else client'})")


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="lifecycle log level (default info)")


def add_metrics_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve the deployment's Prometheus metrics (router and every worker, "
                        "labelled by worker) at http://HOST:PORT/metrics; 0 picks a free "
                        "port (default: not served over HTTP; pdkv top still works)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="interface for --metrics-port (default 127.0.0.1; 0.0.0.0 for a "
                        "Prometheus on another host)")
