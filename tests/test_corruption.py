"""Checkpoints damaged in place (bytes, checksums, manifests) are caught and skipped for the
newest intact one, by training, resuming, ``checkpoints``, ``generate`` and ``load_run``;
and the readers of what a kill leaves (a cut metrics line, bad-batch dumps) cope."""

import pathlib

import pytest
from conftest import make_cfg
from fault_helpers import SMALL

# Each of these trains, kills or mounts: the whole file is in the slow tier (CI runs it).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
  """One run of 4 update steps with checkpoints at 2 and 4, trained once for the tests
  that damage or read a copy of it."""
  from jaxstep import trainer

  shared = tmp_path_factory.mktemp("four_steps")
  trainer.train(make_cfg(shared, "train.max_steps=4", "checkpoint.every=2", "train.log_every=1"))
  return shared


def copy_of(shared: pathlib.Path, tmp_path: pathlib.Path) -> None:
  """``tmp_path/run`` and ``tmp_path/corpus.txt`` as copies of the shared run."""
  import shutil

  shutil.copytree(shared / "run", tmp_path / "run")
  shutil.copyfile(shared / "corpus.txt", tmp_path / "corpus.txt")


def zero_bytes_in_largest_file(step_dir: pathlib.Path) -> None:
  largest = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  middle = len(data) // 2
  data[middle : middle + 8] = bytes(8)
  largest.write_bytes(bytes(data))


def test_bytes_changed_in_place_are_caught_and_the_run_falls_back(four_steps, tmp_path, caplog):
  import logging

  from jaxstep import trainer
  from jaxstep.trainer.store.records import read_records

  copy_of(four_steps, tmp_path)
  zero_bytes_in_largest_file(tmp_path / "run" / "checkpoints" / "4")
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    result = trainer.train(make_cfg(tmp_path, "train.max_steps=6", "checkpoint.every=2"))
  assert "CHECKPOINT SKIPPED: update step 4" in caplog.text
  assert result.run_state.step == 6
  records = read_records(tmp_path / "run" / "metrics.jsonl")
  assert all(r["updated"] for r in records) and all(r["loss"] < 10 for r in records)


def test_a_checksum_mismatch_names_the_leaf():
  import jax.numpy as jnp

  from jaxstep.trainer.store import integrity

  state = {"w": jnp.arange(1000, dtype=jnp.float32), "b": jnp.ones(3, jnp.bfloat16)}
  saved = integrity.checksums(state)
  assert integrity.mismatch(state, saved) is None
  changed = {**state, "w": state["w"].at[500:502].set(0.0)}
  assert "w changed since it was saved" in integrity.mismatch(changed, saved)
  swapped = {**state, "w": state["w"][::-1]}  # same bytes, other places
  assert integrity.mismatch(swapped, saved) is not None
  assert "w holds NaN" in integrity.nonfinite({"w": state["w"].at[3].set(jnp.nan)})


def test_resume_from_a_read_only_source_with_a_corrupt_newest_step(
  four_steps, tmp_path, tmpfs, caplog
):
  import logging
  import shutil

  from jaxstep import trainer

  copy_of(four_steps, tmp_path)
  source = tmpfs("64m")
  shutil.copytree(tmp_path / "run", source / "run")
  zero_bytes_in_largest_file(source / "run" / "checkpoints" / "4")
  tmpfs.read_only(source)
  listing = sorted(str(p) for p in source.rglob("*"))
  cfg = make_cfg(tmp_path, "train.max_steps=6", f"run_dir={tmp_path / 'other'}")
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    result = trainer.train(cfg, resume_from=str(source / "run"))
  assert "CHECKPOINT SKIPPED: update step 4" in caplog.text and result.run_state.step == 6
  assert sorted(str(p) for p in source.rglob("*")) == listing  # nothing moved there


def test_resume_from_leaves_a_writable_source_untouched(four_steps, tmp_path):
  from jaxstep import trainer

  copy_of(four_steps, tmp_path)
  zero_bytes_in_largest_file(tmp_path / "run" / "checkpoints" / "4")
  listing = sorted(str(p) for p in (tmp_path / "run").rglob("*"))
  cfg = make_cfg(tmp_path, "train.max_steps=6", f"run_dir={tmp_path / 'other'}")
  assert trainer.train(cfg, resume_from=str(tmp_path / "run")).run_state.step == 6
  assert sorted(str(p) for p in (tmp_path / "run").rglob("*")) == listing


