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

import importlib.util
import logging
import numbers
import pathlib
import queue
import threading
import time

import numpy as np

from jaxstep.errors import ConfigError, first_line
from jaxstep.trainer.config.schema import EXTERNAL_TRACKERS as EXTERNAL
from jaxstep.trainer.config.schema import MlflowConfig, WandbConfig, check_tracker_names
from jaxstep.trainer.tracking import backends

log = logging.getLogger("jaxstep")

QUEUE_EVENTS = 10_000  # events waiting for the tracker thread; more are dropped, counted
START_WAIT_S = 10.0  # open_trackers waits this long at most for the trackers to start


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
  check_tracker_names(names)
  opened = []
  if "mlflow" in names:
    opened.append(backends.Mlflow(mlflow, run_dir, config, ids.get("mlflow") if resumed else None))
  if "wandb" in names and wandb.mode != "disabled":
    opened.append(backends.Wandb(wandb, run_dir, config, ids.get("wandb") if resumed else None))
  trackers = Trackers(opened)
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
