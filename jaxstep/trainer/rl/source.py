"""Where an RL run's batches come from: ``Rollouts``, an iterator that every
``rl.iterations`` updates takes the next P = G / ``num_generations`` prompts of the epoch's
order, samples a rollout with the params of that moment (with ``rl.filter_groups``, draws of
the next P again until P groups carry signal: ``rollout.assemble``), and hands it to the step
``rl.iterations`` times (each batch says which pass it is, ``rl_pass``, for ``LogpCheck``);
and ``RolloutSource``, the ``BatchSource`` of ``jaxstep train`` around it.

Position: ``(epoch, step_in_epoch)`` counts rollouts (prompt batches) as a supervised run
counts batches, and ``updates`` the passes handed out. A rollout is a pure function of the
params and its seed, so a run resumed at a rollout's start samples it again; with
``rl.iterations`` > 1 a checkpoint can fall between passes, so each rollout is also kept in
``RUN/rl_rollout.npz`` (written whole, then renamed) and read back.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import pathlib
from collections.abc import Callable

import jax
import numpy as np

from jaxstep.core.distill import check_completion_column
from jaxstep.core.layout import rows_here
from jaxstep.core.rl import RLConfig
from jaxstep.data.prompt_rows import PromptSet
from jaxstep.errors import CheckpointError, ConfigError
from jaxstep.generation import Generator
from jaxstep.trainer.rl import rewards as rewards_lib
from jaxstep.trainer.rl import rollout as rollout_lib
from jaxstep.trainer.store import records

log = logging.getLogger("jaxstep")

HOST = "rl_metrics"  # the batch's host-only entry: the rollout's metrics for the record
ROLLOUT_FILE = "rl_rollout.npz"


def rollout_seed(seed: int, index: int) -> int:
  return (seed * 1_000_003 + index) % 2**32


class Rollouts:
  """RL global batches, one per update, following the resumable-iterator protocol
  (``get_state``/``set_state``), so a ``jaxstep.Trainer`` checkpoints its place.

  Args:
    prompts: the training prompts; ``generator``: a ``Generator`` of the model (its params
      are set at each rollout); ``rewards``: ``rewards.Reward`` objects; ``r``: the settings;
    global_batch_size: G completions per update (a multiple of ``r.num_generations``);
    seq_len: each row's window (the longest prompt + ``r.max_new_tokens`` − 1 at most);
    seed: the run's seed (rollout i samples with ``rollout_seed(seed, i)``);
    file: where a rollout is kept between passes (``rl.iterations`` > 1; None: nowhere);
    writer: whether this process writes ``file``; sharding: the step's batch sharding;
    lmbda: GKD's share of rollouts the policy samples; the others are the prompts' own
      completions (``completion_column``), each rollout's choice a function of the seed
      and its index, so a resumed run makes it again; below 1 every batch carries
      ``distill.GIVEN`` and its record ``distill/on_policy`` (1 sampled, 0 given).
  ``params`` must be set to a ``() -> current params`` before the first batch."""

  def __init__(
    self,
    prompts: PromptSet,
    generator: Generator,
    rewards: list,
    r: RLConfig,
    *,
    global_batch_size: int,
    seq_len: int,
    seed: int,
    file: pathlib.Path | None = None,
    writer: bool = True,
    sharding=None,
    lmbda: float = 1.0,
    completion_column: str = "completion",
  ):
    self.prompts, self.generator, self.rewards, self.r = prompts, generator, rewards, r
    self.seq_len, self.seed, self.file, self.writer = seq_len, seed, file, writer
    self.sharding, self.lmbda, self.column = sharding, lmbda, completion_column
    check_completion_column(lmbda, completion_column, prompts.columns)
    if sharding is not None and not sharding.is_fully_addressable:
      here = len(rows_here(sharding, global_batch_size))
      process = jax.process_index()
      log.info(
        "rollouts: process %d samples and scores %d of each rollout's %d completions",
        process,
        here,
        global_batch_size,
      )
      if file is not None:  # each process keeps its own rows between passes
        self.file, self.writer = file.with_name(f"{file.stem}.process{process}.npz"), True
    self.per_rollout = global_batch_size // r.num_generations
    self.batches_per_epoch = len(prompts) // self.per_rollout
    if not self.batches_per_epoch:
      raise ConfigError(
        f"{len(prompts)} training prompts do not fill one rollout of {self.per_rollout} "
        f"(global batch {global_batch_size} / {r.num_generations} generations); give more "
        f"prompts or a smaller global batch"
      )
    self.params: Callable | None = None
    self.epoch = self.step_in_epoch = self.updates = 0
    self.current = None

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    passed = self.updates % self.r.iterations
    if passed == 0:
      self.current = self._sample(self.updates // self.r.iterations)
    self.updates += 1
    return {**self.current.batch, HOST: {**self.current.metrics, "rl_pass": passed}}

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "updates": self.updates}

  def set_state(self, state: dict) -> None:
    self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
    self.updates, self.current = int(state["updates"]), None
    if self.updates % self.r.iterations:
      self.current = self._read_back(self.updates // self.r.iterations)

  def _sample(self, index: int):
    """Rollout ``index``: one draw of the next P prompts; with ``rl.filter_groups``, more
    draws of the next P until P informative groups are drawn or ``rl.max_draws`` are; with
    ``lmbda`` < 1, the next P prompts' own completions where the seeded coin says so."""
    out = rollout_lib.sampled_or_given(
      self.seed, index, self.lmbda, lambda: self._draws(index),
      lambda: rollout_lib.given_rollout(self.generator.tokenizer, self._prompts(), self.r,
                                        self.rewards, self.column, seq_len=self.seq_len,
                                        sharding=self.sharding),
    )  # fmt: skip
    if self.r.iterations > 1 and self.writer and self.file is not None:
      self._keep(index, out)
    return out

  def _draws(self, index: int):
    r, draws, kept = self.r, [], 0
    for d in range(r.max_draws if r.filter_groups else 1):
      seed = rollout_seed(self.seed, index) ^ (d * 0x9E3779B9 % 2**32)  # draw 0: the plain seed
      one = rollout_lib.draw(
        self.generator,
        self.params(),
        self._prompts(),
        r,
        self.rewards,
        seq_len=self.seq_len,
        seed=seed,
        sharding=self.sharding,
      )
      draws.append(one)
      kept += int(rollout_lib.informative(one.total, r.num_generations).sum())
      if kept >= self.per_rollout:
        break
    groups = self.per_rollout if r.filter_groups else None
    return rollout_lib.assemble(draws, r, self.rewards, sharding=self.sharding, groups=groups)

  def _prompts(self) -> PromptSet:
    """The next P prompts of the epoch's order; the position moves past them."""
    epoch, index = self.epoch, self.step_in_epoch
    self.step_in_epoch += 1
    if self.step_in_epoch == self.batches_per_epoch:
      self.epoch, self.step_in_epoch = self.epoch + 1, 0
    return rollout_lib.prompt_batch(self.prompts, self.seed, epoch, index, self.per_rollout)

  def _keep(self, index: int, out) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, index=index, metrics=json.dumps(out.metrics), **out.batch)
    records.write_atomic(self.file, buffer.getvalue())

  def _read_back(self, index: int):
    """The rollout a checkpoint between passes continued with (``_keep``).

    Raises:
      CheckpointError: the file is missing, cut short or has changed bytes (every array is
        read whole, so its CRC-32 is checked), or holds another rollout.
    """
    try:
      if self.file is None:
        raise OSError("no file keeps rollouts between passes")
      stored = records.read_npz(self.file, ("index", "metrics"))
      kept = int(stored.pop("index"))
      metrics = json.loads(str(stored.pop("metrics")))
    except (OSError, ValueError) as e:
      raise CheckpointError(
        f"the checkpoint stopped between passes over rollout {index}, but {self.file} cannot "
        f"be read ({e}); resume from an earlier checkpoint (--resume-from) of a rollout's start"
      ) from e
    if kept != index:
      raise CheckpointError(f"{self.file} holds rollout {kept}, not {index}")
    return rollout_lib.Rollout(stored, metrics)


