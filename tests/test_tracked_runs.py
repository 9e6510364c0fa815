"""Trackers in real runs: what MLflow holds equals metrics.jsonl step for step and a resumed
run continues the same MLflow run; W&B offline resumes its run id; a tracker failing
mid-run leaves training alone; a missing tracker package stops the run before anything is
written. Eval sets of a CLI run score as ``jaxstep evaluate`` scores the same text.

Nothing here reaches a network: MLflow writes a local file store, W&B runs offline."""

import json
import logging
import math
import os

import pytest
from tolerance import assert_close, assert_far

import jaxstep
from jaxstep.cli import train as train_cli
from jaxstep.trainer import config_run as train_lib
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.saved_run import evaluate as evaluation
from jaxstep.trainer.tracking import trackers as trackers_lib

TINY = ["train.global_batch_size=8", "train.grad_accum_steps=2", "train.progress=false"]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path, tracker_libraries_ended):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
  monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def run(tmp_path, *overrides):
  cfg = config_lib.load("tiny", [*TINY, f"run_dir={tmp_path / 'run'}", *overrides])
  return train_lib.train(cfg)


def lines(path):
  return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_mlflow_holds_the_metrics_step_for_step_and_a_resume_continues_its_run(tmp_path):
  from mlflow.tracking import MlflowClient

  common = ["train.trackers=[jsonl, mlflow]", "train.schedule_steps=20", "train.log_every=5"]
  common += ["train.eval_every=10"]
  run(tmp_path, *common, "train.max_steps=10")
  run(tmp_path, *common, "train.max_steps=20")
  client = MlflowClient((tmp_path / "run" / "mlruns").resolve().as_uri())
  (experiment,) = [e for e in client.search_experiments() if e.name == "jaxstep"]
  (tracked,) = client.search_runs([experiment.experiment_id])  # one run over both starts
  assert tracked.info.status == "FINISHED"
  logged = lines(tmp_path / "run" / "metrics.jsonl")
  for key in ("loss", "grad_norm", "lr", "tokens"):
    history = client.get_metric_history(tracked.info.run_id, f"train/{key}")
    assert [(m.step, m.value) for m in history] == [(r["step"], r[key]) for r in logged]
  evals = lines(tmp_path / "run" / "eval.jsonl")
  history = client.get_metric_history(tracked.info.run_id, "eval/heldout/eval_loss")
  assert [(m.step, m.value) for m in history] == [(r["step"], r["eval_loss"]) for r in evals]
  assert tracked.data.params["train.global_batch_size"] == "8"
  artifacts = {a.path for a in client.list_artifacts(tracked.info.run_id)}
  assert {"loss.png", "config.yaml"} <= artifacts


@pytest.mark.slow
def test_wandb_offline_writes_its_run_under_run_dir_and_a_resume_keeps_the_id(tmp_path):
  common = ["train.trackers=[jsonl, wandb]", "wandb.mode=offline", "train.schedule_steps=8"]
  run(tmp_path, *common, "train.max_steps=4")
  run(tmp_path, *common, "train.max_steps=8")
  folders = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
  ids = {f.name.rsplit("-", 1)[-1] for f in folders}
  assert len(folders) == 2 and len(ids) == 1, folders


@pytest.mark.slow
def test_a_tracker_failing_mid_run_warns_once_and_training_goes_on(tmp_path, caplog):
  from mlflow.tracking import MlflowClient

  calls = []
  original = MlflowClient.log_batch

  def flaky(self, *args, **kwargs):
    calls.append(1)
    if len(calls) > 1:
      raise ConnectionError("the tracking server went away")
    return original(self, *args, **kwargs)

  caplog.set_level(logging.WARNING, logger="jaxstep")
  try:
    MlflowClient.log_batch = flaky
    result = run(tmp_path, "train.trackers=[jsonl, mlflow]", "train.max_steps=12")
  finally:
    MlflowClient.log_batch = original
  assert result.run_state.step == 12
  warned = [r for r in caplog.records if "mlflow tracker switched off" in r.getMessage()]
  assert len(warned) == 1 and "went away" in warned[0].getMessage()
  assert lines(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == 12


def test_a_missing_tracker_package_is_one_line_before_anything_is_written(
  tmp_path, monkeypatch, capsys
):
  real = trackers_lib.importlib.util.find_spec
  monkeypatch.setattr(
    trackers_lib.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
  )
  code = train_cli.main(["--config", "tiny", "train.trackers=[jsonl, wandb]", *TINY,
                         f"run_dir={tmp_path / 'run'}"])  # fmt: skip
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and "pip install 'jaxstep[wandb]'" in err[0]
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_eval_set_scores_as_jaxstep_evaluate_scores_the_same_text(tmp_path):
  text = tmp_path / "other.txt"
  text.write_text("".join(f"line {i}: the quick brown fox jumps over it.\n" for i in range(60)))
  result = run(tmp_path, f"eval.sets={{other: {text}}}", "train.max_steps=6", "data.pack=false")
  got = result.evals["other"]
  assert got["step"] == 6 and got["set"] == "other"
  saved = jaxstep.load_run(tmp_path / "run")
  independent = evaluation.evaluate(saved, evaluation.load_data(saved, tmp_path / "run", str(text)))
  assert got["eval_tokens"] == independent["tokens"]
  # per-token NLLs (the longest sum: the MLP's down projection or the softmax over the
  # vocabulary) summed over the set's tokens
  model = saved.cfg.model
  terms = max(model.mlp_ratio * model.d_model, model.vocab_size) * int(got["eval_tokens"])
  means = (got["eval_loss"], got["eval_bpb"])
  expected = (independent["loss"], independent["bpb"])
  assert_close(means, expected, terms=terms)
  # the margin: the sums divided by the rows instead of the tokens and bytes are far outside
  nats, rows = got["eval_loss"] * got["eval_tokens"], independent["windows"]
  assert_far((nats / rows, nats / (math.log(2) * rows)), expected, terms=terms)
  sets = [r["set"] for r in lines(tmp_path / "run" / "eval.jsonl")]
  assert sets == ["heldout", "other"]
  assert os.path.exists(tmp_path / "run" / "tensorboard")
