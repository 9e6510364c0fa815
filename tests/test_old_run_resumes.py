"""A run written by an earlier jaxstep resumes bitwise: the checkpoint format and the run dir's
files are a contract with every run already on disk, whatever the code around them became.

``fixtures/run_before_rooms`` was written by jaxstep 0.1.0 before its trainer was split into
subpackages: ``jaxstep train`` (the overrides in ``ARGS``) stopped at update 2 with a
checkpoint there; ``state_at_2.npz`` holds every leaf of that state as that version read it
back, and ``straight_metrics.jsonl`` the metrics of the same run carried straight to 4.
That version held the GPT's fused q/k/v columns as ``[q | k | v]``: they read back
head-major, and the resume continues the run as it would have gone.
"""

import json
import pathlib
import shutil

import jax
import numpy as np
from conftest import SMALL_MODEL, restore_state_arrays

from jaxstep.cli import train as train_cli
from jaxstep.core.trees import key_name
from jaxstep.models import gpt, hf_gpt2

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "run_before_rooms"
ARGS = [
  *SMALL_MODEL,
  "train.schedule_steps=8",
  "train.log_every=1",
  "train.eval_every=0",
  "checkpoint.every=2",
  "checkpoint.keep=5",
  "data.path=corpus.txt",
  "train.global_batch_size=8",
  "train.grad_accum_steps=2",
]


def metrics(path: pathlib.Path) -> dict[int, dict]:
  return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_a_run_written_before_the_split_resumes_bitwise(tmp_path, monkeypatch):
  shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
  monkeypatch.chdir(tmp_path)

  step, state = restore_state_arrays(tmp_path / "run", 2)
  saved = np.load(tmp_path / "state_at_2.npz")
  leaves = dict(jax.tree_util.tree_leaves_with_path(state))
  assert step == 2 and {jax.tree_util.keystr(p) for p in leaves} == set(saved.files)
  for path, leaf in leaves.items():
    got, want = np.asarray(leaf), saved[jax.tree_util.keystr(path)]
    if hf_gpt2.permuted(tuple(key_name(k) for k in path)) and want.shape[-1] == 3 * 32:
      want = gpt.head_major(want, n_heads=2)  # SMALL_MODEL: d_model 32, 2 heads
    assert got.dtype == want.dtype and got.shape == want.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))

  assert train_cli.main([*ARGS, "train.max_steps=4", "run_dir=run"]) == 0

  resumed, straight = (
    metrics(tmp_path / "run" / "metrics.jsonl"),
    metrics(FIXTURE / "straight_metrics.jsonl"),
  )
  assert sorted(resumed) == [1, 2, 3, 4]
  for s in (3, 4):
    # the same samples (the data position came back) and the same update on any CPU: the
    # fixture's numbers were computed on another machine, so the last bits may differ
    assert resumed[s]["tokens"] == straight[s]["tokens"]
    np.testing.assert_allclose(resumed[s]["lr"], straight[s]["lr"], rtol=1e-6)
    np.testing.assert_allclose(resumed[s]["loss"], straight[s]["loss"], rtol=1e-4)
  # steps 1-2 were written before the stop and are kept as they were
  assert resumed[2] == straight[2] | {
    k: resumed[2][k] for k in ("tokens_per_sec", "mfu", "step_time")
  }


def test_a_fresh_run_of_the_same_seed_trains_as_that_version_did(tmp_path, monkeypatch):
  """The seed draws the same model it drew then: the GPT's q/k/v columns are drawn in the
  old order and laid head-major, so the same function. A fresh run of the fixture's
  command gives its 4 losses (to another machine's rounding)."""
  shutil.copy(FIXTURE / "corpus.txt", tmp_path / "corpus.txt")
  monkeypatch.chdir(tmp_path)
  assert train_cli.main([*ARGS, "train.max_steps=4", "run_dir=run"]) == 0
  fresh = metrics(tmp_path / "run" / "metrics.jsonl")
  straight = metrics(FIXTURE / "straight_metrics.jsonl")
  assert sorted(fresh) == [1, 2, 3, 4]
  for s in fresh:
    assert fresh[s]["tokens"] == straight[s]["tokens"]
    np.testing.assert_allclose(fresh[s]["loss"], straight[s]["loss"], rtol=1e-4)
