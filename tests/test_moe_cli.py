"""An MoE model through the commands: ``jaxstep.train`` on two devices (data or expert
parallel), a kill -9 and resume, ``jaxstep check``, ``evaluate``, ``generate`` and
``memory``, and the settings' errors."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import read_lines, straight_and_killed
from test_cli import train_here

import jaxstep

MOE = [
  "--config", "tiny", "model.family=llama", "model.num_experts=4", "model.experts_per_token=2",
  "model.moe_intermediate_size=32", "model.d_model=64", "model.n_heads=2",
  "model.intermediate_size=96", "train.log_every=1",
]  # fmt: skip


def _train(*args, env_extra=None):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
  cmd = [sys.executable, "-m", "jaxstep.train", *MOE, *args]
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_an_moe_run_killed_with_sigkill_resumes_bitwise(tmp_path):
  # 16 steps: the kill lands well before the end even when the tiny run is quick
  args = [*MOE, "train.max_steps=16", "checkpoint.every=2", "mesh.data=2"]
  straight_and_killed(tmp_path, args, kill_at=2)
  a, b = (jaxstep.load_run(tmp_path / n) for n in ("straight", "killed"))
  assert a.step == b.step == 16
  pairs = zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True)
  assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)
  metrics = read_lines(tmp_path / "straight" / "metrics.jsonl")
  assert {"moe/lbl", "moe/z_loss", "moe/max_load", "moe/dropped"} <= set(metrics[-1])


ROUTED_LORA = [
  "model.lora.rank=4", "model.lora.targets=[q_proj,experts.gate_up_proj,experts.down_proj]",
  "train.schedule_steps=8", "checkpoint.every=2", "optim.lr=1e-2",
]  # fmt: skip


@pytest.mark.slow
def test_an_expert_parallel_run_resharded_between_meshes_equals_the_data_parallel_one(tmp_path):
  """LoRA on attention and the routed experts, ``mesh.expert=2`` through ``jaxstep train``:
  4 updates, resumed on ``mesh.data=2`` (the experts and their adapters whole on each
  device) for 2, then on ``mesh.expert=2`` again for 2, updates as the same run straight on
  ``mesh.data=2``. Each expert-parallel start shares one compilation cache: XLA:CPU
  deadlocks on an expert-parallel step loaded from the cache (until its rendezvous aborts
  the process), so such a run compiles afresh, and says so."""
  cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
  cache["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  data, expert = ["mesh.data=2"], ["mesh.expert=2", "mesh.data=1"]
  starts = [("straight", data, 8), ("moved", expert, 4), ("moved", data, 6), ("moved", expert, 8)]
  for name, mesh, steps in starts:
    run = [*ROUTED_LORA, f"train.max_steps={steps}", *mesh, f"run_dir={tmp_path / name}"]
    done = _train(*run, env_extra=cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("compilation cache: off for this run" in done.stderr) == (mesh == expert)
  straight, moved = (jaxstep.load_run(tmp_path / name) for name in ("straight", "moved"))
  assert straight.step == moved.step == 8
  flat = [
    {jax.tree_util.keystr(p): np.asarray(v, np.float64) for p, v in leaves}
    for leaves in (jax.tree_util.tree_leaves_with_path(r.params) for r in (straight, moved))
  ]
  for key, x in flat[0].items():
    y = flat[1][key]
    assert np.max(np.abs(x - y)) <= 1e-5 * max(np.max(np.abs(x)), 1e-12), key
    if "lora" not in key:  # frozen: the base weights never move, whatever the mesh
      np.testing.assert_array_equal(x, y)
  lora_b = [k for k in flat[1] if k.endswith("['experts']['gate_up']['lora']['lora_b']")]
  assert lora_b and all(np.any(flat[1][k]) for k in lora_b)


@pytest.mark.parametrize(
  "args, message",
  [
    (["model.num_experts=6", "mesh.expert=4"], "nearest that does is mesh.expert=3"),
    (["model.num_experts=0", "mesh.expert=2"], "has none (model.num_experts=0)"),
    (["model.lbl_scope=batch"], "model.lbl_scope must be one of global, micro_batch"),
    (["model.experts_per_token=9"], "model.experts_per_token must be in [1, num_experts=4]"),
  ],
)
def test_moe_settings_that_cannot_run_are_one_line(tmp_path, capsys, args, message):
  """``jaxstep train`` in this process, through the commands' dispatcher (the messages do
  not depend on the device count; ``test_cli.py`` runs the command as a process)."""
  code, _, err = train_here(capsys, *MOE, "train.max_steps=1", *args, f"run_dir={tmp_path / 'run'}")
  assert code == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], err[-2000:]
  assert "Traceback" not in err


@pytest.mark.slow
def test_check_passes_for_global_and_names_the_extra_loss_for_micro_batch(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = {}
  for scope in ("global", "micro_batch"):
    cmd = [sys.executable, "-m", "jaxstep", "check", *MOE, f"model.lbl_scope={scope}"]
    out[scope] = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert out["global"].returncode == 0, out["global"].stderr[-2000:]
  assert (
    "extra loss" in out["global"].stdout and "PASS: accumulation is exact" in out["global"].stdout
  )
  assert out["micro_batch"].returncode != 0
  assert "first divergence at 'extra loss'" in out["micro_batch"].stdout


@pytest.mark.slow
def test_an_moe_run_generates_and_evaluates(tmp_path):
  done = _train("train.max_steps=2", f"run_dir={tmp_path / 'run'}")
  assert done.returncode == 0, done.stderr[-2000:]
  text = tmp_path / "text.txt"
  text.write_text("the cat sees the dog.\n12 + 5 = 17\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  jaxstep_cmd = [sys.executable, "-m", "jaxstep"]
  run = str(tmp_path / "run")
  scored = subprocess.run(
    [*jaxstep_cmd, "evaluate", run, "--data", str(text)], env=env, capture_output=True, text=True
  )
  assert scored.returncode == 0 and "ppl" in scored.stdout, scored.stderr[-2000:]
  sampled = subprocess.run(
    [*jaxstep_cmd, "generate", run, "--prompt", "12 + 5 =", "--max-new-tokens", "4"],
    env=env,
    capture_output=True,
    text=True,
  )
  assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr[-2000:]


@pytest.mark.slow
def test_the_memory_ledger_names_the_experts_share_per_device(tmp_path):
  from conftest import devices_env

  env = devices_env(2)
  cmd = [sys.executable, "-m", "jaxstep", "memory", *MOE]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  # 2 layers × 4 experts × 3 matrices of 64 × 32
  assert "the routed experts hold 49,152 of the parameters; a micro-step routes" in done.stdout
  # tiny: 8 rows of 128 a micro-step over 2 devices: 512 tokens × 2 of 4 experts each, tiles
  # of 128: 1,024 + 4 × 127 rows in whole tiles; a capacity of 1.0 lets each expert take 64
  # of a sequence's: 4 sequences × 64 = 256 per expert, 4 × 256 rows
  assert "each device's dispatch holds 1,536 rows per MoE layer (dropless)" in done.stdout
  capped = subprocess.run([*cmd, "model.capacity_factor=1.0"], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
  assert "holds 1,024 rows per MoE layer (model.capacity_factor=1)" in capped.stdout
  # experts split over both devices: each device's 4 rows, and the expert group's 1,024
  # tokens × 2 of the 2 experts here: one row per token and expert, 2 × 1,024
  split = subprocess.run([*cmd, "mesh.expert=2", "mesh.data=1"], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
  assert split.returncode == 0, split.stderr[-2000:]
  assert "micro-batch 4 per device" in split.stdout and "expert=2" in split.stdout
  assert "each device's dispatch holds 2,048 rows per MoE layer (dropless)" in split.stdout


def test_the_ledgers_moe_line_counts_both_sequences_of_a_preference_pair():
  """A preference step runs a pair's chosen and rejected rows in one forward: twice the
  tokens through each MoE layer of a supervised step with as many rows."""
  from jaxstep.cli.memory import moe_line
  from jaxstep.trainer.config import loading as config_lib

  moe = [a for a in MOE[2:] if not a.startswith("train.")]
  sft = config_lib.load("tiny", moe)
  dpo = config_lib.load("tiny", [*moe, "preference.loss=dpo"])
  assert "routes 1,024 tokens" in moe_line(sft, 0, 1, 1)
  assert "routes 2,048 tokens" in moe_line(dpo, 0, 1, 1)
  assert "holds 5,120 rows" in moe_line(dpo, 0, 1, 1)  # 4,096 and 4 × 255 of padding: tiles of 256
