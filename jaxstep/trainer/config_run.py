"""``jaxstep train``: a config's bundled (or imported) model, its data and its hooks, run by
the one run loop (``jaxstep.trainer.loop.loop.Loop``).

Per update step: next global batch → host check (N > 0) → device put → jitted step (state
donated) → metrics of the *previous* step read back (so the host never stalls the device)
→ hooks: the guard, callbacks, checkpoint / evaluation / samples by update-step cadence,
profiling, trackers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from collections.abc import Sequence

import jax
import numpy as np

from jaxstep import data, models, parallel
from jaxstep.core import optim
from jaxstep.core.state import TrainState
from jaxstep.errors import EmptyBatchError
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.config.schema import HELDOUT
from jaxstep.trainer.evaluation.harness_tasks import harness_evaluation
from jaxstep.trainer.evaluation.scoring import EVAL_IN_FLIGHT, eval_record, summed
from jaxstep.trainer.evaluation.text_samples import TextSamples
from jaxstep.trainer.loop import assembly
from jaxstep.trainer.loop.callbacks import Callback
from jaxstep.trainer.loop.hooks import Hook
from jaxstep.trainer.loop.loop import LoopResult
from jaxstep.trainer.plan import preference_plan, reference_logps, steps
from jaxstep.trainer.plan.build import Run, build
from jaxstep.trainer.rl import evaluate as rl_evaluate
from jaxstep.trainer.rl.logp_check import LogpCheck, gap_cause
from jaxstep.trainer.rl.rewards import load_rewards
from jaxstep.trainer.rl.source import HOST as ROLLOUT_METRICS
from jaxstep.trainer.rl.source import RolloutSource
from jaxstep.trainer.saved_run import teacher
from jaxstep.trainer.saved_run.load import save_base_config, save_tokenizer
from jaxstep.trainer.store import resume as resume_lib
from jaxstep.trainer.store import run_dir as run_dir_lib
from jaxstep.trainer.store.checkpoint import Checkpointer
from jaxstep.trainer.store.run_state import RunState
from jaxstep.trainer.tracking.mfu import peak_flops_per_device

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class TrainResult:
  state: TrainState
  run_state: RunState
  last_metrics: dict  # the last line of metrics.jsonl (means over its log_every updates)
  last_eval: dict | None  # the first eval set's (the held-out split's) last record
  stop_reason: str
  evals: dict = dataclasses.field(default_factory=dict)  # set name -> its last record


def _checked(run: Run, rs: RunState, batch: dict, whole: bool) -> dict[str, np.ndarray]:
  """Adds the fault-injection column if asked for, and checks on the host that a global
  batch this process holds whole has N > 0 tokens (else the guard reads N from metrics)."""
  t = run.cfg.train
  units = batch["pair_mask"] if run.cfg.preference.loss else batch["loss_mask"]
  if t.debug_nan_step:
    nan = rs.step + 1 == t.debug_nan_step
    batch["poison"] = np.full(len(units), np.nan if nan else 0.0, np.float32)
  if whole and not units.any():
    raise EmptyBatchError(
      f"the global batch of epoch {rs.epoch}, step_in_epoch {rs.step_in_epoch} (update "
      f"step {rs.step + 1}) has no loss-masked tokens; raise train.global_batch_size or "
      f"check the data's masks (chat data needs assistant turns)"
    )
  return batch


def next_batch(run: Run, rs: RunState) -> dict[str, np.ndarray]:
  """The global batch at position ``rs`` (every row), checked as the loop checks it."""
  t = run.cfg.train
  batch = data.global_batch(
    run.dataset.train, t.seed, rs.epoch, rs.step_in_epoch, t.global_batch_size, run.dataset.pad_id
  )
  return _checked(run, rs, batch, whole=True)


def evaluate(run: Run, params, split=None, model_state=None) -> dict:
  """Token-weighted eval loss over ``split`` (default: the held-out split): ``Σ NLL /
  Σ tokens``, its exp, and bits per byte ``Σ NLL / (ln 2 · Σ UTF-8 bytes of the
  targets)``; float64 sums on the host, ``EVAL_IN_FLIGHT`` batches ahead at most."""
  t, ds = run.cfg.train, run.dataset
  split = ds.eval if split is None else split
  batches = data.eval_batches(split, t.global_batch_size, ds.pad_id, t.eval_batches)
  extra = (model_state,) if run.cfg.preference.loss else ()  # a live reference rides there
  outputs = (
    run.eval_fn(params, parallel.put_batch(b, run.batch_sharding), *extra) for b in batches
  )
  sums = summed(outputs, EVAL_IN_FLIGHT)
  if run.cfg.preference.loss:
    return preference_plan.eval_record(sums or {"loss": 0.0, "pairs": 0})
  return eval_record(*(np.zeros(3) if sums is None else sums))


def eval_splits(run: Run) -> dict:
  """The sets a run evaluates: its held-out split (if it has one) first, a mixture's
  sources' held-out splits (under their names), then ``eval.sets``."""
  held = {HELDOUT: run.dataset.eval} if run.dataset.eval else {}
  return {**held, **run.dataset.source_evals, **run.eval_sets}


