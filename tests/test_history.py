"""A run's history is never rewritten behind the user's back: a run dir that recorded update
steps but lost its checkpoints is refused, not started over from step 0."""

import shutil

import pytest
from conftest import make_cfg, read_lines

from jaxstep import CheckpointError, trainer
from jaxstep.cli import train as train_cli


@pytest.mark.slow
def test_history_without_a_checkpoint_is_refused_and_kept(tmp_path, capsys):
  cfg = make_cfg(tmp_path, "train.max_steps=4", "train.log_every=1", "train.eval_every=2")
  trainer.train(cfg)
  run = tmp_path / "run"
  shutil.rmtree(run / "checkpoints")
  kept = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "eval.jsonl")}
  with pytest.raises(CheckpointError, match=r"history \(metrics.jsonl up to update step 4\)"):
    trainer.train(cfg)
  assert {name: (run / name).read_bytes() for name in kept} == kept
  assert not (run / "checkpoints").exists()

  overrides = [f"{k}={v}" for k, v in (("run_dir", run), ("data.path", cfg.data.path))]
  code = train_cli.main(["--config", str(run / "config.yaml"), *overrides])
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--no-resume" in err[0], err

  result = trainer.train(cfg, resume=False)  # the user's choice: set it aside, start over
  assert result.run_state.step == 4
  (previous,) = run.glob("previous-*")
  assert (previous / "metrics.jsonl").read_bytes() == kept["metrics.jsonl"]
  assert read_lines(run / "metrics.jsonl")[0]["step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0])
def test_ctrl_c_during_start_up_is_one_line_not_a_traceback(tmp_path, delay):
  """SIGINT while the command is still importing JAX, reading data or compiling: exit 130
  and one ``error:`` line, never a traceback, never a run that goes on (a KeyboardInterrupt
  raised inside JAX's garbage-collection callback used to be swallowed)."""
  import signal
  import subprocess
  import sys
  import time

  cfg = make_cfg(tmp_path)
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "jaxstep.train",
      f"data.path={cfg.data.path}",
      f"run_dir={tmp_path / 'run'}",
    ],
    stderr=subprocess.PIPE,
    text=True,
  )
  time.sleep(delay)
  proc.send_signal(signal.SIGINT)
  err = proc.communicate(timeout=120)[1]
  assert proc.returncode == 130, err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: "), err
  if last == "error: jaxstep train interrupted (SIGINT)":  # stopped before the update loop
    assert not (tmp_path / "run" / "checkpoints").exists()
