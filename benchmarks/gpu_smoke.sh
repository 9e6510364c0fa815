#!/usr/bin/env bash
# GPU smoke benchmark: a ~127 M and a ~1.2 B bf16 GPT, ~50 update steps each, on one CUDA
# host. Prints tokens/s, step time and MFU against 989 TFLOP/s (H100/H200 SXM dense bf16).
# Usage: bash benchmarks/gpu_smoke.sh [STEPS]   (needs: pip install -e '.[cuda12]')
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-50}
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_smoke}
COMMON=(--config gpt-350m-gpu --no-resume "train.max_steps=$STEPS" train.log_every=5
        train.eval_every=0 data.eval_fraction=0 checkpoint.every=0 train.peak_tflops=989
        train.progress=false)

run() {  # name, then overrides
  local name=$1; shift
  "$PY" -m jaxstep.train "${COMMON[@]}" "run_dir=$OUT/$name" "$@"
  "$PY" - "$OUT/$name/metrics.jsonl" "$name" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][2:]  # drop compile-time steps
tps = statistics.median(r["tokens_per_sec"] for r in rows)
print(f"{sys.argv[2]}: {tps:,.0f} tokens/s, step {statistics.median(r['step_time'] for r in rows):.3f} s, "
      f"MFU {statistics.median(r['mfu'] for r in rows):.1%} of 989 TFLOP/s, loss {rows[-1]['loss']:.3f}")
PYEOF
}

"$PY" -c "import jax; print(jax.devices())"
run gpt-127m model.d_model=768 model.n_layers=18 model.n_heads=12 train.global_batch_size=64 \
  train.grad_accum_steps=2
run gpt-1.2b model.d_model=2048 model.n_layers=24 model.n_heads=16 train.global_batch_size=32 \
  train.grad_accum_steps=4
