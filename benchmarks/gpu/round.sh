#!/usr/bin/env bash
# The GPU round: every check that needs a CUDA machine, in one run of at most 9 minutes.
#   bash benchmarks/gpu/wheels.sh          # once, on a machine that can download
#   bash benchmarks/gpu/round.sh           # on the GPU machine, from the repository root
# It needs the image's python3 (or $PYTHON) with CUDA torch, and .whl/ (pyzmq, NIXL)
# beside it. Each step has its own time limit and the round goes on past a failed step;
# the figures land in $OUT (default ./gpu-out) as JSON, with round.log. A failed step (a
# test, or a goal a bench judges: no --report-only there) makes the round exit 1. Steps:
#   1. the CUDA tests: frames from and into GPU pools, NIXL VRAM (tests marked for CUDA);
#      the engine's (tests/test_engine_devices.py): its steps under
#      torch.cuda.set_sync_debug_mode("error"), a CUDA graph's replay against the eager
#      pass, the bf16 paged runner (flex attention) against a float32 reference
#   2. pdkv bench transfer --device: tcp frames (staged through host memory) and NIXL
#      (VRAM to VRAM, integrity on against off), 1k/8k/32k tokens; NIXL is judged:
#      >= 0.9x raw NIXL VRAM to VRAM at 8k and 32k (the step's exit status says)
#   3. pdkv bench spec on llama-1b-shape: speculation, prefix reuse (in process and
#      served 1P1D), host offload from GPU pages
#   4. pdkv bench serve on llama-1b-shape: 1P1D against two colocated workers, a rate
#      sweep, every worker on the one GPU
#   5. pdkv bench step on llama-1b-shape bf16: the in-process decode step at batch 8 and
#      64 against its bandwidth floor (goal <= 2x, judged)
# DEVICE=cpu QUICK=1 MODEL=tiny PYTHON=.venv/bin/python runs the same steps on a CPU
# machine, small (a check of the script itself).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
DEVICE=${DEVICE:-cuda:0}
QUICK=${QUICK:-}
MODEL=${MODEL:-llama-1b-shape}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/round.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -d .whl ] && ! "$PY" -c "import zmq" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  "$PY" -c "import zipfile, glob
for z in glob.glob('.whl/*-slim.zip'): zipfile.ZipFile(z).extractall('/tmp/site')"
fi
"$PY" - <<'PY'
import torch, zmq
from transport import nixl
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices",
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("pyzmq", zmq.__version__, "| NIXL:", nixl.import_error() or "importable")
PY

failed=()
step() {  # step NAME SECONDS COMMAND...: stdout to $OUT/NAME.json, with a time limit
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.json"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" = 0 ] || failed+=("$name")
}
if [ -n "$QUICK" ]; then
  sizes=(1024 8192); spec=(--quick); serve=(--quick --rates 4 16); engine=(--quick)
else
  sizes=(1024 8192 32768); spec=(--repeats 3); serve=(--rates 4 16 64 --requests 32 --repeats 1)
  engine=(--batch 8 64)
fi

# the limits add up to 515 s: the round fits one 10-minute command with its set-up. On
# the first H200 round (2026-12-04) the steps took 29, 43, 30, 108 and 73 s (before the
# engine's tests and bench step were added)
echo "== tests ($(date +%T))"
timeout --kill-after=10 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_pool_view.py \
  tests/test_transport_procs.py tests/test_transport_nixl.py tests/test_page_copy.py \
  tests/test_digest.py -k "gpu or vram or staged"
rc=$?; echo "== tests: exit $rc"; [ "$rc" = 0 ] || failed+=(tests)
echo "== engine tests ($(date +%T))"
timeout --kill-after=10 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_devices.py
rc=$?; echo "== engine tests: exit $rc"; [ "$rc" = 0 ] || failed+=(engine-tests)
step transfer-tcp 45 "$PY" -m deploy.cli bench transfer --device "$DEVICE" --json \
  --report-only --transports tcp --sizes "${sizes[@]}" --repeats 3
step transfer-nixl 60 "$PY" -m deploy.cli bench transfer --device "$DEVICE" --json \
  --transports nixl --sizes "${sizes[@]}" --repeats 3
step spec 115 "$PY" -m deploy.cli bench spec --device "$DEVICE" --model "$MODEL" --json \
  --report-only "${spec[@]}"
step serve 75 "$PY" -m deploy.cli bench serve --devices "$DEVICE" --model "$MODEL" \
  --json --report-only --plot "$OUT/serve.png" "${serve[@]}"
step engine-step 60 "$PY" -m benchmarks.step --device "$DEVICE" --model "$MODEL" --json \
  "${engine[@]}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null || true
if [ ${#failed[@]} -gt 0 ]; then
  echo "== round: FAILED: ${failed[*]}"
  exit 1
fi
echo "== round: every step passed"
