"""Interleaved, paired measurements across long-lived worker processes.

These machines are noisy (the same matmul varies 2× within minutes), so a comparison is
only meaningful as a *ratio within one round*: every contender runs in its own process,
compiles and warms up first, then each round times every contender once in a fresh random
order. We report the median and interquartile range of the per-round ratios.

``--quick`` is a smoke run of that same path, not a measurement: under ``quick_compiles``
the workers share a compilation cache and faster-compiling XLA flags, start as many as there
are cores at a time, and a worker of a ``REUSABLE`` kind goes on to a later suite's
contender (still one contender per process at a time).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def scratch_dir(prefix: str) -> pathlib.Path:
  """A new temporary folder that is removed when this process exits: a worker's runs and
  prepared data (a worker exits when its stdin closes) are not left in the temporary dir."""
  path = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
  atexit.register(shutil.rmtree, path, True)
  return path


class Worker:
  """``python -m benchmarks.worker SPEC``: prints ``ready JSON``, then one JSON per ``run``.

  The process starts at construction; ``info`` waits for its ``ready`` line, so several
  workers can be started first and build (import, compile, warm up) side by side."""

  def __init__(self, spec: dict, env: dict | None = None):
    self.spec, self.env = spec, _worker_env(env)
    self.proc = subprocess.Popen(
      [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=self.env,
      cwd=pathlib.Path(__file__).resolve().parent.parent,
    )
    self._info = None

  def rebuild(self, spec: dict) -> None:
    """The process drops its contender and builds ``spec``'s (``build`` on stdin): the
    next ``info`` is that one's."""
    self.spec, self._info = spec, None
    self.proc.stdin.write("build " + json.dumps(spec) + "\n")
    self.proc.stdin.flush()

  @property
  def info(self) -> dict:
    if self._info is None:
      self._info = self._read("ready")
    return self._info

  def _read(self, tag: str) -> dict:
    for line in self.proc.stdout:
      if line.startswith(tag + " "):
        return json.loads(line[len(tag) + 1 :])
    raise RuntimeError(f"worker {self.spec} exited with {self.proc.wait()}")

  def start_run(self) -> None:
    self.info  # noqa: B018 -- the ready line comes first
    self.proc.stdin.write("run\n")
    self.proc.stdin.flush()

  def result(self) -> dict:
    return self._read("result")

  def run(self) -> dict:
    self.start_run()
    return self.result()

  def release(self) -> None:
    """Closes stdin, which ends the worker, without waiting for it to exit."""
    if self.proc.poll() is None and not self.proc.stdin.closed:
      self.proc.stdin.close()

  def close(self) -> None:
    if self.proc.poll() is None:
      self.release()
      self.proc.wait(timeout=60)


def close_all(workers) -> None:
  """Ends every worker (``Worker`` or ``Together``), then waits for each: they exit side
  by side rather than one after another."""
  for w in workers:
    w.release()
  for w in workers:
    w.close()


class Together:
  """``copies`` workers of one spec that run at the same moment; a run lasts as long as the
  slowest of them. Timing this against one copy alone shows how much the cores slow each
  other down when all are busy (shared execution units, caches, memory bandwidth)."""

  def __init__(self, spec: dict, copies: int, env: dict | None = None):
    self.workers = [Worker(spec, env) for _ in range(copies)]

  @property
  def info(self) -> dict:
    ready = [w.info for w in self.workers]  # waits for every copy
    return ready[0]

  def run(self) -> dict:
    for w in self.workers:
      w.start_run()
    return max((w.result() for w in self.workers), key=lambda r: r["seconds"])

  def release(self) -> None:
    for w in self.workers:
      w.release()

  def close(self) -> None:
    close_all(self.workers)


def interleaved(workers: dict[str, Worker], rounds: int, seed: int = 0) -> dict[str, list]:
  """``rounds`` rounds; in each, every worker runs once, in a fresh random order."""
  rng = random.Random(seed)
  results = {name: [] for name in workers}
  for _ in range(rounds):
    order = list(workers)
    rng.shuffle(order)
    for name in order:
      results[name].append(workers[name].run())
  return results