class RolloutSource:
  """The ``BatchSource`` of ``jaxstep train``'s RL run: ``Rollouts`` over ``run``'s (a
  ``plan.build.Run`` of an RL config) training prompts from ``rs`` (``rs.step`` updates
  done); ``run_dir`` and ``writer`` (this process writes the rollout file). Its ``params``
  must be set to a ``() -> current params`` before the first ``next_batch``."""

  def __init__(self, run, rs, *, run_dir: pathlib.Path, writer: bool = True):
    cfg = run.cfg
    self.start = rs
    self.rollouts = Rollouts(
      run.dataset.train,
      Generator(cfg.model, None, run.dataset.tokenizer),
      rewards_lib.load_rewards(cfg.rl.rewards, cfg.rl.reward_weights),
      cfg.rl,
      global_batch_size=cfg.train.global_batch_size,
      seq_len=cfg.train.seq_len,
      seed=cfg.train.seed,
      file=pathlib.Path(run_dir) / ROLLOUT_FILE,
      writer=writer,
      sharding=run.batch_sharding,  # each device samples the rows it will train on
      lmbda=cfg.distill.lmbda if cfg.distill.teacher else 1.0,
      completion_column=cfg.distill.completion_column,
    )
    self.rollouts.set_state(
      {"epoch": rs.epoch, "step_in_epoch": rs.step_in_epoch, "updates": rs.step}
    )

  @property
  def params(self):
    return self.rollouts.params

  @params.setter
  def params(self, value) -> None:
    self.rollouts.params = value

  @property
  def rs(self):
    """The run position after the batches handed out so far: ``step`` the update steps
    (``RunState.step``, one per pass over a rollout, μ per rollout), ``epoch`` and
    ``step_in_epoch`` the prompts, which move once per rollout."""
    ro = self.rollouts
    return dataclasses.replace(
      self.start, step=ro.updates, epoch=ro.epoch, step_in_epoch=ro.step_in_epoch
    )

  def next_batch(self) -> dict:
    return next(self.rollouts)

  def where(self) -> dict:
    return {"epoch": self.rollouts.epoch, "step_in_epoch": self.rollouts.step_in_epoch}

  def mark(self):
    return self.rs

  def position(self, mark) -> dict:
    return mark.to_json()
