"""Checkpoints: round trip, bitwise resume, corruption fallback, compatibility, verification
of every item, the listing."""

import json
import logging
import shutil

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import make_cfg, read_lines, restore_state_arrays, xla_flags

from jaxstep import CheckpointError, trainer
from jaxstep.cli.checkpoints import table
from jaxstep.trainer import config_run
from jaxstep.trainer.loop.callbacks import Callback
from jaxstep.trainer.store.checkpoint import Checkpointer, list_checkpoints
from jaxstep.trainer.store.run_state import RunState


@pytest.mark.slow
def test_round_trip_of_every_state_field(tmp_path):
  cfg = make_cfg(tmp_path, "train.max_steps=2")
  r, state, rs = trainer.build(cfg)
  state, _ = r.step_fn(state, jax.device_put(config_run.next_batch(r, rs)))
  state = state.replace(skipped=state.skipped + 3)
  rs = RunState(
    step=1,
    epoch=0,
    step_in_epoch=1,
    dataset_fingerprint="f",
    global_batch_size=32,
    grad_accum_steps=4,
    config_digest="d",
    jaxstep_version="0.1.0",
  )
  ckpt = Checkpointer(tmp_path / "ck", async_save=True)
  assert ckpt.save(1, state, rs.to_json())
  assert not ckpt.save(1, state, rs.to_json())  # a step is saved once
  ckpt.wait()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored, run_dict, step = ckpt.restore(abstract)
  ckpt.close()
  chex.assert_trees_all_equal(restored, state)  # params, opt_state, step, rng, skipped, scale
  assert type(restored) is type(state) and step == 1 and run_dict == rs.to_json()


class StepCounter(Callback):
  def __init__(self):
    self.steps = []

  def on_step_end(self, step, metrics, control):
    self.steps.append(step)


class StopAfter(Callback):
  def __init__(self, step):
    self.step = step

  def on_step_end(self, step, metrics, control):
    if step == self.step:
      control.stop("test stop")


@pytest.mark.slow
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
  args = ["train.max_steps=12", "train.log_every=1", "checkpoint.every=3", "model.dropout=0.1"]
  straight = trainer.train(make_cfg(tmp_path / "a", *args))
  cfg = make_cfg(tmp_path / "b", *args)
  first = trainer.train(cfg, callbacks=[StopAfter(4)])  # metrics are late: stops after step 5
  assert first.run_state.step == 5
  counter = StepCounter()
  resumed = trainer.train(cfg, callbacks=[counter])
  assert counter.steps == list(range(6, 13))  # continued from 5, did not start over
  chex.assert_trees_all_equal(resumed.state.params, straight.state.params)
  chex.assert_trees_all_equal(resumed.state.opt_state, straight.state.opt_state)
  a = [(r["step"], r["loss"]) for r in read_lines(tmp_path / "a" / "run" / "metrics.jsonl")]
  b = [(r["step"], r["loss"]) for r in read_lines(tmp_path / "b" / "run" / "metrics.jsonl")]
  assert a == b and [s for s, _ in b] == list(range(1, 13))


def corrupt(step_dir, how):
  if how == "truncated":
    for f in (step_dir / "state").rglob("d/*"):
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  elif how == "no_commit_marker":
    (step_dir / "_CHECKPOINT_METADATA").unlink()
  elif how == "garbage_metadata":
    (step_dir / "state" / "_METADATA").write_text("{not json")


@pytest.mark.parametrize("how", ["truncated", "no_commit_marker", "garbage_metadata"])
@pytest.mark.slow
# from Python too, the fallback is the logged lines only: the damaged step's failed reads
# must not echo "Event loop is closed" tracebacks
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_newest_falls_back_to_previous_loudly(tmp_path, how, caplog):
  args = ["train.max_steps=6", "checkpoint.every=2", "checkpoint.keep=5"]
  cfg = make_cfg(tmp_path, *args)
  trainer.train(cfg)
  ckpt_dir = tmp_path / "run" / "checkpoints"
  corrupt(ckpt_dir / "6", how)
  counter = StepCounter()
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    trainer.train(make_cfg(tmp_path, "train.max_steps=8", *args[1:]), callbacks=[counter])
  assert "CHECKPOINT SKIPPED: update step 6" in caplog.text
  assert counter.steps == [5, 6, 7, 8]  # restored step 4
  assert list((tmp_path / "run" / "checkpoints.corrupt").iterdir())  # set aside, not deleted
  assert all(info.problem is None for info in list_checkpoints(ckpt_dir))


