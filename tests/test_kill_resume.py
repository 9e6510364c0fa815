"""The CLI survives SIGTERM and SIGKILL: resumed runs end bitwise equal to uninterrupted ones."""

import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import SMALL_MODEL, killable, make_cfg, read_lines, restore_state_arrays

from jaxstep.trainer.store.checkpoint import list_checkpoints

ARGS = [
  *SMALL_MODEL,
  "train.max_steps=40",
  "train.log_every=1",
  "train.eval_every=0",
  "checkpoint.every=2",
  "checkpoint.keep=2",
]


def cli_args(tmp_path, name):
  make_cfg(tmp_path)  # writes the corpus
  return [
    sys.executable,
    "-m",
    "jaxstep.train",
    *ARGS,
    f"data.path={tmp_path / 'corpus.txt'}",
    f"run_dir={tmp_path / name}",
  ]


def final_arrays(run_dir):
  return restore_state_arrays(run_dir)


def assert_same_final_state(a_dir, b_dir):
  (step_a, a), (step_b, b) = final_arrays(a_dir), final_arrays(b_dir)
  assert step_a == step_b == 40
  for key in ("params", "opt_state", "step", "rng", "skipped"):
    for x, y in zip(jax.tree.leaves(a[key]), jax.tree.leaves(b[key]), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def uninterrupted_run(tmp_path) -> dict:
  """Runs the reference to the end in ``tmp_path/straight``; returns the env to reuse."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(cli_args(tmp_path, "straight"), env=env, capture_output=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return env


def metric_columns(run_dir):
  return [(r["step"], r["loss"]) for r in read_lines(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_sigterm_saves_at_the_update_boundary_and_resume_matches(tmp_path):
  env = uninterrupted_run(tmp_path)
  args = cli_args(tmp_path, "stopped")
  proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while not (tmp_path / "stopped" / "metrics.jsonl").exists() and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, stderr
  assert "stopped by SIGTERM at update step" in stderr and "re-run the same command" in stderr
  saved = [i.step for i in list_checkpoints(tmp_path / "stopped" / "checkpoints")]
  assert saved and max(saved) < 40
  done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert f"resumed from the checkpoint of update step {max(saved)}" in done.stderr
  assert_same_final_state(tmp_path / "straight", tmp_path / "stopped")
  assert metric_columns(tmp_path / "straight") == metric_columns(tmp_path / "stopped")


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_or_corrupts(tmp_path):
  began = time.monotonic()
  env = uninterrupted_run(tmp_path)
  whole = time.monotonic() - began  # a start-to-end run: kills land within its span
  args = cli_args(tmp_path, "killed")
  rng = random.Random(0)
  kills = 0
  again = args
  for _ in range(25):
    proc = subprocess.Popen(
      again, env=killable(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    if kills < 6:
      # import, compile, train or in the middle of a save: anywhere in a whole run's time
      time.sleep(rng.uniform(0.05, 0.5) * whole)  # the first run compiled: later ones start faster
      if proc.poll() is None:
        proc.kill()
        kills += 1
    _, stderr = proc.communicate(timeout=300)
    if proc.returncode == 0:
      break
    again = args
    if proc.returncode == 2 and b"no checkpoint to resume from" in stderr:
      # killed after logging an update, before its first checkpoint: nothing is lost, and the
      # run does not rewrite that history unasked; the user's way out is --no-resume
      assert all(i.in_progress for i in list_checkpoints(tmp_path / "killed" / "checkpoints"))
      again = [*args, "--no-resume"]
      continue
    assert proc.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
  assert proc.returncode == 0 and kills >= 5
  assert all(i.problem is None for i in list_checkpoints(tmp_path / "killed" / "checkpoints"))
  assert_same_final_state(tmp_path / "straight", tmp_path / "killed")
  assert metric_columns(tmp_path / "straight") == metric_columns(tmp_path / "killed")
