"""Checkpoints: load time and peak host memory, decode speed against the same-shape
built-in model, and the acceptance of each speculation kind.

    python -m benchmarks.checkpoint [--shape small] [--dtype float32] [--dir DIR] [--json]

- load: the built-in ``--shape`` is written once as a Hugging Face checkpoint (or
  ``--dir`` is read); a fresh process loads it and reports seconds and peak resident
  memory above its own baseline (torch imported), against the weights' bytes (one copy);
- decode: tokens/s of a continuous batch of the checkpoint against the built-in seeded
  model of the same shape (the same weights: the ratio is the cost of the loading path,
  which should be none);
- speculation: acceptance and tokens/s against plain decode for each kind: the built-in's
  own first layers, the same layers exported as a separate draft checkpoint, and n-gram
  lookup. Weights are random, so acceptance says how the kinds compare on this model, not
  what a trained draft achieves on real text.

Medians of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.speculative import _decode_once, _median, _prompts
from common.model import Model, export_builtin, get_config, load_config
from decode_node.batch import greedy_step
from decode_node.ngram import NgramProposer
from decode_node.speculative import SpeculativeStep


def export(shape: str, dtype: str, path: Path, *, layers: int | None = None) -> Path:
    return export_builtin(shape, path, dtype, layers=layers)


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure (VmRSS, VmHWM) in bytes. ``ru_maxrss`` would not do:
    after exec it still holds the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def load_once(path: str, dtype: str) -> dict:
    """In this (fresh) process: seconds and peak RSS of loading ``path``."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to VmRSS
    base = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    model = Model(load_config(path, dtype=dtype))
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    tensors = [model.embedding, model.final_norm, *([] if model.lm_head is model.embedding
                                                    else [model.lm_head])]
    tensors += [t for b in model.blocks for t in vars(b).values() if t is not None]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    return {"load_s": seconds, "weights_bytes": weights, "peak_rss_over_baseline": peak - base,
            "peak_over_one_copy": (peak - base) / weights}


def bench_load(path: Path, dtype: str, repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint", "--load-only",
                              str(path), "--dtype", dtype], capture_output=True, text=True,
                             check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return {"checkpoint_bytes": size, "load_s": _median([r["load_s"] for r in runs]),
            "load_s_all": sorted(r["load_s"] for r in runs),
            "weights_bytes": runs[0]["weights_bytes"],
            "peak_rss_over_baseline": max(r["peak_rss_over_baseline"] for r in runs),
            "peak_over_one_copy": max(r["peak_over_one_copy"] for r in runs)}


def bench_decode(ckpt: Model, builtin: Model, args: argparse.Namespace) -> dict:
    prompts = _prompts(builtin.config, args.batch, args.context, seed=1)
    new = args.batch * (args.gen - 1)
    times: dict[str, list[float]] = {"builtin": [], "checkpoint": []}
    for _ in range(args.repeat):
        for name, m in (("builtin", builtin), ("checkpoint", ckpt)):
            times[name].append(_decode_once(m, prompts, args.gen, greedy_step,
                                            args.page_size)[0])
    b, c = new / _median(times["builtin"]), new / _median(times["checkpoint"])
    return {"builtin_tokens_per_s": b, "checkpoint_tokens_per_s": c, "ratio": c / b,
            "batch": args.batch, "context": args.context, "gen": args.gen}


def bench_spec(builtin: Model, ckpt: Model, draft: Model, args: argparse.Namespace) -> dict:
    prompts = _prompts(builtin.config, args.batch, args.context, seed=2)
    kinds = {"layers": (builtin, None, lambda: SpeculativeStep(args.k)),
             "draft_checkpoint": (ckpt, draft, lambda: SpeculativeStep(args.k)),
             "ngram": (ckpt, None, lambda: SpeculativeStep(args.k, NgramProposer(args.ngram)))}
    out = {}
    for kind, (target, d, make) in kinds.items():
        base, spec, stats = [], [], None
        for _ in range(args.repeat):
            base.append(_decode_once(target, prompts, args.gen, greedy_step, args.page_size,
                                     draft=d)[0])
            step = make()
            spec.append(_decode_once(target, prompts, args.gen, step, args.page_size,
                                     draft=d)[0])
            stats = step.stats
        out[kind] = {"k": args.k, "acceptance_rate": stats.acceptance_rate,
                     "mean_accepted_len": stats.mean_accepted_len,
                     "speedup": _median(base) / _median(spec)}
    return out


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-ckpt-") as tmp:
        path = Path(args.dir) if args.dir else export(args.shape, args.dtype, Path(tmp, "m"))
        result = {"shape": args.shape, "dtype": args.dtype, "checkpoint": str(path),
                  "load": bench_load(path, args.dtype, args.repeat)}
        if not args.load_figures_only and args.dir and not _same_shape(path, args):
            # decode and speculation compare with the built-in of --shape: another
            # model's checkpoint has only load figures (its speculation on real text:
            # python -m benchmarks.speculative --model DIR)
            result["note"] = f"{path.name} is not the built-in {args.shape!r}: load figures only"
        elif not args.load_figures_only:
            builtin = Model(get_config(args.shape, dtype=args.dtype))
            ckpt = Model(load_config(path, dtype=args.dtype))
            result["decode"] = bench_decode(ckpt, builtin, args)
            layers = builtin.config.num_draft_layers
            draft = Model(load_config(export(args.shape, args.dtype, Path(tmp, "d"),
                                             layers=layers), dtype=args.dtype))
            result["speculation"] = bench_spec(builtin, ckpt, draft, args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _same_shape(path: Path, args: argparse.Namespace) -> bool:
    mine, builtin = load_config(path, dtype=args.dtype), get_config(args.shape, dtype=args.dtype)
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "intermediate_size")
    return all(getattr(mine, f) == getattr(builtin, f) for f in fields)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", help="built-in shape to export (default small)")
    p.add_argument("--dtype", default="float32", help="checkpoint and compute dtype")
    p.add_argument("--dir", help="load this checkpoint instead of exporting --shape (another "
                   "model than --shape: load figures only)")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (default 3)")
    p.add_argument("--batch", type=int, default=8, help="decode batch (default 8)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--gen", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (default 3)")
    p.add_argument("--ngram", type=int, default=3, help="n-gram lookup length (default 3)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load-figures-only", action="store_true",
                   help="only the load figures (large shapes)")
    p.add_argument("--load-only", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="one JSON line")
    return p.parse_args(argv)


if __name__ == "__main__":
    ns = parse()
    if ns.load_only:
        print(json.dumps(load_once(ns.load_only, ns.dtype)))
        sys.exit(0)
    sys.exit(main(ns))