@pytest.mark.slow
def test_all_checkpoints_corrupt_is_an_error_not_a_fresh_start(tmp_path):
  cfg = make_cfg(tmp_path, "train.max_steps=4", "checkpoint.every=2")
  trainer.train(cfg)
  ckpt_dir = tmp_path / "run" / "checkpoints"
  for step_dir in ckpt_dir.iterdir():
    corrupt(step_dir, "no_commit_marker")
  with pytest.raises(CheckpointError, match="none restores.*refusing to start again"):
    trainer.train(cfg)
  assert sorted(p.name for p in ckpt_dir.iterdir()) == ["2", "4"]  # nothing moved or lost


@pytest.mark.slow
def test_leftover_tmp_directories_are_cleaned(tmp_path):
  cfg = make_cfg(tmp_path, "train.max_steps=2", "checkpoint.every=1")
  trainer.train(cfg)
  ckpt_dir = tmp_path / "run" / "checkpoints"
  shutil.copytree(ckpt_dir / "2", ckpt_dir / "3.orbax-checkpoint-tmp-1234")
  trainer.train(make_cfg(tmp_path, "train.max_steps=3", "checkpoint.every=1"))
  assert sorted(p.name for p in ckpt_dir.iterdir()) == ["1", "2", "3"]


@pytest.mark.parametrize(
  "override, match",
  [
    ("model.d_model=64", "does not fit the model: parameter .* has shape"),
    ("train.global_batch_size=16", r"global_batch_size changed since the checkpoint \(32 → 16\)"),
  ],
)
@pytest.mark.slow
def test_incompatible_resume_is_a_clear_error(tmp_path, override, match):
  trainer.train(make_cfg(tmp_path, "train.max_steps=2"))
  with pytest.raises(CheckpointError, match=match):
    trainer.train(make_cfg(tmp_path, "train.max_steps=4", override))


@pytest.mark.slow
def test_changed_data_needs_the_override(tmp_path):
  trainer.train(make_cfg(tmp_path, "train.max_steps=2"))
  (tmp_path / "corpus.txt").write_text((tmp_path / "corpus.txt").read_text() + "\n\n1 + 1 = 2")
  with pytest.raises(CheckpointError, match="dataset changed.*allow_data_change=true"):
    trainer.train(make_cfg(tmp_path, "train.max_steps=4"))
  result = trainer.train(
    make_cfg(tmp_path, "train.max_steps=4", "checkpoint.allow_data_change=true")
  )
  assert result.run_state.step == 4


@pytest.mark.slow
def test_changing_k_with_the_same_g_resumes(tmp_path):
  trainer.train(make_cfg(tmp_path, "train.max_steps=2", "train.grad_accum_steps=4"))
  result = trainer.train(make_cfg(tmp_path, "train.max_steps=3", "train.grad_accum_steps=2"))
  assert result.run_state.step == 3


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
  """A run of 4 update steps with checkpoints at 2 and 4, for tests that damage a copy."""
  shared = tmp_path_factory.mktemp("four_steps")
  trainer.train(make_cfg(shared, "train.max_steps=4", "checkpoint.every=2", "train.log_every=1"))
  return shared


def copy_of(shared, tmp_path):
  shutil.copytree(shared / "run", tmp_path / "run")
  shutil.copyfile(shared / "corpus.txt", tmp_path / "corpus.txt")
  return tmp_path / "run" / "checkpoints"


def resume_from_damaged_newest(tmp_path, caplog):
  """Resumes the damaged copy to step 6: the update steps it trained."""
  counter = StepCounter()
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    trainer.train(
      make_cfg(tmp_path, "train.max_steps=6", "checkpoint.every=2"), callbacks=[counter]
    )
  return counter.steps


@pytest.mark.slow
def test_an_edited_run_state_is_not_trusted(four_steps, tmp_path, caplog):
  ckpt_dir = copy_of(four_steps, tmp_path)
  record = ckpt_dir / "4" / "run" / "metadata"
  run = json.loads(record.read_text())
  record.write_text(json.dumps({**run, "step_in_epoch": run["step_in_epoch"] - 1}))
  rows = {row.split()[0]: row for row in table(tmp_path / "run")[1:]}
  assert "INVALID: the run state changed" in rows["4"] and rows["2"].endswith("ok")
  assert resume_from_damaged_newest(tmp_path, caplog) == [3, 4, 5, 6]  # restored step 2
  assert "CHECKPOINT SKIPPED: update step 4 is unusable (the run state changed" in caplog.text


@pytest.mark.slow
def test_a_step_without_its_verify_item_is_not_trusted(four_steps, tmp_path, caplog):
  ckpt_dir = copy_of(four_steps, tmp_path)
  shutil.rmtree(ckpt_dir / "4" / "verify")
  infos = {i.step: i for i in list_checkpoints(ckpt_dir, verify=True)}
  assert "cannot be verified" in infos[4].problem and infos[2].problem is None
  assert resume_from_damaged_newest(tmp_path, caplog) == [3, 4, 5, 6]
  assert "CHECKPOINT SKIPPED: update step 4 is unusable (missing item 'verify'" in caplog.text


