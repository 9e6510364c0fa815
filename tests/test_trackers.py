"""MLflow and W&B trackers: what a run logs reads back from a real local MLflow store and a
W&B offline folder, a resumed run continues the same tracker runs, a tracker that fails is
switched off with one warning, and importing the module imports neither library. Nothing
here reaches a network: MLflow writes a file store, W&B runs offline."""

import importlib.util
import logging
import subprocess
import sys
import threading
import time

import pytest

from jaxstep.errors import ConfigError
from jaxstep.trainer.tracking import backends as tracker_backends
from jaxstep.trainer.tracking import trackers as trackers_lib
from jaxstep.trainer.tracking.trackers import MlflowConfig, WandbConfig

CONFIG = {"train": {"lr": 0.001, "trackers": ["jsonl", "mlflow"]}, "model": {"layers": 2}}


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch, tracker_libraries_ended):
  """No W&B account, network or home folder; the MLflow file-store switch restored; what
  the libraries keep per process ended after each test."""
  monkeypatch.setenv("WANDB_MODE", "offline")
  for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def open_run(run_dir, names, *, ids=None, config=CONFIG, mlflow=None):
  """A new run (no ``ids``) or a resumed one."""
  return trackers_lib.open_trackers(
    names,
    run_dir=run_dir,
    config=config,
    mlflow=mlflow or MlflowConfig(),
    wandb=WandbConfig(mode="offline"),
    ids=ids or {},
    resumed=ids is not None,
  )


def mlflow_client(run_dir):
  from mlflow.tracking import MlflowClient

  return MlflowClient((run_dir / "mlruns").resolve().as_uri())


def log_steps(trackers, steps):
  for step in steps:
    trackers.metrics(step, {"loss": 10.0 / step, "updated": True, "note": "text"}, "train")


def tracker_warnings(caplog):
  return [r for r in caplog.records if r.name == "jaxstep" and r.levelno >= logging.WARNING]


def test_mlflow_local_store_logs_and_a_resumed_run_continues_it(tmp_path, caplog):
  (tmp_path / "config.yaml").write_text("train:\n  lr: 0.001\n")
  trackers = open_run(tmp_path, ["jsonl", "tensorboard", "mlflow"])
  log_steps(trackers, range(1, 6))
  trackers.metrics(5, {"loss": 1.5, "ppl": 4.5}, "eval/valid")
  trackers.text(5, "samples", "[greedy] 'the ' → 'cat'")
  trackers.text(5, "samples", "[sample] 'the ' → 'dog'")
  trackers.artifacts([tmp_path / "config.yaml", tmp_path / "loss.png"])  # no loss.png: skipped
  trackers.close()
  run_id = trackers.ids["mlflow"]
  client = mlflow_client(tmp_path)
  history = client.get_metric_history(run_id, "train/loss")
  assert [(m.step, m.value) for m in history] == [(s, 10.0 / s) for s in range(1, 6)]
  assert [m.value for m in client.get_metric_history(run_id, "train/updated")] == [1.0] * 5
  assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/valid/ppl")] == [
    (5, 4.5)
  ]
  run = client.get_run(run_id)
  assert "train/note" not in run.data.metrics
  assert run.data.params == {"train.lr": "0.001", "train.trackers": "['jsonl', 'mlflow']",
                             "model.layers": "2"}  # fmt: skip
  assert run.info.status == "FINISHED"
  sample = client.download_artifacts(run_id, "samples/step_000005.txt", str(tmp_path / "dl"))
  assert open(sample).read() == "[greedy] 'the ' → 'cat'\n[sample] 'the ' → 'dog'"

  changed = {"train": {"lr": 0.01, "trackers": ["jsonl", "mlflow"]}, "model": {"layers": 2},
             "eval": {"every": 3}}  # fmt: skip
  resumed = open_run(tmp_path, ["jsonl", "mlflow"], ids=trackers.ids, config=changed)
  assert resumed.ids == {"mlflow": run_id}
  log_steps(resumed, range(6, 9))
  resumed.artifacts([tmp_path / "config.yaml"])
  resumed.close()
  history = client.get_metric_history(run_id, "train/loss")
  assert [m.step for m in history] == list(range(1, 9))
  run = client.get_run(run_id)
  assert run.info.status == "FINISHED"
  assert run.data.params["train.lr"] == "0.001"  # params cannot change: the first value stays
  assert run.data.params["eval.every"] == "3"  # a key new on resume is logged
  assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "samples"}
  assert len(client.search_runs([run.info.experiment_id])) == 1
  assert not tracker_warnings(caplog)


