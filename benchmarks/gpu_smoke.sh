#!/usr/bin/env bash
# The GPU check (about 8 minutes on one H200; cases started after 390 s are skipped and
# named): gpt2-124m and gpt-1.3b in bf16 with cuDNN vs XLA attention and remat on/off, and a
# 1.08 B Llama (model.family=llama: Llama 3.2 1B's blocks, 32 query / 8 key-value heads) in
# bf16 with cuDNN attention and remat block — tokens/s, MFU against 989 TFLOP/s, peak
# memory, the K that grad_accum_steps=auto chose — and the orbax checkpoint round trip
# (GPU → GPU bitwise and one identical step after it, GPU → CPU bitwise). Prints one JSON
# line on stdout (per-case lines on stderr); exit 1 if a round trip is not bitwise.
# Usage: bash benchmarks/gpu_smoke.sh [--steps N] [--models NAME…] [--out FILE]
#   (pip install -e '.[cuda12]'; --models: gpt2-124m gpt-1.3b llama-1b)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpu_smoke --out "${OUT:-benchmarks/results/gpu_smoke.json}" "$@"