class RunBatches:
  """The CLI run's ``BatchSource``: global batch ``step_in_epoch`` of ``epoch`` (read ahead
  by ``data.BatchLoader``); the position is the ``RunState``."""

  def __init__(self, run: Run, rs: RunState):
    t = run.cfg.train
    self.run, self.rs = run, rs
    self.rows = parallel.local_rows(run.batch_sharding, t.global_batch_size)  # None: all rows
    self.batches = data.BatchLoader(
      run.dataset.train,
      seed=t.seed,
      global_batch_size=t.global_batch_size,
      pad_id=run.dataset.pad_id,
      rows=self.rows,
    ).start(rs.epoch, rs.step_in_epoch)

  def next_batch(self) -> dict:
    batch = _checked(self.run, self.rs, next(self.batches), whole=self.rows is None)
    self.rs = self.rs.advanced(steps_per_epoch=self.run.steps_per_epoch)
    return batch

  def where(self) -> dict:
    return {"epoch": self.rs.epoch, "step_in_epoch": self.rs.step_in_epoch}

  def mark(self) -> RunState:
    return self.rs  # immutable: a cheap token, turned into JSON only for a checkpoint

  def position(self, mark: RunState) -> dict:
    return mark.to_json()  # (epoch, step_in_epoch) is where the loader starts again

  def close(self) -> None:
    self.batches.close()  # the read-ahead thread


def train(
  cfg: config_lib.Config,
  callbacks: Sequence[Callback] = (),
  *,
  resume: bool = True,
  resume_from: str | None = None,
  hooks: Sequence[Hook] = (),
) -> TrainResult:
  """Trains ``cfg`` to the end (max_steps / epochs / a callback's or hook's stop) and
  returns the state.

  Re-running with the same ``run_dir`` resumes from its newest valid checkpoint, or, if
  that checkpoint is the last step, says so and touches nothing (``resume=False`` sets
  earlier outputs aside; ``resume_from`` starts from another run's checkpoint). One run at
  a time holds ``run_dir``, and nothing is written there before every check has passed.
  SIGTERM/SIGINT save a checkpoint at the update boundary, then raise ``Interrupted``.
  ``hooks`` (``jaxstep.trainer.loop.hooks``) run after the built-in ones.
  """
  run, state, rs = build(cfg, teacher.load)
  cfg = run.cfg  # resolved: the model's vocabulary follows the tokenizer
  if cfg.rl.rewards:  # a reward that does not import: before anything is written
    load_rewards(cfg.rl.rewards, cfg.rl.reward_weights)
  reference = _stored_reference(run, state.params)  # refuses another run's file: nothing written
  with run_dir_lib.locked(cfg.run_dir) as run_dir:
    begun = resume_lib.start(
      run_dir,
      state,
      checkpoint=cfg.checkpoint,
      fits=lambda restored: _position(run, rs, restored, from_other_run=bool(resume_from)),
      way_out=", or --no-resume to start over",
      stored=steps.stored(cfg),  # a LoRA run's checkpoints hold its adapters, not its base
      resume=resume,
      resume_from=resume_from,
      current=rs,
    )
    state, rs = begun.state, begun.fitted or rs
    if rs.step >= run.total_steps:
      begun.ckpt.close()
      out = assembly.already_finished(
        state, rs.step, rs.to_json(), run_dir, HELDOUT, {"trackers": rs.trackers}
      )
      return _result(out, rs)
    _first_writes(run, run_dir, begun.ckpt, state)
    if reference is not None:  # dropped once read: the starting weights are not kept
      run, reference = _with_reference(run, *reference), None
    return run_loop(
      run, state, rs, ckpt=begun.ckpt, run_dir=run_dir, callbacks=callbacks, hooks=hooks
    )