def ratio_stats(numerators, denominators) -> dict:
  """Median and IQR of per-round ratios ``numerator_i / denominator_i``."""
  r = np.asarray(numerators, float) / np.asarray(denominators, float)
  q1, med, q3 = np.percentile(r, [25, 50, 75])
  return {"median": float(med), "q1": float(q1), "q3": float(q3), "rounds": len(r)}


# A worker's ``env`` that keeps it out of ``quick_compiles``' cache: it measures compiles.
OWN_COMPILES = {"JAX_ENABLE_COMPILATION_CACHE": "false"}
_QUICK: dict[str, str] = {}  # set by ``quick_compiles``: what every worker's environment gets
# The kinds whose contender leaves its process as it found it (no device split, no XLA
# flags set; not ``jaxstep``, which splits the CPU before JAX starts), by what they import:
# under ``quick_compiles`` a ``measure`` hands their workers on to the next one's contenders
# of these kinds and the same environment, which then build in a process already started
# and imported (``Worker.rebuild``), one that imported the same things where there is one.
REUSABLE = {
  **dict.fromkeys(["loop", "samples_cost"], "trainer"),
  **dict.fromkeys(
    ["floor", "multisteps", "unrolled", "matmul", "decode_jax", "llama_decode_jax"], "models"
  ),
  **dict.fromkeys(["torch", "torch_llama", "decode_hf", "llama_decode_hf"], "torch"),
  **dict.fromkeys(
    ["startup", "tokenize_raw", "prepare", "loader", "data_startup", "global_batch"], "data"
  ),
}
_IDLE: list[Worker] = []  # REUSABLE workers between two measures of a quick run
MAX_IDLE = 12  # the most kept (each holds its imports' memory)
_IDLE_LOCK = threading.Lock()  # quick runs measure several suites at once


def quick_xla_flags() -> list[str]:
  """XLA flags that make a train step of the quick sizes compile ~4× faster on a CPU (and
  run slower): no backend (LLVM) optimizations and, on the jaxlib where that was measured
  (XLA aborts on a flag it does not know), the older fusion emitters."""
  from importlib.metadata import version

  flags = ["--xla_backend_optimization_level=0"]
  if version("jaxlib").startswith("0.10."):
    flags.append("--xla_cpu_use_fusion_emitters=false")
  return flags


@contextlib.contextmanager
def quick_compiles():
  """For ``--quick``, a smoke run whose numbers are not measurements and whose many workers
  compile the same few small programs: while open, the workers started (and their
  subprocesses) share one persistent compilation cache in a temporary folder, every program
  in it however quick its compile, so that a worker loads what another one compiled; and
  XLA, in them and in this process, compiles with ``quick_xla_flags``. Enter it before JAX
  starts its backend in this process."""
  flags = os.environ.get("XLA_FLAGS")
  with tempfile.TemporaryDirectory(prefix="jaxstep-bench-jit-") as cache:
    _QUICK.update(
      JAX_COMPILATION_CACHE_DIR=cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      XLA_FLAGS=" ".join(quick_xla_flags()),
    )
    os.environ["XLA_FLAGS"] = _with_quick_flags(flags or "")
    try:
      yield
    finally:
      _QUICK.clear()
      with _IDLE_LOCK:
        close_all(_IDLE)
        _IDLE.clear()
      if flags is None:
        os.environ.pop("XLA_FLAGS", None)
      else:
        os.environ["XLA_FLAGS"] = flags


def _with_quick_flags(flags: str) -> str:
  """``flags`` and then those of ``quick_compiles`` (while open) that it does not hold."""
  extra = [f for f in _QUICK.get("XLA_FLAGS", "").split() if f not in flags.split()]
  return " ".join([*flags.split(), *extra])


def _worker_env(env: dict | None) -> dict:
  """This process's environment without JAX's persistent compilation cache (every worker
  compiles: compile times are measured, and a warm-up must not differ between contenders),
  then ``env``; under ``quick_compiles`` its cache and flags too."""
  out = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  out["JAXSTEP_XLA_CACHE"] = "off"  # nor the commands' own cache, in a command it starts
  flags = (env or {}).get("XLA_FLAGS", out.get("XLA_FLAGS", ""))
  out |= _QUICK | (env or {})
  if _QUICK:  # a spec's own XLA_FLAGS keep the quick ones
    out["XLA_FLAGS"] = _with_quick_flags(flags)
  return out


