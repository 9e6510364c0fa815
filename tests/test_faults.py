"""Faults a hostile-but-realistic user meets: invalid values, unreadable files, full disks,
two runs on one run_dir, checkpoints corrupted in place, changed configs on resume. Each
must end in one ``error:`` line, a documented exit code, no hang, and nothing lost."""

import os
import pathlib

import pytest
from conftest import SMALL_MODEL, can_mount, killable, make_cfg, remount_read_only_when_free

from jaxstep.cli import train as train_cli

# The fault suite trains, kills and mounts: all of it is in the slow tier (CI runs it).
pytestmark = pytest.mark.slow

SMALL = [*SMALL_MODEL, "train.sample_every=0"]

INVALID = {
  "optim.lr=nan": "'optim.lr' must be a finite number",
  "optim.lr=inf": "'optim.lr' must be a finite number",
  "optim.b2=1.5": "optim.b2 must be in [0, 1)",
  "optim.eps=-1": "optim.eps must be > 0",
  "optim.weight_decay=-5": "optim.weight_decay must be >= 0",
  "train.spike_factor=-1": "train.spike_factor must be 0 (off) or > 1",
  "mesh.cpu_devices=-2": "mesh.cpu_devices must be >= 0",
  "mesh.data=0": "mesh.data must be >= 1 or -1",
  "train.max_consecutive_skips=-1": "train.max_consecutive_skips must be >= 0",
  "run_dir=": "run_dir is empty",
  "data.path=": "data.path is empty",
}


def one_error(capsys) -> str:
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in err, err
  return errors[0]


@pytest.mark.parametrize("override", sorted(INVALID))
def test_an_invalid_value_exits_2_naming_the_key_and_writes_nothing(
  tmp_path, monkeypatch, capsys, override
):
  monkeypatch.chdir(tmp_path)
  args = [override] if override.startswith("run_dir") else [override, "run_dir=r"]
  assert train_cli.main(args) == 2
  assert INVALID[override] in one_error(capsys)
  assert list(tmp_path.iterdir()) == []


def test_an_unreadable_config_file_is_one_line(tmp_path, capsys):
  assert train_cli.main(["--config", str(tmp_path)]) == 2
  assert "cannot be read (Is a directory)" in one_error(capsys)
  bad = tmp_path / "latin1.yaml"
  bad.write_bytes(b"train:\n  seed: \xff\n")
  assert train_cli.main(["--config", str(bad)]) == 2
  assert "latin1.yaml: not UTF-8 text" in one_error(capsys)
  from jaxstep.cli import memory

  assert memory.main(["--config", str(bad)]) == 2
  assert "latin1.yaml: not UTF-8 text" in one_error(capsys)


def test_home_and_environment_variables_expand_in_paths(tmp_path, monkeypatch):
  from jaxstep.trainer import config as config_lib

  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.setenv("RUNS", "/data/runs")
  cfg = config_lib.load(None, ["run_dir=~/a", "data.path=$RUNS/corpus.txt"])
  assert cfg.run_dir == f"{tmp_path}/a" and cfg.data.path == "/data/runs/corpus.txt"
  yaml_file = tmp_path / "c.yaml"
  yaml_file.write_text("run_dir: ~/from-yaml\n")
  assert config_lib.load(yaml_file).run_dir == f"{tmp_path}/from-yaml"


def test_a_non_utf8_jsonl_file_is_a_data_error(tmp_path, capsys):
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(b'{"text": "caf\xe9"}\n')
  assert train_cli.main([f"data.path={bad}", f"run_dir={tmp_path / 'r'}"]) == 2
  assert "bad.jsonl:1: not UTF-8 text" in one_error(capsys)
  assert not (tmp_path / "r").exists()
  from jaxstep.cli import check

  assert check.main([f"data.path={bad}"]) == 2
  assert "bad.jsonl:1: not UTF-8 text" in one_error(capsys)


# --- a write fails mid-run: one line, exit 74, the newest complete checkpoint intact ------

IO_EXIT = 74


def enospc(filename=None):
  import errno
  import os

  return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)


