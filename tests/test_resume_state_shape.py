"""A resume whose only change is a config key that shapes the train state is refused in one
line naming that key, not as a run whose checkpoints are all unreadable."""

import pytest
from conftest import SMALL_MODEL, make_cfg

from jaxstep import trainer
from jaxstep.cli import train as train_cli
from jaxstep.errors import CheckpointError

SPIKES = ("train.spike_factor=2", "train.spike_window=32")


def argv(tmp_path, *overrides):
  """The CLI arguments of ``make_cfg(tmp_path, *overrides)``."""
  fixed = ["train.schedule_steps=64", f"data.path={tmp_path / 'corpus.txt'}"]
  return [*SMALL_MODEL, *fixed, f"run_dir={tmp_path / 'run'}", *overrides]


def first_run(tmp_path, run="run"):
  trainer.train(make_cfg(tmp_path, *SPIKES, "train.max_steps=2", f"run_dir={tmp_path / run}"))


@pytest.mark.slow
def test_a_changed_spike_window_is_one_line_naming_the_key(tmp_path, capfd):
  first_run(tmp_path)
  capfd.readouterr()
  code = train_cli.main(argv(tmp_path, *SPIKES, "train.spike_window=16", "train.max_steps=4"))
  err = capfd.readouterr().err
  assert code == 2, err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, err
  assert "train.spike_window changed from 32 to 16" in errors[0]
  assert "--no-resume" in errors[0] and "none restores" not in errors[0]
  assert "Traceback" not in err and "CHECKPOINT SKIPPED" not in err
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]


@pytest.mark.slow
def test_resume_from_with_another_spike_window_names_the_key(tmp_path):
  first_run(tmp_path, run="source")
  cfg = make_cfg(tmp_path, *SPIKES, "train.spike_window=8", "train.max_steps=4")
  with pytest.raises(CheckpointError, match="train.spike_window changed from 32 to 8"):
    trainer.train(cfg, resume_from=str(tmp_path / "source"))


@pytest.mark.slow
def test_a_model_change_that_does_not_fit_names_the_model_key(tmp_path):
  trainer.train(make_cfg(tmp_path, "train.max_steps=2"))
  with pytest.raises(CheckpointError, match=r"does not fit the model: .*model.d_model 32 → 64"):
    trainer.train(make_cfg(tmp_path, "train.max_steps=4", "model.d_model=64"))
