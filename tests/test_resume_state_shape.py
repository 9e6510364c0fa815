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


@pytest.mark.slow
def test_a_resume_with_another_optimizer_names_the_old_setting(tmp_path, capfd):
  """``optim.name`` and ``optim.groups`` lay out the optimizer state: a resume that changes
  them is one line naming the checkpoint's setting and the way out, not the state's leaves."""
  trainer.train(make_cfg(tmp_path, "train.max_steps=2"))
  capfd.readouterr()
  for change, said in (
    ("optim.name=muon", "optim.name=adamw; resuming with muon needs"),
    ("optim.groups=[{match: ln}]", "optim.groups=[]; resuming with optim.groups=[{match: ln}]"),
  ):
    assert train_cli.main(argv(tmp_path, "train.max_steps=4", change)) == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"the checkpoint of update step 2 was written with {said}" in errors[0]
    assert "needs --no-resume or a new run_dir" in errors[0] and "opt_state" not in errors[0]
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]


def test_a_checkpoint_without_the_optimizer_in_its_run_state_reads_config_yaml(tmp_path):
  """Checkpoints written before run states kept ``optim``: the run dir's config.yaml says."""
  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.store.run_state import optimizer_change, optimizer_of, saved_optimizer

  cfg = config_lib.load(None, ["optim.groups=[{match: ln, lr_scale: 0.5}]"])
  (tmp_path / "config.yaml").write_text(config_lib.dump(cfg))
  old = saved_optimizer({"step": 2}, tmp_path)
  assert old == {"name": "adamw", "groups": [{"match": "ln", "lr_scale": 0.5}]}
  again = dict(old, groups=[{"match": "ln", "lr_scale": 2.0}])  # a scale: the same layout
  assert optimizer_change(old, optimizer_of(cfg.optim)) == optimizer_change(old, again) == ("", "")
  assert optimizer_change(old, {"name": "lion", "groups": []})[0] == "optim.name"
  assert optimizer_change(old, {"name": "adamw", "groups": []})[0] == "optim.groups"
  assert saved_optimizer(None, tmp_path / "gone") == {}
  (tmp_path / "config.yaml").write_text("optim:\n  lr: 0.003\n")  # before optim.name: AdamW
  assert saved_optimizer({}, tmp_path) == {"name": "adamw", "groups": []}
