"""The two external tracker libraries behind ``trackers``: an MLflow run through
``MlflowClient`` and a W&B run. Each has ``start``, ``handle(events)`` and ``finish``;
``trackers`` calls them only from its background thread and switches one off when it
raises. The libraries are imported inside those calls, never by importing this module.
"""

from __future__ import annotations

import html
import logging
import os
import pathlib
import re
import secrets
import shutil
import urllib.parse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jaxstep.trainer.tracking.trackers import MlflowConfig, WandbConfig

log = logging.getLogger("jaxstep")

WANDB_INIT_TIMEOUT_S = 60.0
MLFLOW_BATCH = 1000  # metrics per log_batch (MLflow's limit)
MLFLOW_PARAM_BATCH = 100  # params per log_batch (MLflow's limit)
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest param value


def flatten(config: dict, prefix: str = "") -> dict:
  """A nested config as ``{"optim.lr": …}``; values other than str/int/float/bool/None as
  ``str``."""
  flat = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(flatten(value, f"{name}."))
    elif value is None or isinstance(value, str | int | float | bool):
      flat[name] = value
    else:
      flat[name] = str(value)
  return flat


def _split(items: list, size: int):
  return (items[i : i + size] for i in range(0, len(items), size))


# MLflow retries a failed request 7 times with a doubling back-off (minutes on a dead server)
# and logs each retry; a tracker of a training run gives up sooner, and says so once.
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
CONNECT_TIMEOUT_S = 5.0