def _stored_reference(run: Run, start_params):
  """With ``preference.reference: precompute``: ``(file, key, reference weights, log-probs
  stored for them or None)``, the weights being the run's starting ones (what ``build``
  made, so a resume computes the same key); None for other runs.

  Raises:
    ConfigError: the file holds log-probs of other weights or other data.
  """
  if run.reference_fn is None:
    return None
  weights = reference_logps.reference_params(run.cfg, start_params)
  pairs = run.dataset.pairs
  digest = reference_logps.weights_digest(weights)
  key = reference_logps.key_of(digest, run.dataset.fingerprint, len(pairs))
  path = reference_logps.file_for(run.cfg)
  return path, key, weights, reference_logps.read(path, key)


def _with_reference(run: Run, path, key, weights, logps) -> Run:
  """``run`` whose batches carry the reference's log-probs: those read from ``path``, or
  computed now and written there; its ``eval.sets``' computed now (they are not stored)."""
  if logps is None:
    t = run.cfg.train
    pairs = run.dataset.pairs
    args = (run.reference_fn, weights, pairs, t.global_batch_size, run.batch_sharding)
    logps = reference_logps.compute(path, key, *args)
  sets = {
    name: preference_plan.split_with_reference(split, run, weights)
    for name, split in run.eval_sets.items()
  }
  return dataclasses.replace(run, dataset=run.dataset.with_reference(logps), eval_sets=sets)


def _position(run: Run, rs: RunState, restored, *, from_other_run: bool) -> RunState:
  """The run position a restored checkpoint continues from, once it is checked to fit this
  run (``resume.reconcile``); another run's checkpoint keeps its tracker runs its own."""
  c = run.cfg.checkpoint
  rs = resume_lib.reconcile(
    restored.metadata,
    rs,
    state_step=int(restored.state.step),
    steps_per_epoch=run.steps_per_epoch,
    allow_data_change=c.allow_data_change,
    allow_schedule_change=c.allow_schedule_change,
    stable_end=functools.partial(optim.wsd_stable_end, run.cfg.optim),
  )
  log.info("data position: epoch %d, step_in_epoch %d", rs.epoch, rs.step_in_epoch)
  return dataclasses.replace(rs, trackers={}) if from_other_run else rs


def _first_writes(run: Run, run_dir: pathlib.Path, ckpt: Checkpointer, state) -> None:
  """Before the first update: room for a checkpoint, then the config, the tokenizer copy
  and the base model's config (``run_dir.first_writes`` says what a failure does)."""

  def write():
    run_dir_lib.write_config(run_dir, config_lib.dump(run.cfg))
    if jax.process_index() == 0:
      save_tokenizer(run_dir, run.dataset)  # generate and evaluate read the run's own copy
      save_base_config(run_dir, run.cfg.model)  # what export writes back out

  run_dir_lib.first_writes(run_dir, ckpt, state, write)


def _result(out: LoopResult, rs: RunState) -> TrainResult:
  """The CLI run's result: the loop's, with the run position it reached."""
  first = out.evals.get(HELDOUT) or next(iter(out.evals.values()), None)
  rs = dataclasses.replace(rs, trackers=out.run_info.get("trackers", {}))
  return TrainResult(out.state, rs, out.last_record, first, out.stop_reason, out.evals)