def test_the_checkpoints_command_reports_bytes_changed_in_place(four_steps, tmp_path, capsys):
  from jaxstep.cli import checkpoints

  copy_of(four_steps, tmp_path)
  zero_bytes_in_largest_file(tmp_path / "run" / "checkpoints" / "4")
  assert checkpoints.main([str(tmp_path / "run")]) == 0
  rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
  assert rows["2"].endswith("ok")
  # the zeroed bytes land on raw array data (a checksum mismatch) or, as the arrays' order
  # in orbax's data file varies from save to save, on what the reader decodes (unreadable)
  assert "INVALID" in rows["4"]
  assert "checksum mismatch" in rows["4"] or "unreadable" in rows["4"]


def test_a_corrupt_checkpoint_manifest_falls_back_without_noise(four_steps, tmp_path):
  import subprocess
  import sys

  copy_of(four_steps, tmp_path)
  for manifest in (tmp_path / "run" / "checkpoints" / "4").rglob("manifest.ocdbt"):
    manifest.write_bytes(b"\0" * manifest.stat().st_size)
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxstep.train",
      *SMALL,
      "train.schedule_steps=64",
      "train.max_steps=6",
      "checkpoint.every=2",
      f"data.path={tmp_path / 'corpus.txt'}",
      f"run_dir={tmp_path / 'run'}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "CHECKPOINT SKIPPED: update step 4" in proc.stderr
  assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr


def test_generate_skips_a_checkpoint_whose_params_changed_in_place(four_steps, tmp_path, caplog):
  import json
  import logging

  from jaxstep import load_run

  copy_of(four_steps, tmp_path)
  # the params' bytes and their recorded checksum disagree (as if the bytes changed)
  record = tmp_path / "run" / "checkpoints" / "4" / "verify" / "metadata"
  saved = json.loads(record.read_text())
  saved["checksums"]["params/embed/embedding"][0] ^= 1
  record.write_text(json.dumps(saved))
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    saved = load_run(tmp_path / "run")
  assert saved.step == 2 and "checksum mismatch" in caplog.text


def test_checksums_on_the_host_equal_those_on_a_device_mesh():
  """The numpy path (CPU arrays held whole) and the jitted path (sharded arrays, any
  device) compute the same sums, so a checkpoint saved one way verifies the other way."""
  import subprocess
  import sys

  from conftest import devices_env

  code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxstep.trainer.store import integrity
state = {
  "w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) / 7,
  "b": jnp.ones(8, jnp.bfloat16),
  "n": jnp.arange(6, dtype=jnp.int32),
  "k": jax.random.PRNGKey(3),
  "f": jnp.array([True, False]),
}
host = integrity.checksums(state)
mesh = jax.make_mesh((4,), ("x",))
sharded = dict(state, w=jax.device_put(state["w"], NamedSharding(mesh, P("x"))))
device = {k: [int(v) for v in integrity._sums([x])][0] for k, x in sharded.items()}
assert {k: v[0] for k, v in host.items()} == device, (host, device)
print("same")
"""
  proc = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=devices_env(4)
  )
  assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr[-2000:]


def test_plot_and_checkpoints_read_a_metrics_file_with_a_cut_last_line(
  four_steps, tmp_path, capsys
):
  from jaxstep.cli import checkpoints, plot

  copy_of(four_steps, tmp_path)
  with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
    f.write('{"step": 5, "lo')
  assert plot.main([str(tmp_path / "run")]) == 0
  assert checkpoints.main([str(tmp_path / "run")]) == 0
  assert "Traceback" not in capsys.readouterr().err


def test_check_refuses_a_batch_without_loss_tokens():
  import jax.numpy as jnp
  import optax
  from conftest import regression_loss

  from jaxstep import EmptyBatchError, check_accumulation

  params = {"w": jnp.ones(())}
  batch = {"x": jnp.ones((4,)), "y": jnp.ones((4,)), "loss_mask": jnp.zeros((4,))}
  with pytest.raises(EmptyBatchError, match="no loss-masked tokens"):
    check_accumulation(regression_loss, params, batch, optax.sgd(0.1), 2)


def test_bad_batch_positions_are_strict_json(tmp_path):
  import json

  from jaxstep import trainer

  trainer.train(make_cfg(tmp_path, "train.max_steps=3", "train.debug_nan_step=2"))
  text = (tmp_path / "run" / "bad_batches" / "step_00000002.json").read_text()
  record = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text}"))
  assert record["loss"] == "nan"
