#!/usr/bin/env bash
# Capture the fixed CUDA configurations (validation/cuda/configs.toml) on one GPU and compare memsim with them.
#
#   validation/cuda/run.sh [OUT_DIR]        (default: validation/data/cuda; PYTHON=... picks the interpreter)
#
# Per configuration: 3 warm-up steps, 10 steps timed with CUDA events, 2 profiled steps (per-op kernel time),
# then one step under torch.cuda.memory._record_memory_history (allocated and reserved memory, segments).
# Writes OUT_DIR/timing/*.json, OUT_DIR/memory/*.json, OUT_DIR/compare.txt and OUT_DIR/plots/*.png.
# Budget: the capture is stopped after 270 s (six GPT-2-small/LLaMA-160M configurations take about one
# minute on an A100/H100); whatever finished is kept. Needs: a CUDA build of torch 2.13, `pip install -e .`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/validation/data/cuda}"
python="${PYTHON:-python}"
cd "$root"

"$python" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("run.sh: torch is not installed (pip install 'memsim[validation]' with a CUDA build of torch)")
if not torch.cuda.is_available():
    sys.exit(f"run.sh: torch {torch.__version__} sees no CUDA device; run this on a machine with a GPU")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)
PY

mkdir -p "$out"
start=$(date +%s)
status=0
timeout --signal=INT 270 "$python" -m validation.capture --device cuda --configs "$here/configs.toml" \
    --out "$out" --warmup 3 --repetitions 10 --profiled 2 || status=$?
echo "capture finished with status $status after $(( $(date +%s) - start )) s" >&2

if ls "$out"/memory/*.json >/dev/null 2>&1; then
    "$python" -m validation.compare "$out" --out "$out/plots" | tee "$out/compare.txt" || status=$?
fi
echo "total $(( $(date +%s) - start )) s; files under $out" >&2
exit "$status"