def train_main(tmp_path, *overrides) -> int:
  """The CLI in this process (its device set is already fixed by conftest's JAX)."""
  import jax

  jax.devices()  # the backend is up: the CLI leaves this process's devices alone
  make_cfg(tmp_path)  # writes the corpus
  return train_cli.main(
    [
      *SMALL,
      f"data.path={tmp_path / 'corpus.txt'}",
      f"run_dir={tmp_path / 'run'}",
      "train.max_steps=12",
      "train.log_every=1",
      "checkpoint.every=4",
      *overrides,
    ]
  )


def assert_resumable_from(run_dir: pathlib.Path, step: int) -> None:
  from jaxstep.trainer.checkpoint import list_checkpoints, step_dirs

  assert step_dirs(run_dir / "checkpoints")[0][0] == step
  assert all(info.problem is None for info in list_checkpoints(run_dir / "checkpoints"))


def newest_in(line: str) -> int:
  import re

  return int(re.search(r"the newest complete checkpoint is update step (\d+)", line).group(1))


def failing_after(calls: int, error_fn, original):
  count = {"n": 0}

  def wrapped(*args, **kwargs):
    count["n"] += 1
    if count["n"] > calls:
      raise error_fn()
    return original(*args, **kwargs)

  return wrapped


def test_a_failed_metrics_write_stops_with_one_line_and_keeps_the_checkpoint(
  tmp_path, monkeypatch, capsys
):
  from jaxstep.trainer import records

  target = tmp_path / "run" / "metrics.jsonl"
  monkeypatch.setattr(
    records, "append", failing_after(6, lambda: enospc(str(target)), records.append)
  )
  assert train_main(tmp_path) == IO_EXIT
  line = one_error(capsys)
  assert f"writing {target} failed (No space left on device)" in line
  assert "the newest complete checkpoint is update step 4" in line
  assert_resumable_from(tmp_path / "run", 4)


def test_a_dead_tensorboard_writer_thread_stops_the_run_instead_of_hanging(
  tmp_path, monkeypatch, capsys
):
  from tensorboardX import event_file_writer

  writer = event_file_writer.EventsWriter
  monkeypatch.setattr(
    writer, "write_event", failing_after(30, enospc, writer.write_event), raising=True
  )
  assert train_main(tmp_path, "train.max_steps=400", "checkpoint.every=100") == IO_EXIT
  line = one_error(capsys)
  assert "No space left on device" in line and str(tmp_path / "run") in line


def test_a_failed_checkpoint_save_is_one_line_and_older_ones_stay(tmp_path, monkeypatch, capsys):
  import orbax.checkpoint as ocp

  manager = ocp.CheckpointManager
  monkeypatch.setattr(
    manager,
    "save",
    failing_after(
      1, lambda: ValueError("RESOURCE_EXHAUSTED: Failed writing: No space"), manager.save
    ),
  )
  assert train_main(tmp_path) == IO_EXIT
  line = one_error(capsys)
  assert "saving the checkpoint of update step 8" in line and "RESOURCE_EXHAUSTED" in line
  assert "the newest complete checkpoint is update step 4" in line
  assert_resumable_from(tmp_path / "run", 4)


def test_too_little_room_for_a_checkpoint_is_refused_before_writing(tmp_path, monkeypatch, capsys):
  import shutil

  from jaxstep.trainer import checkpoint

  real = shutil.disk_usage
  calls = {"n": 0}

  def usage(path):
    calls["n"] += 1
    total, used, free = real(path)
    # the check before the first step, then the save of step 4, see the real disk
    return type(real(path))(total, used, free if calls["n"] <= 2 else 1024)

  monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)
  assert train_main(tmp_path) == IO_EXIT
  line = one_error(capsys)
  assert "0.0 MiB free, the checkpoint of update step 8 needs" in line
  assert_resumable_from(tmp_path / "run", 4)


def test_a_failed_bad_batch_dump_is_one_line(tmp_path, monkeypatch, capsys):
  from jaxstep.trainer import guards

  def savez(path, **arrays):
    raise enospc(str(path))

  monkeypatch.setattr(guards.np, "savez", savez)
  assert train_main(tmp_path, "train.debug_nan_step=6") == IO_EXIT
  assert "bad_batches/step_00000006.npz failed (No space left on device)" in one_error(capsys)
  assert_resumable_from(tmp_path / "run", 4)


# --- one run per run_dir; nothing written before the checks; a finished run is left alone --


