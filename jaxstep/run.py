"""The run driver: build everything from a ``Config``, then the update-step loop.

Per update step: next global batch → host check (N > 0) → device put → jitted step (state
donated) → metrics of the *previous* step read back (so the host never stalls the device)
→ log / eval / callbacks by update-step cadence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import pathlib
import signal
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxstep
from jaxstep import config as config_lib
from jaxstep import data, models, sharding
from jaxstep import resume as resume_lib
from jaxstep.callbacks import Callback, EarlyStopping, TrainerControl
from jaxstep.checkpoint import Checkpointer
from jaxstep.errors import EmptyBatchError, Interrupted, NonFiniteError
from jaxstep.loss_scale import DynamicLossScale
from jaxstep.losses import masked_nll, next_token_loss
from jaxstep.metrics import MetricsSink, NullSink
from jaxstep.optim import make_optimizer
from jaxstep.perf import mfu, peak_flops_per_device
from jaxstep.signals import stop_on_signals
from jaxstep.state import RunState, TrainState
from jaxstep.step import make_train_step

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class Run:
  """What a run builds once: data, compiled functions, and the schedule's length."""

  cfg: config_lib.Config
  dataset: data.Dataset
  step_fn: Callable  # jitted (state, batch) -> (state, metrics), state donated
  eval_fn: Callable  # jitted (params, batch) -> (nll_sum, tokens)
  mesh: Mesh
  batch_sharding: NamedSharding  # samples over every device
  total_steps: int  # update steps this run will take in all (max_steps / epochs)
  steps_per_epoch: int
  flops_per_token: float


@dataclasses.dataclass(frozen=True)
class TrainResult:
  state: TrainState
  run_state: RunState
  last_metrics: dict
  last_eval: dict | None
  stop_reason: str


def total_update_steps(train_cfg, steps_per_epoch: int) -> int:
  """``min(max_steps, epochs × steps_per_epoch)``, where 0 means "no limit"."""
  limits = [train_cfg.max_steps] if train_cfg.max_steps else []
  limits += [train_cfg.epochs * steps_per_epoch] if train_cfg.epochs else []
  return min(limits)


def config_digest(cfg: config_lib.Config) -> str:
  return hashlib.sha256(config_lib.dump(cfg).encode()).hexdigest()[:16]


def loss_scaler(t: config_lib.TrainConfig) -> DynamicLossScale | None:
  """Dynamic loss scaling for fp16 from ``train.loss_scale_*``; None otherwise."""
  if t.precision != "fp16":
    return None
  return DynamicLossScale(
    t.loss_scale_init, t.loss_scale_growth_interval, t.loss_scale_min, t.loss_scale_max
  )


def build(cfg: config_lib.Config) -> tuple[Run, TrainState, RunState]:
  """Loads data (all data errors surface here), lays out the mesh, builds the jitted steps.

  With more than one device, the state is sharded by ``jaxstep.sharding`` rules and the step
  accumulates device-locally under ``shard_map`` (one gradient reduction per update).
  """
  t = cfg.train
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
  sharding.check_batch_divisible(t.global_batch_size, t.grad_accum_steps, mesh)
  dataset = data.load_dataset(cfg.data, t.seq_len, cfg.model.vocab_size)
  spe = data.steps_per_epoch(len(dataset.train), t.global_batch_size)
  total = total_update_steps(t, spe)
  apply_fn, params = models.build(cfg.model, jax.random.PRNGKey(t.seed))
  optimizer = make_optimizer(cfg.optim, total)
  scaler = loss_scaler(t)
  loss_fn = next_token_loss(apply_fn)
  step = make_train_step(
    poisonable(loss_fn) if t.debug_nan_step else loss_fn,
    optimizer,
    grad_accum_steps=t.grad_accum_steps,
    precision=t.precision,
    nonfinite=t.nonfinite,
    mesh=mesh if mesh.devices.size > 1 else None,
    loss_scale=scaler,
    spike_factor=t.spike_factor,
    scan_unroll=t.scan_unroll,
  )

  def eval_step(params, batch):
    logits = apply_fn(params, batch["inputs"], train=False)
    nll_sum, _ = masked_nll(logits, batch["targets"], batch["loss_mask"])
    return nll_sum, jnp.sum(batch["loss_mask"])

  state = TrainState.create(
    params=params,
    optimizer=optimizer,
    rng=jax.random.fold_in(jax.random.PRNGKey(t.seed), 1),
    loss_scale=scaler.init() if scaler else 1.0,
    loss_window=t.spike_window,
  )
  state_sh = sharding.tree_shardings(state, mesh)
  state = jax.device_put(state, state_sh)
  batch_sh, replicated = sharding.batch_sharding(mesh), NamedSharding(mesh, PartitionSpec())
  run = Run(
    cfg=cfg,
    dataset=dataset,
    step_fn=jax.jit(
      step,
      in_shardings=(state_sh, batch_sh),
      out_shardings=(state_sh, replicated),
      donate_argnums=0,
    ),
    eval_fn=jax.jit(eval_step, in_shardings=(state_sh.params, batch_sh), out_shardings=replicated),
    mesh=mesh,
    batch_sharding=batch_sh,
    total_steps=total,
    steps_per_epoch=spe,
    flops_per_token=cfg.model.flops_per_token(t.seq_len),
  )
  run_state = RunState(
    dataset_fingerprint=dataset.fingerprint,
    global_batch_size=t.global_batch_size,
    grad_accum_steps=t.grad_accum_steps,
    config_digest=config_digest(cfg),
    jaxstep_version=jaxstep.__version__,
  )
  return run, state, run_state