def environment() -> dict:
  """Versions, flags and devices that a result depends on."""
  import jax
  import jaxlib

  try:
    import torch

    torch_version = torch.__version__
  except ImportError:
    torch_version = None
  return {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "torch": torch_version,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "device_kind": jax.devices()[0].device_kind,
    "device_count": jax.device_count(),
    "cpu_count": os.cpu_count(),
    "machine": platform.machine(),
  }


def write(name: str, payload: dict, out_dir: pathlib.Path = RESULTS) -> pathlib.Path:
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{name}.json"
  path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
  return path


def fmt(stats: dict) -> str:
  return f"{stats['median']:.3f} ({stats['q1']:.3f}–{stats['q3']:.3f})"


def _start(spec: dict) -> Worker | Together:
  """A worker building ``spec``'s contender: an idle one of ``quick_compiles`` where there
  is one for it, else a new process."""
  env, copies = spec.get("env"), spec.get("copies")
  if copies:
    return Together(spec, copies, env)
  if _QUICK and spec["kind"] in REUSABLE:
    wanted = _worker_env(env)
    kind = spec["kind"]
    with _IDLE_LOCK:  # best one that built this kind, or one that imports the same
      fits = [w for w in _IDLE if w.env == wanted and w.proc.poll() is None]
      idle = min(
        fits,
        key=lambda w: (w.spec["kind"] != kind, REUSABLE[w.spec["kind"]] != REUSABLE[kind]),
        default=None,
      )
      if idle is not None:
        _IDLE.remove(idle)
    if idle is not None:
      try:
        idle.rebuild(spec)
        return idle
      except OSError:  # it has exited since (its stdin is a broken pipe): a new one
        idle.close()
  return Worker(spec, env)


def _finish(workers: list, reuse: bool) -> None:
  """Closes ``workers``; with ``reuse`` (their runs done, nothing left to read), keeps
  those of ``quick_compiles``' REUSABLE kinds idle for the next ``measure`` instead."""
  kept = [
    w for w in workers if reuse and _QUICK and isinstance(w, Worker) and w.spec["kind"] in REUSABLE
  ]
  with _IDLE_LOCK:
    _IDLE.extend(kept)
    spare = _IDLE[: max(len(_IDLE) - MAX_IDLE, 0)]  # the longest idle first
    del _IDLE[: len(spare)]
  close_all([w for w in workers if w not in kept] + spare)


def measure(specs: dict, rounds: int, while_building=None) -> tuple[dict, dict, dict]:
  """Starts a worker per spec, runs ``rounds`` interleaved rounds, closes every worker;
  ``while_building()``, if given, runs while the (first) workers build.

  A spec's ``env`` is added to its worker's environment; ``copies: n`` runs n workers of it
  at the same moment (``Together``). Returns ``(results per name, ready-info per name,
  failed)``; a worker that cannot start (e.g. torch.compile on some hosts) is recorded in
  ``failed`` instead of stopping the suite. Under ``quick_compiles`` workers start as many
  as there are cores at a time, and those of REUSABLE kinds go on to the next ``measure``.
  """
  workers, failed, done = {}, {}, False
  names = list(specs)
  # All at once; with a shared compilation cache, as many as there are cores at a time, in
  # the order of ``specs``, so that a later worker loads what an earlier one compiled.
  at_once = max(os.cpu_count() or 1, 1) if _QUICK else max(len(names), 1)
  try:
    for first in range(0, max(len(names), 1), at_once):
      started = names[first : first + at_once]
      for name in started:  # they build side by side
        workers[name] = _start(specs[name])
      if while_building is not None and first == 0:
        while_building()
      for name in started:
        try:
          workers[name].info  # noqa: B018 -- waits until built and warmed up
        except RuntimeError as e:
          failed[name] = str(e)
          workers.pop(name).close()
    res = interleaved(workers, rounds=rounds)
    info = {n: w.info for n, w in workers.items()}
    done = True
  finally:
    _finish(list(workers.values()), reuse=done)
  return res, info, failed
