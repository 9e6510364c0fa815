"""Interleaved, paired measurements across long-lived worker processes.

These machines are noisy (the same matmul varies 2× within minutes), so a comparison is
only meaningful as a *ratio within one round*: every contender runs in its own process,
compiles and warms up first, then each round times every contender once in a fresh random
order. We report the median and interquartile range of the per-round ratios.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import random
import subprocess
import sys

import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


class Worker:
  """``python -m benchmarks.worker SPEC``: prints ``ready JSON``, then one JSON per ``run``.

  The process starts at construction; ``info`` waits for its ``ready`` line, so several
  workers can be started first and build (import, compile, warm up) side by side."""

  def __init__(self, spec: dict, env: dict | None = None):
    self.spec = spec
    self.proc = subprocess.Popen(
      [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env={**_uncached(os.environ), **(env or {})},
      cwd=pathlib.Path(__file__).resolve().parent.parent,
    )
    self._info = None

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

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.stdin.close()
      self.proc.wait(timeout=60)


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

  def close(self) -> None:
    for w in self.workers:
      w.close()


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


def _uncached(env) -> dict:
  """``env`` without JAX's persistent compilation cache: every worker compiles (compile
  times are measured, and a warm-up must not differ between contenders)."""
  return {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}


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


def measure(specs: dict, rounds: int, while_building=None) -> tuple[dict, dict, dict]:
  """Starts a worker per spec, runs ``rounds`` interleaved rounds, closes every worker;
  ``while_building()``, if given, runs while the workers build.

  A spec's ``env`` is added to its worker's environment; ``copies: n`` runs n workers of it
  at the same moment (``Together``). Returns ``(results per name, ready-info per name,
  failed)``; a worker that cannot start (e.g. torch.compile on some hosts) is recorded in
  ``failed`` instead of stopping the suite.
  """
  workers, failed = {}, {}
  try:
    for name, spec in specs.items():  # start them all; they build side by side
      env, copies = spec.get("env"), spec.get("copies")
      workers[name] = Together(spec, copies, env) if copies else Worker(spec, env)
    if while_building is not None:
      while_building()
    for name in list(workers):
      try:
        workers[name].info  # noqa: B018 -- waits until built and warmed up
      except RuntimeError as e:
        failed[name] = str(e)
        workers.pop(name).close()
    res = interleaved(workers, rounds=rounds)
  finally:
    for w in workers.values():
      w.close()
  return res, {n: w.info for n, w in workers.items()}, failed