def test_a_step_without_a_checksum_for_a_leaf_is_not_trusted(four_steps, tmp_path):
  ckpt_dir = copy_of(four_steps, tmp_path)
  record = ckpt_dir / "4" / "verify" / "metadata"
  verify = json.loads(record.read_text())
  del verify["checksums"]["step"]
  record.write_text(json.dumps(verify))
  infos = {i.step: i for i in list_checkpoints(ckpt_dir, verify=True)}
  assert "no checksum recorded for step" in infos[4].problem


def test_the_listing_names_a_step_being_written_in_progress(four_steps, tmp_path):
  ckpt_dir = copy_of(four_steps, tmp_path)
  shutil.copytree(ckpt_dir / "4", ckpt_dir / "6.orbax-checkpoint-tmp-1234")
  (ckpt_dir / "6.orbax-checkpoint-tmp-1234" / "_CHECKPOINT_METADATA").unlink()
  rows = [row.split() for row in table(tmp_path / "run")[1:]]
  assert [(r[0], " ".join(r[4:])) for r in rows] == [("6", "in progress"), ("4", "ok"), ("2", "ok")]


@pytest.mark.slow
def test_no_resume_sets_the_old_run_aside(tmp_path):
  cfg = make_cfg(tmp_path, "train.max_steps=2")
  trainer.train(cfg)
  result = trainer.train(cfg, resume=False)
  assert result.run_state.step == 2
  previous = list((tmp_path / "run").glob("previous-*"))
  assert len(previous) == 1 and (previous[0] / "checkpoints" / "2").is_dir()


@pytest.mark.slow
def test_resume_from_another_runs_checkpoint(tmp_path):
  trainer.train(make_cfg(tmp_path, "train.max_steps=4", "checkpoint.every=2"))
  cfg = make_cfg(tmp_path, "train.max_steps=6", "run_dir=" + str(tmp_path / "other"))
  result = trainer.train(cfg, resume_from=str(tmp_path / "run" / "checkpoints" / "2"))
  assert result.run_state.step == 6
  assert [r["step"] for r in read_lines(tmp_path / "other" / "metrics.jsonl")][0] > 2


@pytest.mark.slow
def test_list_checkpoints_reports_validity(tmp_path):
  trainer.train(make_cfg(tmp_path, "train.max_steps=4", "checkpoint.every=2"))
  ckpt_dir = tmp_path / "run" / "checkpoints"
  corrupt(ckpt_dir / "4", "no_commit_marker")
  infos = {i.step: i for i in list_checkpoints(ckpt_dir)}
  assert infos[2].problem is None and infos[2].run["step"] == 2 and infos[2].size_bytes > 0
  assert "commit marker" in infos[4].problem


@pytest.mark.slow
def test_saved_state_matches_live_state(tmp_path):
  result = trainer.train(make_cfg(tmp_path, "train.max_steps=3"))
  _, saved = restore_state_arrays(tmp_path / "run")
  np.testing.assert_array_equal(saved["step"], 3)
  for a, b in zip(
    jax.tree.leaves(saved["params"]), jax.tree.leaves(result.state.params), strict=True
  ):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("save_devices, restore_devices", [(8, 1), (1, 8)])
@pytest.mark.slow
def test_restore_across_device_layouts(tmp_path, save_devices, restore_devices):
  import os
  import pathlib
  import subprocess
  import sys

  script = pathlib.Path(__file__).parent / "helpers" / "reshard.py"

  def call(mode, devices):
    env = {
      **os.environ,
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={devices}"),
    }
    proc = subprocess.run(
      [sys.executable, str(script), mode, str(tmp_path / "ck")],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout

  call("save", save_devices)
  out = call("restore", restore_devices)
  assert f"restored on {restore_devices} devices; w sharded over {restore_devices}" in out


def test_a_checkpoint_lacking_a_field_of_the_state_is_refused(tmp_path):
  """A state saved without a field the target has is an error, not filled in silently."""
  import dataclasses

  import optax
  from flax import struct

  from jaxstep import TrainState

  state = TrainState.create(params={"w": jax.numpy.ones(3)}, optimizer=optax.adam(0.1), rng=0)
  fields = [f.name for f in dataclasses.fields(TrainState) if f.name != "model_state"]
  Fewer = struct.dataclass(  # noqa: N806 - a TrainState without one field
    type("Fewer", (), {"__annotations__": dict.fromkeys(fields, object)})
  )
  with Checkpointer(tmp_path / "ck") as ckpt:
    ckpt.save(1, Fewer(**{name: getattr(state, name) for name in fields}))
  with pytest.raises(CheckpointError, match=r"the checkpoint has no \['model_state'\]"):
    Checkpointer(tmp_path / "ck").restore(state)
