"""The RL run's ``BatchSource``: every ``rl.iterations`` updates it takes the next
P = G / ``num_generations`` prompts of the epoch's order, samples a rollout with the params
of that moment, and hands the rollout to the step ``rl.iterations`` times (each batch says
which pass it is, ``rl_pass``, for ``LogpCheck``).

Position: ``(epoch, step_in_epoch)`` counts rollouts (prompt batches) as a supervised run
counts batches; the update step says which pass over the current rollout comes next. A
rollout is a pure function of the params and its seed, so a run resumed at a rollout's start
samples it again; with ``rl.iterations`` > 1 a checkpoint can fall between passes, so each
rollout is also kept in ``RUN/rl_rollout.npz`` (written whole, then renamed) and read back.
"""

from __future__ import annotations

import io
import json
import logging
import pathlib
from collections.abc import Callable

import numpy as np

from jaxstep.errors import CheckpointError
from jaxstep.generation import Generator
from jaxstep.trainer.rl import rewards as rewards_lib
from jaxstep.trainer.rl import rollout as rollout_lib
from jaxstep.trainer.store import records

log = logging.getLogger("jaxstep")

HOST = "rl_metrics"  # the batch's host-only entry: the rollout's metrics for the record
ROLLOUT_FILE = "rl_rollout.npz"


def rollout_seed(seed: int, index: int) -> int:
  return (seed * 1_000_003 + index) % 2**32


class RolloutSource:
  """Args: ``run`` (``plan.build.Run`` of an RL config), ``rs`` (the position to start
  from: ``rs.step`` updates done), ``run_dir`` and ``writer`` (this process writes the
  rollout file). ``params`` must be set to a ``() -> current params`` before the first
  ``next_batch``."""

  def __init__(self, run, rs, *, run_dir: pathlib.Path, writer: bool = True):
    cfg = run.cfg
    self.run, self.rs, self.cfg, self.r = run, rs, cfg, cfg.rl
    self.file, self.writer = pathlib.Path(run_dir) / ROLLOUT_FILE, writer
    self.per_rollout = cfg.train.global_batch_size // self.r.num_generations
    self.batches_per_epoch = len(run.dataset.train) // self.per_rollout
    self.rewards = rewards_lib.load_rewards(self.r.rewards, self.r.reward_weights)
    self.generator = Generator(cfg.model, None, run.dataset.tokenizer)
    self.params: Callable | None = None
    # every device samples the rows it will train on (one host: the rows all start here)
    sharding = run.batch_sharding
    self.sharding = sharding if sharding.is_fully_addressable else None
    self.updates = rs.step  # updates done; the next one's pass is updates % iterations
    self.current = None
    if self.updates % self.r.iterations:
      self.current = self._read_back(self.updates // self.r.iterations)

  def next_batch(self) -> dict:
    passed = self.updates % self.r.iterations
    if passed == 0:
      self.current = self._sample(self.updates // self.r.iterations)
    self.updates += 1
    return {**self.current.batch, HOST: {**self.current.metrics, "rl_pass": passed}}

  def _sample(self, index: int):
    prompts = self._prompts()
    out = rollout_lib.sample(
      self.generator,
      self.params(),
      prompts,
      self.r,
      self.rewards,
      seq_len=self.cfg.train.seq_len,
      seed=rollout_seed(self.cfg.train.seed, index),
      sharding=self.sharding,
    )
    if self.r.iterations > 1 and self.writer:
      self._keep(index, out)
    return out

  def _prompts(self):
    """The next P prompts of the epoch's order; the position moves past them."""
    rs, train = self.rs, self.run.dataset.train
    self.rs = rs.advanced(steps_per_epoch=self.batches_per_epoch)
    seed = self.cfg.train.seed
    return rollout_lib.prompt_batch(train, seed, rs.epoch, rs.step_in_epoch, self.per_rollout)

  def _keep(self, index: int, out) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, index=index, metrics=json.dumps(out.metrics), **out.batch)
    records.write_atomic(self.file, buffer.getvalue())

  def _read_back(self, index: int):
    """The rollout a checkpoint between passes continued with (``_keep``)."""
    try:
      with np.load(self.file) as f:
        if int(f["index"]) != index:
          raise CheckpointError(f"{self.file} holds rollout {int(f['index'])}, not {index}")
        batch = {k: f[k] for k in f.files if k not in ("index", "metrics")}
        metrics = json.loads(str(f["metrics"]))
    except OSError as e:
      raise CheckpointError(
        f"the checkpoint stopped between passes over rollout {index}, but {self.file} cannot "
        f"be read ({e}); resume from an earlier checkpoint (--resume-from) of a rollout's start"
      ) from e
    return rollout_lib.Rollout(batch, metrics)

  def where(self) -> dict:
    return {"epoch": self.rs.epoch, "step_in_epoch": self.rs.step_in_epoch}

  def mark(self):
    return self.rs

  def position(self, mark) -> dict:
    return mark.to_json()