def test_two_concurrent_runs_on_one_run_dir_and_a_killed_holder(tmp_path, capsys):
  """The second run exits 2 naming the first's pid and writes nothing; once the first is
  killed with SIGKILL, the OS has released its lock and the next run resumes."""
  import signal
  import subprocess
  import sys
  import time

  from jaxstep.trainer.records import read_records

  make_cfg(tmp_path)
  run_dir = tmp_path / "run"
  first = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "jaxstep.train",
      *SMALL,
      "train.max_steps=100000",
      "train.log_every=1",
      "train.eval_every=100000",  # no new file of its own while the second run is refused
      "checkpoint.every=5",
      f"data.path={tmp_path / 'corpus.txt'}",
      f"run_dir={run_dir}",
    ],
    env=killable(dict(os.environ)),
    stderr=subprocess.DEVNULL,
  )
  try:
    deadline = time.time() + 240
    while len(read_records(run_dir / "metrics.jsonl")) < 12:
      assert time.time() < deadline and first.poll() is None
      time.sleep(0.2)
    before = sorted(p.name for p in run_dir.iterdir())
    assert train_main(tmp_path) == 2
    line = one_error(capsys)
    assert f"run_dir {run_dir} is in use by another run (pid {first.pid})" in line
    assert sorted(p.name for p in run_dir.iterdir()) == before
    first.send_signal(signal.SIGKILL)
    first.wait()
  finally:
    first.kill()
  # the lock is free again, and the run restores its newest checkpoint (step >= 10)
  assert train_main(tmp_path, "train.max_steps=5", "train.schedule_steps=100000") == 0
  assert "already finished at update step" in capsys.readouterr().err


def test_a_refused_resume_leaves_config_yaml_as_it_was(tmp_path):
  from jaxstep import CheckpointError, trainer

  trainer.train(make_cfg(tmp_path, "train.max_steps=2"))
  before = (tmp_path / "run" / "config.yaml").read_text()
  with pytest.raises(CheckpointError, match="model changed"):
    trainer.train(make_cfg(tmp_path, "train.max_steps=4", "model.n_heads=4"))
  assert (tmp_path / "run" / "config.yaml").read_text() == before


def test_no_resume_archives_everything_of_the_old_run(tmp_path):
  from jaxstep import trainer

  cfg = make_cfg(tmp_path, "train.max_steps=2", "train.debug_nan_step=2")
  trainer.train(cfg)
  (tmp_path / "run" / "loss.png").write_bytes(b"png")
  old = {p.name for p in (tmp_path / "run").iterdir()} - {".lock"}
  assert {"config.yaml", "bad_batches", "loss.png", "checkpoints"} <= old
  trainer.train(make_cfg(tmp_path, "train.max_steps=2"), resume=False)
  (previous,) = (tmp_path / "run").glob("previous-*")
  assert {p.name for p in previous.iterdir()} == old
  assert not (tmp_path / "run" / "bad_batches").exists()
  assert not (tmp_path / "run" / "loss.png").exists()


def test_re_running_a_finished_command_changes_nothing(tmp_path, capsys):
  assert train_main(tmp_path, "train.eval_every=0") == 0
  run_dir = tmp_path / "run"
  before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
  capsys.readouterr()
  assert train_main(tmp_path, "train.eval_every=0") == 0
  out = capsys.readouterr()
  assert "already finished at update step 12" in out.err
  assert "final step 12: loss nan" not in out.out and "final step 12: loss " in out.out
  after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
  assert after == before


@pytest.mark.parametrize(
  "override, message",
  [
    ("model.n_heads=4", r"model changed since the checkpoint \(model.n_heads 2 → 4\)"),
    ("train.seed=1", r"train.seed changed since the checkpoint \(0 → 1\)"),
    ("train.schedule_steps=0", "lr schedule was planned for 64 update steps, this config plans 4"),
  ],
)
def test_resume_refuses_a_changed_model_seed_or_schedule(tmp_path, override, message):
  from jaxstep import CheckpointError, trainer

  trainer.train(make_cfg(tmp_path, "train.max_steps=2"))
  with pytest.raises(CheckpointError, match=message):
    trainer.train(make_cfg(tmp_path, "train.max_steps=4", override))