def _reachable(url: urllib.parse.ParseResult) -> None:
  """``ConnectionError`` unless the tracking server accepts a TCP connection within
  ``CONNECT_TIMEOUT_S``: a server that is down or mistyped switches the tracker off at
  once instead of after MLflow's retries."""
  import socket

  port = url.port or (443 if url.scheme == "https" else 80)
  try:
    socket.create_connection((url.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
  except OSError as e:
    reason = e.strerror or type(e).__name__
    raise ConnectionError(f"MLflow tracking server {url.geturl()} unreachable ({reason})") from None


class Mlflow:
  """An MLflow run through ``MlflowClient`` (no global active run)."""

  name = "mlflow"

  def __init__(self, cfg: MlflowConfig, run_dir: pathlib.Path, config: dict, run_id):
    self.uri = cfg.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
    self.cfg, self.run_name, self.params = cfg, run_dir.name, flatten(config)
    self.run_id, self.client, self.texts = run_id, None, {}

  def start(self) -> None:
    """Continues ``run_id`` when it exists there, else creates a run; logs new params.
    MLflow 3 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE`` is set (the database
    stores need SQLAlchemy, which ``mlflow-skinny`` lacks), so a file store URI sets it."""
    url = urllib.parse.urlparse(self.uri)
    if url.scheme in ("", "file"):
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    elif url.scheme in ("http", "https"):
      _reachable(url)
      for name, value in HTTP_BOUNDS.items():
        os.environ.setdefault(name, value)
      logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # retry notices
    from mlflow.tracking import MlflowClient

    self.client = MlflowClient(self.uri)
    logged = self._resume() if self.run_id else None
    if logged is None:
      experiment = self.client.get_experiment_by_name(self.cfg.experiment)
      eid = experiment.experiment_id if experiment else None
      eid = eid or self.client.create_experiment(self.cfg.experiment)
      self.run_id, logged = self.client.create_run(eid, run_name=self.run_name).info.run_id, {}
    self._log_params({k: v for k, v in self.params.items() if k not in logged})

  def _resume(self) -> dict | None:
    """The params of the run to continue, marked running again; None if it is not there."""
    from mlflow.exceptions import MlflowException

    try:
      run = self.client.get_run(self.run_id)
    except MlflowException as e:
      if e.error_code != "RESOURCE_DOES_NOT_EXIST":
        raise
      log.info("mlflow run %s not found at %s; starting a new one", self.run_id, self.uri)
      return None
    self.client.update_run(self.run_id, status="RUNNING")
    return run.data.params

  def _log_params(self, params: dict) -> None:
    from mlflow.entities import Param

    entries = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in params.items()]
    for chunk in _split(entries, MLFLOW_PARAM_BATCH):
      self.client.log_batch(self.run_id, params=chunk)

  def handle(self, events: list[tuple]) -> None:
    """The metrics of all ``events`` in few ``log_batch`` calls, then text and files."""
    from mlflow.entities import Metric

    metrics = []
    for event in events:
      if event[0] == "metrics":
        _, step, values, ms = event
        metrics += [Metric(_mlflow_key(k), v, ms, step) for k, v in values.items()]
    for chunk in _split(metrics, MLFLOW_BATCH):
      self.client.log_batch(self.run_id, metrics=chunk)
    for event in events:
      if event[0] == "text":
        self._text(*event[1:])
      elif event[0] == "artifacts":
        for path in event[1]:
          if path.is_file():
            self.client.log_artifact(self.run_id, str(path))

  def _text(self, step: int, key: str, text: str) -> None:
    """``<key>/step_000100.txt``; a second text of the same step is appended to it."""
    last_step, earlier = self.texts.get(key, (None, ""))
    text = f"{earlier}\n{text}" if last_step == step else text
    self.texts[key] = (step, text)
    self.client.log_text(self.run_id, text, f"{key}/step_{step:06d}.txt")

  def finish(self, failed: bool) -> None:
    self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _mlflow_key(key: str) -> str:
  """MLflow accepts letters, digits and ``_-. :/`` in a metric name; others become ``_``."""
  return re.sub(r"[^/\w.\- :]", "_", key)


class Wandb:
  """A W&B run. Its id is chosen here, so it is known before the run starts. Every value
  is logged with ``update_step`` as its x-axis instead of W&B's own step, which must only
  grow: a resumed run logs again the steps after its last checkpoint, and W&B would drop
  those."""

  name = "wandb"

  def __init__(self, cfg: WandbConfig, run_dir: pathlib.Path, config: dict, run_id):
    self.cfg, self.run_dir, self.config = cfg, run_dir, flatten(config)
    self.run_id, self.run = run_id or secrets.token_hex(4), None  # W&B ids: [a-z0-9]

  def start(self) -> None:
    """``wandb.init`` writing under ``run_dir/wandb``, silent, without console capture.
    Online without stored credentials it fails instead of prompting for a key."""
    import wandb

    if self.cfg.mode == "online" and not wandb.login(prompt=False, verify=False):
      raise RuntimeError(
        "no W&B API key: run `wandb login`, set WANDB_API_KEY, or set wandb.mode: offline"
      )
    settings = wandb.Settings(silent=True, console="off", init_timeout=WANDB_INIT_TIMEOUT_S)
    self.run = wandb.init(
      project=self.cfg.project,
      entity=self.cfg.entity or None,
      mode=self.cfg.mode,
      dir=str(self.run_dir),
      id=self.run_id,
      name=self.run_dir.name,
      resume="allow",
      config=self.config,
      reinit="create_new",
      settings=settings,
    )
    self.run.define_metric("update_step")
    self.run.define_metric("*", step_metric="update_step")

  def handle(self, events: list[tuple]) -> None:
    import wandb

    for event in events:
      if event[0] == "metrics":
        self.run.log({**event[2], "update_step": event[1]})
      elif event[0] == "text":
        page = wandb.Html(f"<pre>{html.escape(event[3])}</pre>")
        self.run.log({event[2]: page, "update_step": event[1]})
      elif event[0] == "artifacts":
        self._save(event[1])

  def _save(self, paths) -> None:
    """Copies into the run's ``files/jaxstep`` (W&B keeps its own ``config.yaml`` there),
    uploaded as they are now."""
    folder = pathlib.Path(self.run.dir) / "jaxstep"
    folder.mkdir(exist_ok=True)
    for path in paths:
      if path.is_file():
        shutil.copyfile(path, folder / path.name)
        self.run.save(str(folder / path.name), base_path=self.run.dir, policy="now")

  def finish(self, failed: bool) -> None:
    self.run.finish(exit_code=1 if failed else 0)
