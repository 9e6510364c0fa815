"""One run per run_dir; nothing is written before the checks pass; a finished run is left
alone; a resume refuses what would change the run's meaning and says in one line what it
keeps or re-plans."""

import os

import pytest
from conftest import killable, make_cfg
from fault_helpers import SMALL, one_error, train_main

# Each of these trains, kills or mounts: the whole file is in the slow tier (CI runs it).
pytestmark = pytest.mark.slow


def test_two_concurrent_runs_on_one_run_dir_and_a_killed_holder(tmp_path, capsys):
  """The second run exits 2 naming the first's pid and writes nothing; once the first is
  killed with SIGKILL, the OS has released its lock and the next run resumes."""
  import signal
  import subprocess
  import sys
  import time

  from jaxstep.trainer.store.records import read_records

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
  from jaxstep.trainer.store.records import read_records

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