def test_extending_max_steps_keeps_or_re_plans_the_schedule_as_told(tmp_path, caplog):
  import logging

  from jaxstep import CheckpointError, trainer
  from jaxstep.trainer.records import read_records

  first = ["train.schedule_steps=0", "optim.warmup_steps=0", "train.log_every=1"]
  trainer.train(make_cfg(tmp_path, "train.max_steps=4", *first))
  with pytest.raises(CheckpointError, match="set train.schedule_steps=4 to keep it"):
    trainer.train(make_cfg(tmp_path, "train.max_steps=6", *first))
  kept_cfg = make_cfg(tmp_path, "train.max_steps=6", *first[1:], "train.schedule_steps=4")
  kept = trainer.train(kept_cfg)
  lrs = [r["lr"] for r in read_records(tmp_path / "run" / "metrics.jsonl")]
  final = kept_cfg.optim.lr * kept_cfg.optim.final_lr_fraction
  assert kept.run_state.step == 6 and lrs[4] == lrs[5] == pytest.approx(final)  # held
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    trainer.train(
      make_cfg(tmp_path, "train.max_steps=8", *first, "checkpoint.allow_schedule_change=true")
    )
  assert "the lr schedule re-planned from 4 to 8 steps" in caplog.text


def test_a_harmless_model_change_is_stated_in_one_line(tmp_path, caplog):
  import logging

  from jaxstep import trainer

  trainer.train(make_cfg(tmp_path, "train.max_steps=2"))
  with caplog.at_level(logging.WARNING, logger="jaxstep"):
    trainer.train(make_cfg(tmp_path, "train.max_steps=4", "model.dropout=0.1"))
  assert "RESUME WITH A CHANGE: model.dropout 0.0 → 0.1" in caplog.text


# --- corrupted checkpoint bytes, runaway skips, read-only sources ---------------------------


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
  from jaxstep.trainer.records import read_records

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

  from jaxstep.trainer import integrity

  state = {"w": jnp.arange(1000, dtype=jnp.float32), "b": jnp.ones(3, jnp.bfloat16)}
  saved = integrity.checksums(state)
  assert integrity.mismatch(state, saved) is None
  changed = {**state, "w": state["w"].at[500:502].set(0.0)}
  assert "w changed since it was saved" in integrity.mismatch(changed, saved)
  swapped = {**state, "w": state["w"][::-1]}  # same bytes, other places
  assert integrity.mismatch(swapped, saved) is not None
  assert "w holds NaN" in integrity.nonfinite({"w": state["w"].at[3].set(jnp.nan)})


def test_runaway_skips_halt_with_the_last_good_state(tmp_path, capsys):
  assert train_main(tmp_path, "optim.lr=1e6", "train.max_consecutive_skips=3") == 1
  line = one_error(capsys)
  assert "3 updates in a row were skipped" in line and "train.max_consecutive_skips=0" in line
  from jaxstep.trainer.records import read_records

  records = read_records(tmp_path / "run" / "metrics.jsonl")
  assert records[-1]["step"] < 12 and [r["updated"] for r in records[-3:]] == [False] * 3


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


def test_a_full_disk_ends_the_run_in_one_line_without_hanging(tmp_path, tmpfs):
  """A real full filesystem: the events and metrics fill it, or the next checkpoint does
  not fit. Either way: exit 74, one line, no traceback, within the timeout, and the
  checkpoints that were completed are intact."""
  import subprocess
  import sys

  make_cfg(tmp_path)
  for size, overrides in (
    ("64k", ["train.max_steps=2000", "checkpoint.every=0"]),
    ("1600k", ["train.max_steps=40", "checkpoint.every=5"]),
  ):
    run_dir = tmpfs(size) / "run"
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "jaxstep.train",
        *SMALL,
        f"data.path={tmp_path / 'corpus.txt'}",
        f"run_dir={run_dir}",
        "train.log_every=1",
        *overrides,
      ],
      capture_output=True,
      text=True,
      timeout=240,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == IO_EXIT and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr
    if size == "64k":  # no room for one checkpoint: refused before the first step
      assert "MiB free, a checkpoint needs about" in errors[0]
      assert not run_dir.exists()
    else:
      assert "MiB free" in errors[0]
      assert_resumable_from(run_dir, newest_in(errors[0]))


