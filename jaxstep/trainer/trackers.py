"""External experiment trackers, MLflow and Weights & Biases, fed by the run loop.

The loop writes ``metrics.jsonl`` and TensorBoard events itself; this module mirrors the
same train and eval metrics, the generated samples, the resolved config and the end-of-run
files (loss plot, config) to the trackers ``train.trackers`` names. A tracker is a
convenience, never a reason to stop or slow training: every call into a tracker library
runs on one background thread fed by a queue (the loop only enqueues, a few microseconds
per logged step), and a tracker that raises is switched off with one warning.

``mlflow`` and ``wandb`` are optional extras, imported on the background thread when a run
uses them, never by importing this module. Only process 0 opens trackers.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import logging
import numbers
import os
import pathlib
import queue
import re
import secrets
import shutil
import threading
import time
import urllib.parse

import numpy as np

from jaxstep.errors import ConfigError, first_line

log = logging.getLogger("jaxstep")

EXTERNAL = ("mlflow", "wandb")  # the trackers this module drives
KNOWN = ("jsonl", "tensorboard", *EXTERNAL)  # every name train.trackers accepts
QUEUE_EVENTS = 10_000  # events waiting for the tracker thread; more are dropped, counted
START_WAIT_S = 10.0  # open_trackers waits this long at most for the trackers to start
WANDB_INIT_TIMEOUT_S = 60.0
MLFLOW_BATCH = 1000  # metrics per log_batch (MLflow's limit)
MLFLOW_PARAM_BATCH = 100  # params per log_batch (MLflow's limit)
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest param value


@dataclasses.dataclass(frozen=True)
class MlflowConfig:
  """Config section ``mlflow``: where an MLflow run goes when ``train.trackers`` names it."""

  tracking_uri: str = ""  # "" = a local file store in run_dir/mlruns; or http(s)://, sqlite:///
  experiment: str = "jaxstep"  # experiment name, created when missing

  def __post_init__(self):
    if not self.experiment.strip():
      raise ConfigError("mlflow.experiment must be non-empty, e.g. jaxstep")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """Config section ``wandb``: where a W&B run goes when ``train.trackers`` names it."""

  project: str = "jaxstep"  # W&B project, created when missing
  entity: str = ""  # user or team ("" = the account's default entity)
  mode: str = "online"  # online | offline (written under run_dir/wandb; wandb sync) | disabled

  def __post_init__(self):
    if not self.project.strip():
      raise ConfigError("wandb.project must be non-empty, e.g. jaxstep")
    if self.mode not in ("online", "offline", "disabled"):
      raise ConfigError(f"wandb.mode must be online, offline or disabled, got {self.mode!r}")


def check_names(names) -> None:
  """Raises ``ConfigError`` for an unknown or repeated tracker name, or a list without
  ``jsonl``: ``metrics.jsonl`` is the run's own record that resume, plot and checkpoints
  read, so it cannot be switched off."""
  seen = set()
  for name in names:
    if name not in KNOWN:
      raise ConfigError(f"train.trackers: unknown tracker {name!r}; known: {', '.join(KNOWN)}")
    if name in seen:
      raise ConfigError(f"train.trackers names {name} twice")
    seen.add(name)
  if "jsonl" not in seen:
    raise ConfigError(
      "train.trackers must include jsonl: metrics.jsonl is the run's own record "
      "(resume, plot and checkpoints read it)"
    )


def check_available(names) -> None:
  """Raises ``ConfigError`` for an external tracker whose package is not installed, before
  a run starts (without importing the package)."""
  for name in names:
    if name in EXTERNAL and importlib.util.find_spec(name) is None:
      raise ConfigError(
        f"train.trackers names {name}, but the {name} package is not installed; "
        f"pip install 'jaxstep[{name}]'"
      )


def open_trackers(
  names,
  *,
  run_dir: pathlib.Path,
  config: dict,
  mlflow: MlflowConfig,
  wandb: WandbConfig,
  ids: dict[str, str],
  resumed: bool,
) -> Trackers:
  """The external trackers of ``names`` (``jsonl``/``tensorboard`` are the loop's own).

  Call it on process 0 only: the trackers receive one copy of each metric. ``config`` (the
  resolved config as a nested dict) is logged as hyper-parameters with dotted keys. A
  resumed run (``resumed``) whose earlier start left run ids in ``ids`` continues those
  tracker runs. MLflow params cannot change once logged, so a resumed run logs only the
  keys its MLflow run lacks: a value changed on resume keeps the first start's value there
  (the ``config.yaml`` artifact holds the current one); W&B's config takes the new values.

  The trackers start on the background thread; this waits up to ``START_WAIT_S`` for them
  (about a second each, mostly importing the library) so that ``Trackers.ids`` holds the
  MLflow run id from the start. It never fails: a tracker that cannot start is switched off
  with one warning.
  """
  check_names(names)
  backends = []
  if "mlflow" in names:
    backends.append(_Mlflow(mlflow, run_dir, config, ids.get("mlflow") if resumed else None))
  if "wandb" in names and wandb.mode != "disabled":
    backends.append(_Wandb(wandb, run_dir, config, ids.get("wandb") if resumed else None))
  trackers = Trackers(backends)
  trackers._started.wait(START_WAIT_S)
  return trackers


class Trackers:
  """The open trackers of a run. ``metrics``, ``text`` and ``artifacts`` only enqueue; one
  background thread makes every library call. With no external tracker it does nothing."""

  def __init__(self, backends: list):
    self._backends = backends
    self._started = threading.Event()
    self._active = bool(backends)
    self._dropped = 0
    self._queue = queue.Queue(QUEUE_EVENTS)
    self._thread = None
    if backends:
      self._thread = threading.Thread(target=self._work, name="jaxstep-trackers", daemon=True)
      self._thread.start()
    else:
      self._started.set()

  @property
  def ids(self) -> dict[str, str]:
    """``{tracker: run id}``, to keep in the checkpoint's run state; MLflow's appears once
    its run is created on the background thread."""
    return {b.name: b.run_id for b in self._backends if b.run_id}

  def metrics(self, step: int, values: dict, prefix: str) -> None:
    """Numeric ``values`` of update ``step`` as ``f"{prefix}/{key}"`` (``prefix`` is
    ``train`` or ``eval/<set>``); bools become 0/1, other values are skipped."""
    if self._active and (numeric := scalars(values, prefix)):
      self._put(("metrics", step, numeric, int(time.time() * 1000)))

  def text(self, step: int, key: str, text: str) -> None:
    """Text of update ``step`` (generated samples); several calls of one step add up."""
    if self._active:
      self._put(("text", step, key, text))

  def artifacts(self, paths) -> None:
    """Files to upload as they are when the thread reaches them; missing ones are skipped."""
    if self._active:
      self._put(("artifacts", tuple(pathlib.Path(p) for p in paths)))

  def close(self, timeout: float = 30.0, *, failed: bool = False) -> None:
    """Sends what is queued, then ends the tracker runs (``failed`` marks them failed).
    Returns within ``timeout`` seconds and never raises; what is left then is dropped."""
    if self._thread is None:
      return
    thread, self._thread, self._active = self._thread, None, False
    deadline = time.monotonic() + timeout
    try:
      if thread.is_alive():  # else every tracker is off and nothing reads the queue
        self._queue.put(("stop", failed), timeout=max(timeout, 0.0))
        thread.join(max(deadline - time.monotonic(), 0.0))
      if thread.is_alive():
        log.warning("trackers: still sending after %.0f s; the rest is dropped", timeout)
      if self._dropped:
        log.warning("trackers: %d events dropped (the trackers fell behind)", self._dropped)
    except Exception as e:  # noqa: BLE001 - closing a tracker must not fail the run
      log.warning("trackers: close failed: %s", first_line(e))

  def _put(self, event: tuple) -> None:
    try:
      self._queue.put_nowait(event)
    except queue.Full:
      self._dropped += 1

  def _work(self) -> None:
    """The background thread: start, then hand each batch of queued events to every live
    tracker until ``close``. Nothing escapes it (the loop treats a dead thread as fatal)."""
    try:
      live = [b for b in self._backends if _guard(b, b.start)]
      self._started.set()
      while live:
        events = _take(self._queue)
        stop = events.pop() if events[-1][0] == "stop" else None
        live = [b for b in live if not events or _guard(b, b.handle, events)]
        if stop:
          for backend in live:
            _guard(backend, backend.finish, stop[1])
          return
    except Exception as e:  # noqa: BLE001
      log.warning("trackers: stopped: %s", first_line(e))
    finally:
      self._active = False
      self._started.set()


def _take(events: queue.Queue) -> list[tuple]:
  """The next event (waiting for it) and whatever else is queued, up to a ``stop``."""
  taken = [events.get()]
  while taken[-1][0] != "stop" and len(taken) < QUEUE_EVENTS:
    try:
      taken.append(events.get_nowait())
    except queue.Empty:
      break
  return taken


def _guard(backend, call, *args) -> bool:
  """``call(*args)``; on an error, one warning and False (the tracker is switched off)."""
  try:
    call(*args)
    return True
  except Exception as e:  # noqa: BLE001 - a tracker's failure must not stop training
    log.warning("%s tracker switched off, training goes on: %s", backend.name, first_line(e))
    return False


def scalars(values: dict, prefix: str) -> dict[str, float]:
  """The numeric entries of ``values`` as floats under ``prefix/``; bools as 0/1."""
  out = {}
  for key, value in values.items():
    if isinstance(value, bool | np.bool_ | numbers.Real):
      out[f"{prefix}/{key}"] = float(value)
  return out


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


class _Mlflow:
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
    if urllib.parse.urlparse(self.uri).scheme in ("", "file"):
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
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


class _Wandb:
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
