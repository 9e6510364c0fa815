"""Suites that time the training loop itself (``loop_bench``'s and ``memory_bench``'s
workers): host overhead per update step, document masking's cost, checkpoint stalls, and
fsdp's per-device state."""

from __future__ import annotations

from benchmarks.harness import Worker, fmt, measure, ratio_stats

# --quick: the tiny config shrunk to one 32-wide block, 8 × 32 tokens in 2 micro-steps, no
# warm-up, and 4 update steps in every loop (the lr schedule spans the run: runs of one length
# share their compiled train step)
QUICK_TINY = [
  "model.d_model=32",
  "model.n_layers=1",
  "model.n_heads=2",
  "model.max_seq_len=32",
  "train.seq_len=32",
  "train.global_batch_size=8",
  "train.grad_accum_steps=2",
  "optim.warmup_steps=0",
]
QUICK_STEPS = 4


def suite_host_overhead(quick: bool) -> dict:
  """Host-side overhead per update step on the tiny config (data, dispatch, read-back and
  the loop's hooks), without and with an MLflow tracker logging every update step."""
  spec = {"kind": "loop", "config": "tiny", "steps": QUICK_STEPS if quick else 30}
  if quick:
    spec["overrides"] = QUICK_TINY
  tracked = {
    **spec,
    "overrides": [
      *spec.get("overrides", []),
      "train.trackers=[jsonl, tensorboard, mlflow]",
      "train.log_every=1",
    ],
  }
  specs = {
    "real": spec,
    "noop": {**spec, "noop": True},
    "real_mlflow": tracked,
    "noop_mlflow": {**tracked, "noop": True},
  }
  res, _, _ = measure(specs, rounds=1 if quick else 10)

  def overhead(suffix: str) -> dict:
    real = [r["median_step"] for r in res[f"real{suffix}"]]
    return ratio_stats([r["median_step"] for r in res[f"noop{suffix}"]], real)

  stats, mlflow = overhead(""), overhead("_mlflow")
  return {
    "spec": spec,
    "raw": res,
    "host_overhead_over_step": stats,
    "host_overhead_mlflow_over_step": mlflow,
    "summary": {
      "host_overhead_over_step": stats["median"],
      "host_overhead_mlflow_over_step": mlflow["median"],
    },
    "rows": [
      ("host overhead per update step ÷ step time (tiny)", fmt(stats), "≤ 0.02"),
      ("the same with MLflow logging every update step", fmt(mlflow), "≤ 0.03"),
    ],
  }


def suite_doc_mask(quick: bool) -> dict:
  """Step time with document masking ÷ without: the small config on packed text, blocked
  CPU attention (the segment-id compare inside its blocks and the two extra batch fields)."""
  spec = {"kind": "loop", "config": "tiny" if quick else "small"}
  spec["steps"] = QUICK_STEPS if quick else 12
  shape = QUICK_TINY if quick else []
  specs = {
    "plain": {**spec, "overrides": [*shape, "data.document_mask=false"]},
    "masked": {**spec, "overrides": [*shape, "data.document_mask=true"]},
  }
  res, _, _ = measure(specs, rounds=1 if quick else 8)
  stats = ratio_stats(
    [r["median_step"] for r in res["masked"]], [r["median_step"] for r in res["plain"]]
  )
  return {
    "spec": spec,
    "raw": res,
    "doc_mask_step_over_plain": stats,
    "summary": {"doc_mask_step_over_plain": stats["median"]},
    "rows": [
      (
        f"step time with document masking ÷ without ({spec['config']}, blocked)",
        fmt(stats),
        "≤ 1.15",
      )
    ],
  }


def suite_checkpoint(quick: bool) -> dict:
  """Loop stall per checkpoint save, async vs sync, and save/restore MB/s."""
  config = "tiny" if quick else "small"
  steps, every = (QUICK_STEPS, 2) if quick else (12, 4)
  base = {"kind": "loop", "config": config, "steps": steps}
  if quick:
    base["overrides"] = QUICK_TINY
  specs = {
    "none": {**base, "rates": True},
    "async": {**base, "save_every": every, "async_save": True},
    "sync": {**base, "save_every": every, "async_save": False},
  }
  res, info, _ = measure(specs, rounds=1 if quick else 6)
  step = [r["median_step"] for r in res["none"]]
  out = {"spec": base, "every": every, "raw": res, "rates": info["none"]}
  rows = []
  for mode in ("async", "sync"):
    stall = [
      (x["total"] - n["total"]) / x["saves"] for x, n in zip(res[mode], res["none"], strict=True)
    ]
    out[f"stall_{mode}"] = ratio_stats(stall, step)
    blocking = [x["blocking_per_save"] for x in res[mode]]
    out[f"blocking_{mode}"] = ratio_stats(blocking, [x["median_step"] for x in res[mode]])
    rows.append(
      (
        f"loop stall per {mode} save ÷ step time ({config}), across runs",
        fmt(out[f"stall_{mode}"]),
        "",
      )
    )
    rows.append(
      (
        f"step blocked per {mode} save ÷ step time ({config}), within a run",
        fmt(out[f"blocking_{mode}"]),
        "≤ 0.10" if mode == "async" else "",
      )
    )
  rates = info["none"]
  rows.append(
    (
      f"save / restore MB/s ({rates['state_mb']:.1f} MB state)",
      f"{rates['save_mb_per_s']:.0f} / {rates['restore_mb_per_s']:.0f}",
      "",
    )
  )
  out["summary"] = {
    "ckpt_stall_over_step": out["blocking_async"]["median"],
    "ckpt_stall_across_runs_over_step": out["stall_async"]["median"],
    "ckpt_save_mb_per_s": rates["save_mb_per_s"],
    "ckpt_restore_mb_per_s": rates["restore_mb_per_s"],
  }
  out["rows"] = rows
  return out


def suite_fsdp_memory(quick: bool) -> dict:
  """Per-device params + optimizer state bytes for fsdp = 1, 2, 4, 8 on 8 CPU devices."""
  model = (
    {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16}
    if quick
    else {"d_model": 256, "n_layers": 4, "n_heads": 8, "max_seq_len": 128}
  )
  w = Worker(
    {"kind": "fsdp_memory", "model": model},
    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
  )
  info = w.info  # the worker measures while it builds; read before closing it
  w.close()
  rows = info["rows"]
  table = [
    (
      f"params + optimizer state per device, fsdp={r['fsdp']} ({info['num_params']:,} params)",
      f"{r['state_bytes_per_device'] / 2**20:.2f} MiB "
      f"(×{r['state_ratio_vs_fsdp1']:.3f}; compiled args "
      f"{r['argument_bytes'] / 2**20:.2f} MiB)",
      f"≈ {1 / r['fsdp']:.3f}",
    )
    for r in rows
  ]
  return {
    "model": model,
    **info,
    "rows": table,
    "fsdp_rows": rows,
    "summary": {f"fsdp{r['fsdp']}_state_ratio": r["state_ratio_vs_fsdp1"] for r in rows},
  }
