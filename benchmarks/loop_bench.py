"""The run loop itself: host-side overhead per update step, and checkpoint stalls.

* host overhead = step time with the device step replaced by a jitted no-op ÷ real step time
  (batch assembly, host checks, device_put, dispatch, metric read-back, logging).
* checkpoint stall = extra loop time per save ÷ one step time, async and sync saves, two
  ways: across runs (total loop time with saves − without, per save; this includes any
  slowdown of the steps while the async write runs) and within one run (the update step
  whose interval holds the save − the median step without one: the blocking part).
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import shutil
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.harness import scratch_dir
from jaxstep import trainer
from jaxstep.trainer import config_run
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.loop.callbacks import Callback
from jaxstep.trainer.store.checkpoint import Checkpointer


class StepTimes(Callback):
  def __init__(self):
    self.values = []

  def on_step_end(self, step, metrics, control):
    self.values.append(metrics["step_time"])


def noop_step(state, batch):
  """Same inputs and outputs as the train step, no work: what is left is host overhead."""
  zero = jnp.zeros((), jnp.float32)
  tokens = jnp.sum(batch["loss_mask"])
  return state, {
    "loss": zero + 1,
    "tokens": tokens,
    "grad_norm": zero,
    "lr": zero,
    "updated": tokens > 0,
    "extra_loss": zero,
    "correct": zero,
  }


def _build(spec: dict, tmp: pathlib.Path):
  overrides = [
    *spec.get("overrides", []),
    "train.progress=false",
    "data.eval_fraction=0",
    "train.eval_every=0",
    f"run_dir={tmp / 'run'}",
    f"train.max_steps={spec['steps']}",
    f"checkpoint.every={spec.get('save_every', 0)}",
  ]
  cfg = config_lib.load(spec.get("config", "tiny"), overrides)
  run, state, rs = trainer.build(cfg)
  if spec.get("noop"):
    run = dataclasses.replace(run, step_fn=jax.jit(noop_step, donate_argnums=0))
  (tmp / "run").mkdir()
  return cfg, run, state, rs


def _bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def _save_restore_rates(state, tmp: pathlib.Path) -> dict:
  """MB/s of a synchronous save and a restore of the whole TrainState (MB = 2^20 bytes)."""
  ckpt = Checkpointer(tmp / "rate", async_save=False, keep=1)
  t = time.perf_counter()
  ckpt.save(1, state)
  ckpt.wait()
  save_s = time.perf_counter() - t
  t = time.perf_counter()
  restored = ckpt.restore(state).state
  jax.block_until_ready(restored)
  restore_s = time.perf_counter() - t
  ckpt.close()
  mb = _bytes(state) / 2**20
  return {"state_mb": mb, "save_mb_per_s": mb / save_s, "restore_mb_per_s": mb / restore_s}


def loop_contender(spec: dict):
  """Runs ``spec['steps']`` update steps of the real loop per ``run``.

  spec: ``config``, ``overrides``, ``steps``, ``noop`` (jitted no-op step), ``save_every``
  (0 = no saves), ``async_save``.
  """
  tmp = scratch_dir("jaxstep-bench-")
  cfg, run, state0, rs0 = _build(spec, tmp)
  counter = itertools.count()

  def run_once() -> dict:
    state = jax.tree.map(jnp.copy, state0)  # the loop donates its state
    ck_dir = tmp / f"ck{next(counter)}"
    ckpt = Checkpointer(ck_dir, async_save=spec.get("async_save", True))
    times = StepTimes()
    config_run.run_loop(run, state, rs0, ckpt=ckpt, run_dir=tmp / "run", callbacks=[times])
    shutil.rmtree(ck_dir)
    steady = times.values[1:]  # the first includes compilation
    every = spec.get("save_every", 0)
    # A save after update s blocks (at least) until s is computed and copied to the host,
    # before update s + 1 is dispatched: it lands in the interval reported for s.
    hit = [s for s in range(2, len(times.values) + 1) if every and s % every == 0]
    plain = [t for s, t in enumerate(times.values[1:], start=2) if s not in hit]
    return {
      "median_step": statistics.median(steady),
      "total": sum(steady),
      "saves": spec["steps"] // every if every else 0,
      "blocking_per_save": (
        statistics.mean(times.values[s - 1] for s in hit) - statistics.median(plain) if hit else 0.0
      ),
    }

  run_once()  # compile + warm up
  info = {"tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_len}
  if spec.get("rates"):
    info.update(_save_restore_rates(state0, tmp))
  return info, run_once


CONTENDERS = {"loop": loop_contender}
