#!/usr/bin/env bash
# Prepare, on this (CPU) machine, the Python packages that a lent GPU machine lacks, for
# benchmarks/gpu/round.sh. That machine's image has torch (CUDA), numpy, msgpack,
# safetensors, tokenizers, jinja2, prometheus-client and pytest, but not pyzmq or NIXL,
# and it cannot download. Writes .whl/ (ignored by git; carry it with the run):
#   pyzmq-*.whl              as published (cp312, manylinux x86-64)
#   nixl_cu13-slim.zip       NIXL for CUDA 13 (the image's torch is cu130) without its
#                            expert-parallel kernels and C++ headers: 56 MiB -> 29 MiB,
#                            under the 64 MiB that a run may carry
# round.sh unpacks both into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl pyzmq==27.3.0 nixl-cu13==1.5.1
python3 - <<'PY'
import glob, zipfile
src = glob.glob(".whl/nixl_cu13-*.whl")[0]
with zipfile.ZipFile(src) as whl, zipfile.ZipFile(".whl/nixl_cu13-slim.zip", "w",
                                                   zipfile.ZIP_DEFLATED) as out:
    for item in whl.infolist():
        top = item.filename.split("/")[0]
        if top.startswith("nixl_ep_") or top.endswith(".data"):
            continue  # expert-parallel kernels (3 x 31 MB) and headers: pdkv uses neither
        out.writestr(item, whl.read(item))
PY
rm -f .whl/nixl_cu13-*.whl
du -sh .whl/*