def poisonable(loss_fn):
  """Fault injection for ``train.debug_nan_step``: adds ``Σ batch["poison"]`` to the loss."""

  def poisoned(params, batch, rng):
    batch = dict(batch)
    poison = batch.pop("poison")
    loss_sum, aux = loss_fn(params, batch, rng)
    return loss_sum + jnp.sum(poison), aux

  return poisoned


def next_batch(run: Run, rs: RunState) -> dict[str, np.ndarray]:
  """The global batch at position ``rs``, checked on the host to hold N > 0 tokens."""
  t = run.cfg.train
  batch = data.global_batch(
    run.dataset.train, t.seed, rs.epoch, rs.step_in_epoch, t.global_batch_size, run.dataset.pad_id
  )
  if t.debug_nan_step:
    nan = rs.step + 1 == t.debug_nan_step
    batch["poison"] = np.full(t.global_batch_size, np.nan if nan else 0.0, np.float32)
  if not batch["loss_mask"].any():
    raise EmptyBatchError(
      f"the global batch of epoch {rs.epoch}, step_in_epoch {rs.step_in_epoch} (update "
      f"step {rs.step + 1}) has no loss-masked tokens; raise train.global_batch_size or "
      f"check the data's masks (chat data needs assistant turns)"
    )
  return batch


def evaluate(run: Run, params) -> dict:
  """Token-weighted eval loss over the eval split: ``Σ NLL / Σ tokens`` and its exp."""
  t, ds = run.cfg.train, run.dataset
  sums = [
    run.eval_fn(params, sharding.put_batch(b, run.batch_sharding))
    for b in data.eval_batches(ds.eval, t.global_batch_size, ds.pad_id, t.eval_batches)
  ]
  nll, tokens = (float(sum(jax.device_get(x))) for x in zip(*sums, strict=True))
  loss = nll / max(tokens, 1.0)
  return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(tokens)}


class LateMetrics:
  """Reads step s's device metrics only after step s+1 was dispatched, then reports them."""

  def __init__(
    self, run: Run, sink: MetricsSink, callbacks: Sequence[Callback], control: TrainerControl
  ):
    self.run, self.sink, self.callbacks, self.control = run, sink, callbacks, control
    self.pending = None
    self.last_record: dict = {}
    self.clock = time.perf_counter()
    self.peak = peak_flops_per_device(run.cfg.train.peak_tflops)
    self.tokens_per_step = run.cfg.train.global_batch_size * run.cfg.train.seq_len

  def submit(self, step: int, metrics: dict, batch: dict, position: dict) -> None:
    """Queues step ``step``; reports the previous one. ``batch`` (host arrays) and its
    ``position`` are kept one step so a non-finite update can be saved for debugging."""
    previous, self.pending = self.pending, (step, metrics, batch, position)
    if previous:
      self._report(*previous)

  def flush(self) -> None:
    if self.pending:
      self._report(*self.pending)
      self.pending = None

  def restart_clock(self) -> None:
    self.clock = time.perf_counter()

  def _report(self, step: int, metrics: dict, batch: dict, position: dict) -> None:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for step
    skipped_total = values.pop("skipped_total", 0.0)
    now = time.perf_counter()
    step_time, self.clock = now - self.clock, now
    tokens_per_sec = self.tokens_per_step / step_time
    record = {
      "step": step,
      "epoch": position["epoch"],
      **values,
      "updated": bool(values["updated"]),
      "skipped": not values["updated"],
      "spike": bool(values.get("spike", 0.0)),
      # every skip of the run: the driver never dispatches N = 0, so non-finite or spike
      "nonfinite_total": int(skipped_total),
      "tokens": int(values["tokens"]),
      "tokens_per_sec": tokens_per_sec,
      "mfu": mfu(self.run.flops_per_token, tokens_per_sec, self.peak, jax.device_count()),
      "step_time": step_time,
    }
    self.last_record = record
    self.sink.advance(record)
    t = self.run.cfg.train
    if step % t.log_every == 0 or step == self.run.total_steps:
      self.sink.train(record)
    if record["skipped"]:
      path = self.sink.bad_batch(step, batch, {**position, "loss": record["loss"]})
      log.warning(
        "update step %d was non-finite (loss %s): skipped; batch saved to %s",
        step,
        record["loss"],
        path,
      )
      if t.nonfinite == "halt":
        raise NonFiniteError(
          f"update step {step} was non-finite (loss {record['loss']}); train.nonfinite=halt "
          f"stops here with the last good parameters checkpointed and the batch in {path}"
        )
    for cb in self.callbacks:
      cb.on_step_end(step, record, self.control)