def run_loop(
  run: Run,
  state: TrainState,
  rs: RunState,
  *,
  ckpt: Checkpointer,
  run_dir: pathlib.Path,
  callbacks: Sequence[Callback] = (),
  hooks: Sequence[Hook] = (),
) -> TrainResult:
  """The update-step loop from position ``rs`` to ``run.total_steps`` (or a stop)."""
  t = run.cfg.train
  mixed = getattr(run.dataset.train, "sources", None)
  log.info(
    "%d training samples (%s), %d parameters; update steps %d → %d of %d samples in %d micro-steps",
    len(run.dataset.train),
    f"a mixture of {', '.join(f'{s.name} {s.weight:g}' for s in mixed)}"
    if mixed
    else f"{run.steps_per_epoch} update steps per epoch",
    models.num_params(state.params),
    rs.step,
    run.total_steps,
    t.global_batch_size,
    t.grad_accum_steps,
  )
  rl = bool(run.cfg.rl.rewards)
  source = (
    RolloutSource(run, rs, run_dir=run_dir, writer=jax.process_index() == 0)
    if rl
    else RunBatches(run, rs)
  )
  loop = assembly.assemble(
    state=state,
    step_fn=run.step_fn,
    put_batch=lambda b: parallel.put_batch(
      _device_part(b), run.batch_sharding, t.global_batch_size
    ),
    source=source,
    start_step=rs.step,
    total_steps=run.total_steps,
    run_dir=run_dir,
    ckpt=ckpt,
    train=t,
    checkpoint_every=run.cfg.checkpoint.every,
    evaluation=_evaluation(run),
    tracking=assembly.Tracking(
      config=config_lib.to_dict(run.cfg),
      mlflow=run.cfg.mlflow,
      wandb=run.cfg.wandb,
      ids=dict(rs.trackers),
      resumed=rs.step > 0,
    ),
    throughput=assembly.Throughput(
      tokens_per_step=None
      if rl  # a rollout's tokens vary: N (the step's unit) per second
      else _pair_positions(t.global_batch_size)
      if run.cfg.preference.loss  # pairs cut to their length: both sides' positions
      else t.global_batch_size * t.seq_len,
      flops_per_token=run.flops_per_token,
      peak_flops=peak_flops_per_device(t.peak_tflops),
      host_fields=(lambda b: b[ROLLOUT_METRICS])  # noqa: E731 - the rollout's, from the host
      if rl
      else getattr(run.dataset.train, "source_tokens", None),  # a mixture's, per source
    ),
    callbacks=callbacks,
    hooks=(LogpCheck(run.cfg.rl.logp_tolerance, lambda: gap_cause(run.cfg)), *hooks)
    if rl
    else hooks,
    run_info={"trackers": rs.trackers},
  )
  if rl:
    source.params = lambda: loop.state.params  # each rollout samples with the params of its time
  out = loop.run()
  return _result(out, source.rs)


def _device_part(batch: dict) -> dict:
  """What the step reads: a mixture's ``source`` column and a rollout's metrics stay on the
  host."""
  return {k: v for k, v in batch.items() if k not in ("source", ROLLOUT_METRICS)}


def _evaluation(run: Run) -> assembly.Evaluation:
  """The CLI run's evaluation: every set of ``eval_splits`` with the jitted eval step (an RL
  run's held-out prompts decoded and scored), text samples of ``train.sample_prompts`` when
  ``train.sample_every`` is set, and ``eval.harness_tasks``."""
  t = run.cfg.train
  splits = eval_splits(run)
  harness = (harness_evaluation(run.cfg, run.dataset.tokenizer), run.cfg.eval.harness_every)
  if run.cfg.rl.rewards:
    scorer = rl_evaluate.scorer(run)

    def evaluate_all(state) -> dict:
      return {name: scorer(state.params, split) for name, split in splits.items()}

    samples = None
  else:

    def evaluate_all(state) -> dict:
      return {
        name: evaluate(run, state.params, split, state.model_state)
        for name, split in splits.items()
      }

    samples = TextSamples(run.cfg.model, run.dataset.tokenizer, t) if t.sample_every else None
  first = next(iter(splits), None)
  return assembly.Evaluation(evaluate_all if splits else None, first, samples, *harness)


def _pair_positions(global_batch_size: int):
  """``batch -> positions`` of a preference update: G pairs × 2 sides × the batch's length
  (``preference.length_buckets`` cuts it to its pairs), read from this process's rows."""
  return lambda batch: global_batch_size * 2 * batch["chosen_inputs"].shape[1]
