#!/usr/bin/env bash
# The GPU check (about 8 minutes on one H200): gpt2-124m and gpt-1.3b in bf16 with cuDNN vs
# XLA attention and remat on/off — tokens/s, MFU against 989 TFLOP/s, peak memory, the K
# that grad_accum_steps=auto chose — and the orbax checkpoint round trip (GPU → GPU bitwise
# and one identical step after it, GPU → CPU bitwise). Prints one JSON line on stdout
# (per-case lines on stderr); exit 1 if a round trip is not bitwise.
# Usage: bash benchmarks/gpu_smoke.sh [--steps N] [--out FILE]  (pip install -e '.[cuda12]')
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpu_smoke --out "${OUT:-benchmarks/results/gpu_smoke.json}" "$@"
