#!/usr/bin/env bash
# Capture the fixed CUDA configurations (validation/cuda/configs.toml) on one GPU and compare memsim with them.
#
#   validation/cuda/run.sh [OUT_DIR]        (default: validation/data/cuda; PYTHON=... picks the interpreter)
#
# Per configuration, in its own process: the allocator's history (torch.cuda.memory._record_memory_history)
# from the model build through 3 warm-up steps and one measured step (allocated and reserved memory,
# segments); then 3 warm-up steps, 10 steps timed with CUDA events, 2 profiled steps (per-op kernel time).
# Writes OUT_DIR/timing/*.json, OUT_DIR/memory/*.json, OUT_DIR/compare.txt and OUT_DIR/plots/*.png.
# Budget: the capture is stopped after 270 s (the eight configurations took 51 s on one H200 in one process);
# whatever finished is kept. Needs: a CUDA build of torch (the committed data: 2.11) and memsim's dependencies.
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
# One process per configuration: the allocator's reserved memory (and the cuBLAS workspace) then belong to
# that configuration alone, as in a user's training run. The whole capture stops after 270 s.
names=$("$python" -c 'import sys, tomllib; print(" ".join(tomllib.load(open(sys.argv[1], "rb"))))' "$here/configs.toml")
for name in $names; do
    left=$(( 270 - ($(date +%s) - start) ))
    if (( left <= 0 )); then echo "capture budget spent; skipping $name" >&2; status=124; continue; fi
    timeout --signal=INT "$left" "$python" -m validation.capture --device cuda --configs "$here/configs.toml" \
        --only "$name" --out "$out" --warmup 3 --repetitions 10 --profiled 2 || status=$?
done
echo "capture finished with status $status after $(( $(date +%s) - start )) s" >&2

if ls "$out"/memory/*.json >/dev/null 2>&1; then
    "$python" -m validation.compare "$out" --out "$out/plots" | tee "$out/compare.txt" || status=$?
fi
echo "total $(( $(date +%s) - start )) s; files under $out" >&2
exit "$status"