@pytest.mark.slow
def test_wandb_offline_writes_under_run_dir_and_resumes_the_same_run(tmp_path, caplog):
  (tmp_path / "config.yaml").write_text("train:\n  lr: 0.001\n")
  trackers = open_run(tmp_path, ["jsonl", "wandb"])
  run_id = trackers.ids["wandb"]
  log_steps(trackers, range(1, 4))
  trackers.text(3, "samples", "<b>not markup</b>")
  trackers.artifacts([tmp_path / "config.yaml"])
  trackers.close()
  (first,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
  assert (first / f"run-{run_id}.wandb").stat().st_size > 0
  assert (first / "files" / "jaxstep" / "config.yaml").read_text() == "train:\n  lr: 0.001\n"
  assert list((first / "files" / "media" / "html").glob("samples_*.html"))

  time.sleep(1.1)  # offline folders are named by the second the run starts
  resumed = open_run(tmp_path, ["jsonl", "wandb"], ids=trackers.ids)
  assert resumed.ids == {"wandb": run_id}
  log_steps(resumed, range(2, 5))  # steps after the last checkpoint come again
  resumed.close()
  assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
  assert not tracker_warnings(caplog)


def test_a_tracker_that_fails_mid_run_warns_once_and_is_dropped(tmp_path, monkeypatch, caplog):
  from mlflow.tracking import MlflowClient

  calls, texts = [], []
  original = MlflowClient.log_batch

  def flaky(self, run_id, **kw):
    calls.append(kw)
    if len(calls) > 1:
      raise ConnectionError("server unreachable\nTraceback details")
    return original(self, run_id, **kw)

  monkeypatch.setattr(MlflowClient, "log_batch", flaky)
  monkeypatch.setattr(MlflowClient, "log_text", lambda *a, **k: texts.append(a))
  trackers = open_run(tmp_path, ["jsonl", "mlflow"], config={})  # no params: one call a step
  for step in (1, 2):
    log_steps(trackers, [step])
    wait_for(lambda step=step: len(calls) == step)
  log_steps(trackers, range(3, 6))
  trackers.text(5, "samples", "dropped")
  start = time.monotonic()
  trackers.close(timeout=10)
  assert time.monotonic() - start < 10
  assert len(calls) == 2 and not texts
  (warning,) = tracker_warnings(caplog)
  assert warning.getMessage() == (
    "mlflow tracker switched off, training goes on: ConnectionError: server unreachable"
  )
  history = mlflow_client(tmp_path).get_metric_history(trackers.ids["mlflow"], "train/loss")
  assert [m.step for m in history] == [1]


def test_a_tracker_that_cannot_start_warns_once(tmp_path, caplog):
  trackers = open_run(tmp_path, ["jsonl", "mlflow"], mlflow=MlflowConfig(tracking_uri="nope://x"))
  log_steps(trackers, range(1, 4))
  trackers.close(timeout=5)
  (warning,) = tracker_warnings(caplog)
  assert warning.getMessage().startswith("mlflow tracker switched off, training goes on: ")
  assert trackers.ids == {}


def test_an_unreachable_mlflow_server_is_switched_off_at_once_in_one_line(tmp_path, caplog):
  """A tracking URI where nothing listens: one warning naming the server, within seconds
  (not after MLflow's retries), and none of urllib3's retry notices."""
  import socket

  with socket.socket() as closed:  # a port that was free a moment ago: nothing listens
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
  uri = f"http://127.0.0.1:{port}"
  start = time.monotonic()
  trackers = open_run(tmp_path, ["jsonl", "mlflow"], mlflow=MlflowConfig(tracking_uri=uri))
  log_steps(trackers, range(1, 4))
  trackers.close(timeout=10)
  assert time.monotonic() - start < 8
  (warning,) = tracker_warnings(caplog)
  assert warning.getMessage() == (
    f"mlflow tracker switched off, training goes on: ConnectionError: MLflow tracking server "
    f"{uri} unreachable (Connection refused)"
  )
  assert not [r for r in caplog.records if r.name.startswith("urllib3")]


def test_wandb_online_without_a_key_warns_instead_of_prompting(tmp_path, monkeypatch, caplog):
  import wandb

  for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
  monkeypatch.setattr(wandb, "init", lambda **kw: pytest.fail("wandb.init without a key"))
  trackers = trackers_lib.open_trackers(
    ["jsonl", "wandb"],
    run_dir=tmp_path,
    config=CONFIG,
    mlflow=MlflowConfig(),
    wandb=WandbConfig(mode="online"),
    ids={},
    resumed=False,
  )
  log_steps(trackers, [1])
  trackers.close(timeout=5)
  (warning,) = tracker_warnings(caplog)
  assert warning.getMessage().startswith(
    "wandb tracker switched off, training goes on: RuntimeError: no W&B API key"
  )


def test_the_loop_never_waits_on_a_slow_tracker(tmp_path, monkeypatch, caplog):
  from mlflow.tracking import MlflowClient

  release = threading.Event()
  monkeypatch.setattr(MlflowClient, "log_batch", lambda *a, **k: release.wait(10))
  monkeypatch.setattr(trackers_lib, "QUEUE_EVENTS", 100)
  trackers = open_run(tmp_path, ["jsonl", "mlflow"], config={})
  start = time.perf_counter()
  log_steps(trackers, range(1, 1001))  # the tracker holds its first batch meanwhile
  assert time.perf_counter() - start < 0.5
  release.set()
  trackers.close(timeout=10)
  (warning,) = tracker_warnings(caplog)
  assert "events dropped (the trackers fell behind)" in warning.getMessage()


def test_no_external_tracker_is_a_no_op(tmp_path):
  trackers = open_run(tmp_path, ["jsonl", "tensorboard"])
  trackers.metrics(1, {"loss": 1.0}, "train")
  trackers.text(1, "samples", "x")
  trackers.artifacts([tmp_path / "config.yaml"])
  trackers.close()
  assert trackers.ids == {} and trackers._thread is None
  assert not list(tmp_path.iterdir())


def test_scalars_and_flatten():
  import numpy as np

  values = {"loss": np.float32(0.5), "tokens": 7, "ok": True, "bad": np.bool_(False), "s": "x"}
  assert trackers_lib.scalars(values, "eval/valid") == {
    "eval/valid/loss": 0.5,
    "eval/valid/tokens": 7.0,
    "eval/valid/ok": 1.0,
    "eval/valid/bad": 0.0,
  }
  nested = {"a": {"b": {"c": 1}, "d": [1, 2]}, "e": None, "f": (3,)}
  assert tracker_backends.flatten(nested) == {"a.b.c": 1, "a.d": "[1, 2]", "e": None, "f": "(3,)"}


def test_check_names_and_sections():
  trackers_lib.check_tracker_names(["jsonl", "tensorboard", "mlflow", "wandb"])
  with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'; known: jsonl, tensorb"):
    trackers_lib.check_tracker_names(["jsonl", "tensorbord"])
  with pytest.raises(ConfigError, match="names mlflow twice"):
    trackers_lib.check_tracker_names(["jsonl", "mlflow", "mlflow"])
  with pytest.raises(ConfigError, match="must include jsonl"):
    trackers_lib.check_tracker_names(["tensorboard"])
  with pytest.raises(ConfigError, match="mlflow.experiment must be non-empty"):
    MlflowConfig(experiment=" ")
  with pytest.raises(ConfigError, match="wandb.mode must be online, offline or disabled"):
    WandbConfig(mode="dryrun")
  with pytest.raises(ConfigError, match="wandb.project must be non-empty"):
    WandbConfig(project="")


def test_check_available_names_the_extra(monkeypatch):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
  )
  trackers_lib.check_available(["jsonl", "mlflow"])
  with pytest.raises(ConfigError) as error:
    trackers_lib.check_available(["jsonl", "mlflow", "wandb"])
  message = str(error.value)
  assert "\n" not in message and "pip install 'jaxstep[wandb]'" in message
  assert message.startswith("train.trackers names wandb, but the wandb package is not installed")


@pytest.mark.slow
def test_importing_the_module_imports_neither_library():
  code = (
    "import sys, jaxstep.trainer.tracking.trackers; "
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'wandb')))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


def wait_for(condition, timeout=10.0):
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, "the tracker thread did not get there"
    time.sleep(0.01)