def test_a_disk_that_fills_during_a_checkpoint_write(tmp_path, tmpfs, monkeypatch, capsys):
  """The free-space check passed, then orbax's own write fails: one line, exit 74, naming
  the save that failed (it stays a temporary directory) and the intact one before it."""
  import collections
  import re

  from jaxstep.trainer import checkpoint

  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(2**40, 0, 2**40))
  run_dir = tmpfs("700k") / "run"
  code = train_main(tmp_path, f"run_dir={run_dir}", "train.max_steps=40", "checkpoint.every=2")
  assert code == IO_EXIT
  line = one_error(capsys)
  assert "No space left on device" in line
  failed = int(re.search(r"the checkpoint of update step (\d+) in", line).group(1))
  assert (run_dir / "checkpoints" / f"{failed}.orbax-checkpoint-tmp").is_dir()  # that one
  assert "the newest complete checkpoint is update step" in line
  assert_resumable_from(run_dir, newest_in(line))


# --- readers survive what a kill leaves; smaller items --------------------------------------


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


def test_sigterm_on_one_host_stops_every_host_at_the_same_step(tmp_path):
  """Two processes on 127.0.0.1; only process 1 gets SIGTERM. JAX's preemption sync point
  picks one update step: both save it and exit 143 (a host stopping alone would leave the
  other blocked in the next collective)."""
  import os
  import re
  import signal
  import subprocess
  import sys
  import time

  from test_sharding import free_port, process_env

  from jaxstep.trainer.records import read_records

  make_cfg(tmp_path)
  run_dir, port = tmp_path / "run", free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "jaxstep.train",
        *SMALL,
        "train.max_steps=100000",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        "train.global_batch_size=8",
        "train.grad_accum_steps=2",
        f"data.path={tmp_path / 'corpus.txt'}",
        f"run_dir={run_dir}",
      ],
      env=process_env(port, i, devices=1),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  try:
    deadline = time.time() + 240
    while len(read_records(run_dir / "metrics.jsonl")) < 3:
      assert time.time() < deadline and all(p.poll() is None for p in procs)
      time.sleep(0.2)
    os.kill(procs[1].pid, signal.SIGTERM)
    outs = [p.communicate(timeout=240) for p in procs]
  finally:
    for p in procs:
      p.kill()
  steps = []
  for p, (_, err) in zip(procs, outs, strict=True):
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    steps.append(int(re.search(r"stopped by SIGTERM at update step (\d+)", err).group(1)))
  assert steps[0] == steps[1] and (run_dir / "checkpoints" / str(steps[0])).is_dir()


@pytest.mark.parametrize("where", ["a_file", "proc", "read_only"])
def test_an_unusable_run_dir_is_one_line(tmp_path, capsys, where, request):
  if where == "a_file":
    run_dir = tmp_path / "file"
    run_dir.write_text("not a directory")
  elif where == "proc":
    run_dir = pathlib.Path("/proc/jaxstep-run")
  else:
    if not can_mount():
      pytest.skip("mounting a tmpfs needs root")
    mount = request.getfixturevalue("tmpfs")
    point = mount("1m")
    mount.read_only(point)
    run_dir = point / "run"
  code = IO_EXIT if where == "read_only" else 2  # the disk refused a write: as in a run
  assert train_main(tmp_path, f"run_dir={run_dir}") == code
  assert f"run_dir {run_dir} cannot be used" in one_error(capsys)


@pytest.mark.parametrize("disk", ["full", "read_only"])
def test_a_disk_that_refuses_the_run_before_its_first_step_leaves_nothing(
  tmp_path, tmpfs, capsys, disk
):
  """A checkpoints folder that cannot take one checkpoint (no room, read-only) is found
  before the first update: exit 74, one line, nothing written, and the next try with the
  disk fixed trains as if nothing had happened."""
  import subprocess

  point = tmpfs("64k" if disk == "full" else "16m")
  run_dir = point / "run"
  if disk == "read_only":
    run_dir.mkdir()
    (run_dir / "checkpoints").mkdir()
    subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(run_dir / "checkpoints")],
      check=True,
    )
  try:
    assert train_main(tmp_path, f"run_dir={run_dir}") == IO_EXIT
    line = one_error(capsys)
    if disk == "full":
      assert "MiB free, a checkpoint needs about" in line and not run_dir.exists()
    else:
      assert "checkpoints cannot be written (Read-only file system)" in line
      assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]
  finally:
    if disk == "read_only":
      subprocess.run(["umount", "-l", str(run_dir / "checkpoints")], check=True)
  if disk == "full":
    subprocess.run(["mount", "-o", "remount,size=16m", str(point)], check=True)
  assert train_main(tmp_path, f"run_dir={run_dir}") == 0
  assert_resumable_from(run_dir, 12)


