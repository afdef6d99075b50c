"""``pdkv model pages``: how many KV pages a worker's pool can have on a GPU.

A page holds ``page_size`` tokens of every layer's K and V (a draft model's layers too),
so ``bytes = 2 * layers * kv_heads * head_dim * dtype bytes * page_size``. What a GPU
has for pools is its memory less a spare share (fragmentation, other users), less each
worker's weights (as the checkpoint stores them) and its CUDA context and activations
(``--reserve-gib``). Several workers on one GPU (``pdkv serve`` on one device) share it.
"""

from __future__ import annotations

import argparse
import sys

GIB = 1 << 30


def add_parser(cmd) -> None:
    p = cmd.add_parser(
        "pages", help="how many KV pages fit a GPU's memory (--prefill-pages/--decode-pages)",
        description="Print a checkpoint's KV bytes per page and how many pages each worker's "
                    "pool can hold on a GPU of --gpu-gib: (memory * (1 - spare) - workers * "
                    "(weights + reserve)) / workers / page bytes. See docs/operations.md, "
                    "'GPU quickstart'.")
    p.add_argument("model", metavar="DIR", help="checkpoint directory (Hugging Face layout)")
    p.add_argument("--gpu-gib", type=float, required=True, metavar="GIB",
                   help="the GPU's memory in GiB (nvidia-smi's total / 1024; 79.6 for an "
                        "80 GB H100)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="workers sharing the GPU, each with its weights and pool (default 1)")
    p.add_argument("--page-size", type=int, default=16, help="slots per page (default 16)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="KV dtype (default: the checkpoint's)")
    p.add_argument("--draft-model", metavar="DIR", help="a draft checkpoint (its layers "
                   "share every page; its weights count too)")
    p.add_argument("--reserve-gib", type=float, default=4.0, metavar="GIB",
                   help="per worker: CUDA context, activations, staging (default 4)")
    p.add_argument("--spare", type=float, default=0.1,
                   help="share of the GPU left unused (default 0.1)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from common.config import ServeConfig, resolve_model
    from common.kv import DTYPE_BYTES
    from common.model import weight_files

    try:
        fields = resolve_model(args.model)
        if "model_path" not in fields:
            raise ValueError(f"{args.model!r} is a built-in model: export it first (pdkv "
                             "model export NAME DIR) or give a checkpoint directory")
        cfg = ServeConfig(**fields, dtype=args.dtype or "", page_size=args.page_size,
                          draft_model_path=args.draft_model or "",
                          spec_k=3 if args.draft_model else 0)
        paths = [cfg.model_path] + ([cfg.draft_model_path] if args.draft_model else [])
        weights = sum(f.stat().st_size for path in paths for f in weight_files(path))
        if args.dtype:  # workers cast the weights to the serving dtype as they load them
            stored = ServeConfig(**fields, spec_k=0).model_config().dtype
            weights = weights * DTYPE_BYTES[args.dtype] // DTYPE_BYTES[stored]
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdkv model pages: {exc}", file=sys.stderr)
        return 2
    layout = cfg.kv_layout()
    page = layout.page_bytes(args.page_size)
    usable = args.gpu_gib * GIB * (1 - args.spare)
    left = usable - args.workers * (weights + args.reserve_gib * GIB)
    pages = max(0, int(left / args.workers // page))
    print(f"model     {cfg.model_name} ({layout.dtype}, {layout.total_layers} layers of "
          f"{layout.num_kv_heads} KV heads x {layout.head_dim})")
    print(f"page      {args.page_size} tokens, {page / (1 << 20):.2f} MiB")
    print(f"weights   {weights / GIB:.2f} GiB per worker (its safetensors, in {layout.dtype})")
    print(f"GPU       {args.gpu_gib:g} GiB, {args.spare:.0%} spare: {usable / GIB:.1f} GiB; "
          f"less {args.workers} x (weights + {args.reserve_gib:g} GiB reserve): "
          f"{max(0.0, left) / GIB:.1f} GiB for pools")
    print(f"pages     {pages} per worker ({pages * args.page_size} tokens): "
          "--prefill-pages / --decode-pages")
    return 0 if pages > 1 else 1