def prepare_run_dir(cfg: config_lib.Config) -> pathlib.Path:
  run_dir = pathlib.Path(cfg.run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  if jax.process_index() == 0:
    (run_dir / "config.yaml").write_text(config_lib.dump(cfg))
  return run_dir


def train(
  cfg: config_lib.Config,
  callbacks: Sequence[Callback] = (),
  *,
  resume: bool = True,
  resume_from: str | None = None,
) -> TrainResult:
  """Trains ``cfg`` to the end (max_steps / epochs / a callback's stop) and returns the state.

  Re-running with the same ``run_dir`` resumes from its newest valid checkpoint
  (``resume=False`` sets earlier outputs aside; ``resume_from`` starts from another run's
  checkpoint). SIGTERM/SIGINT save a checkpoint at the update boundary, then raise
  ``Interrupted``.
  """
  run, state, rs = build(cfg)
  run_dir = prepare_run_dir(cfg)
  ckpt, state, rs = resume_lib.start(
    cfg,
    run_dir,
    state,
    rs,
    resume=resume,
    resume_from=resume_from,
    steps_per_epoch=run.steps_per_epoch,
  )
  return loop(run, state, rs, ckpt=ckpt, run_dir=run_dir, callbacks=callbacks)


def loop(
  run: Run,
  state: TrainState,
  rs: RunState,
  *,
  ckpt: Checkpointer,
  run_dir: pathlib.Path,
  callbacks: Sequence[Callback] = (),
) -> TrainResult:
  """The update-step loop from position ``rs`` to ``run.total_steps`` (or a stop)."""
  t = run.cfg.train
  log.info(
    "%d training samples (%d update steps per epoch), %d parameters; update steps "
    "%d → %d of %d samples in %d micro-steps",
    len(run.dataset.train),
    run.steps_per_epoch,
    models.num_params(state.params),
    rs.step,
    run.total_steps,
    t.global_batch_size,
    t.grad_accum_steps,
  )
  sink = (
    MetricsSink(run_dir, start_step=rs.step, total_steps=run.total_steps, progress=t.progress)
    if jax.process_index() == 0
    else NullSink()
  )
  if t.early_stopping_patience:
    callbacks = [*callbacks, EarlyStopping(t.early_stopping_patience)]
  control = TrainerControl()
  late = LateMetrics(run, sink, callbacks, control)
  last_eval = None
  try:
    with stop_on_signals() as stop:
      while rs.step < run.total_steps and not control.should_stop and not stop.signum:
        batch = next_batch(run, rs)
        state, metrics = run.step_fn(state, sharding.put_batch(batch, run.batch_sharding))
        position = {"epoch": rs.epoch, "step_in_epoch": rs.step_in_epoch}
        rs = rs.advanced(steps_per_epoch=run.steps_per_epoch, num_samples=len(run.dataset.train))
        late.submit(rs.step, metrics, batch, position)
        if t.nonfinite == "halt":  # read back now: stop before another update is dispatched
          late.flush()
        ckpt.save(state, rs)
        if run.dataset.eval and t.eval_every and rs.step % t.eval_every == 0:
          late.flush()
          last_eval = _evaluate_and_report(run, state, rs.step, sink, callbacks, control)
          late.restart_clock()
      late.flush()
      if (
        stop.signum is None
        and run.dataset.eval
        and (last_eval is None or last_eval["step"] != rs.step)
      ):
        last_eval = _evaluate_and_report(run, state, rs.step, sink, callbacks, control)
  except BaseException:  # a halt or an error: keep the state it got to, then re-raise
    sink.close()
    _final_save(ckpt, state, rs, quiet=True)
    raise
  sink.close()
  _final_save(ckpt, state, rs)  # always: at the end and on a signal
  if stop.signum is not None:
    name = signal.Signals(stop.signum).name
    raise Interrupted(
      f"stopped by {name} at update step {rs.step}; checkpoint saved in "
      f"{run_dir / 'checkpoints'}; re-run the same command to resume",
      stop.signum,
    )
  reason = control.reason or f"reached {rs.step} update steps"
  log.info("done: %s; run_dir %s", reason, run_dir)
  return TrainResult(state, rs, late.last_record, last_eval, reason)


def _final_save(ckpt, state, rs: RunState, quiet: bool = False) -> None:
  try:
    ckpt.save(state, rs, force=True)
    ckpt.wait()
  except Exception as e:
    if not quiet:
      raise
    log.error("final checkpoint at update step %d failed: %s", rs.step, e)  # keep the cause
  finally:
    ckpt.close()


def _evaluate_and_report(run, state, step, sink, callbacks, control) -> dict:
  record = {"step": step, **evaluate(run, state.params)}
  sink.eval(record)
  for cb in callbacks:
    cb.on_evaluate(step, record, control)
  return record