def test_checkpoints_that_is_a_file_is_refused_before_anything_is_written(tmp_path, capsys):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "checkpoints").write_text("mine")
  assert train_main(tmp_path) == 2
  assert f"{run_dir / 'checkpoints'} is a file, not a folder" in one_error(capsys)
  assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]
  assert (run_dir / "checkpoints").read_text() == "mine"
  (run_dir / "checkpoints").unlink()
  assert train_main(tmp_path) == 0  # fixed: not refused as a run with history
  assert_resumable_from(run_dir, 12)


def _train_in_background(tmp_path, run_dir, *overrides):
  import subprocess
  import sys

  make_cfg(tmp_path)
  argv = [
    *SMALL,
    f"data.path={tmp_path / 'corpus.txt'}",
    f"run_dir={run_dir}",
    "train.max_steps=100000",
    "checkpoint.every=5",
    *overrides,
  ]
  cmd = [sys.executable, "-m", "jaxstep.train", *argv]
  return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)


def _wait_for(path: pathlib.Path, proc, seconds: float = 120) -> None:
  import time

  deadline = time.monotonic() + seconds
  while not path.exists():
    assert proc.poll() is None and time.monotonic() < deadline, f"no {path}"
    time.sleep(0.1)


def test_checkpoints_that_turn_read_only_mid_run_end_in_one_line_without_hanging(tmp_path, tmpfs):
  """orbax's save threads wait 20 minutes for signals a failed save never sends; the command
  reports the failure and ends anyway."""
  import subprocess
  import time

  run_dir = tmp_path / "run"
  (run_dir / "checkpoints").mkdir(parents=True)
  subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(run_dir / "checkpoints")], check=True
  )
  try:
    proc = _train_in_background(tmp_path, run_dir)
    _wait_for(run_dir / "checkpoints" / "5", proc)
    remount_read_only_when_free(run_dir / "checkpoints")
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
    subprocess.run(["umount", "-l", str(run_dir / "checkpoints")])
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert proc.returncode == IO_EXIT and len(errors) == 1, err[-3000:]
  assert "Read-only file system" in errors[0] and "Traceback" not in err
  assert time.monotonic() - start < 60


def test_a_run_dir_removed_mid_run_is_one_line_and_not_recreated(tmp_path):
  """The run stops at its next update step, writes nothing more, and says so; only a save
  already under way (asynchronous) may still land its step there, and the line says which."""
  import re
  import shutil

  run_dir = tmp_path / "run"
  proc = _train_in_background(tmp_path, run_dir)
  try:
    _wait_for(run_dir / "checkpoints" / "5", proc)
    run_dir.rename(tmp_path / "moved")  # one atomic step; rmtree races the run's writes
    shutil.rmtree(tmp_path / "moved")
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert proc.returncode == IO_EXIT and len(errors) == 1, err[-3000:]
  assert f"run_dir {run_dir} was removed or replaced during the run" in errors[0]
  if "nothing more was written" in errors[0]:
    assert not run_dir.exists(), sorted(str(p) for p in run_dir.rglob("*"))
    return
  assert [p.name for p in run_dir.iterdir()] == ["checkpoints"]
  step = re.search(r"with update step (\d+), which a re-run resumes from", errors[0])
  if step:
    assert_resumable_from(run_dir, int(step.group(1)))
  else:
    assert "with no complete checkpoint" in errors[0]


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


def test_memory_accepts_the_fsdp_mesh_that_train_accepts():
  import os
  import subprocess
  import sys

  if (os.cpu_count() or 1) < 2:
    pytest.skip("needs 2 cores for 2 CPU devices")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    [sys.executable, "-m", "jaxstep.memory", "mesh.fsdp=2"],
    capture_output=True,
    text=True,
    timeout=300,
    env={**env, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "mesh data=1 fsdp=2" in proc.stdout


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

  from test_sharding import devices_env

  code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxstep.trainer import integrity
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
