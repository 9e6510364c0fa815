"""The exact gradient-accumulation train step.

One update step consumes one *global batch* of G samples. It is split into K micro-batches
of G/K samples, walked by ``lax.scan``; every micro-gradient is of ``loss_sum_k / N`` where
N is the number of normalization units (e.g. loss-masked target tokens) in the WHOLE global
batch. Summing those K gradients gives exactly ``grad(Σ_k loss_sum_k / N)`` -- the gradient
of the token-weighted mean over the global batch -- however unevenly the units fall across
micro-batches (a mean of per-micro-batch means would not).

This module is pure JAX: no I/O, no logging, no config objects.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxstep.core import freeze, geometry
from jaxstep.core.accumulate import LossFn, accumulate, sharded_accumulate, split_micro_batches
from jaxstep.core.layout import batch_shards, tree_shardings, tree_specs
from jaxstep.core.loss_scale import DynamicLossScale
from jaxstep.core.precision import compute_dtype as precision_dtype
from jaxstep.core.state import TrainState, empty_to_none
from jaxstep.core.trees import path_name
from jaxstep.errors import BatchError, ConfigError

UnitsFn = Callable[[Mapping[str, jax.Array]], jax.Array]


def default_units_fn(batch: Mapping[str, jax.Array]) -> jax.Array:
  """Counts loss-masked target tokens: ``batch["loss_mask"].sum()`` as int32.

  Targets are already shifted (``targets[t] = tokens[t + 1]``), so every counted position
  is a real prediction; nothing at input position 0 is special.
  """
  if "loss_mask" not in batch:
    raise BatchError(
      f"the default units_fn counts batch['loss_mask'], but the batch has keys "
      f"{sorted(batch)}; add a 'loss_mask' or pass units_fn= to make_train_step"
    )
  return jnp.sum(batch["loss_mask"], dtype=jnp.int32)


def global_batch_size(batch: Mapping[str, Any], grad_accum_steps: int, devices: int = 1) -> int:
  """Returns G, checking every leaf shares a leading dim G > 0 that divides into K
  micro-batches, each split evenly over ``devices``.

  Runs on static shapes, so it fails at trace time with a readable message instead of a
  reshape error from inside XLA.
  """
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise BatchError("the batch is empty: it has no arrays")
  dims = {path_name(path): (leaf.shape[0] if leaf.ndim else None) for path, leaf in leaves}
  if len(set(dims.values())) != 1 or None in dims.values():
    raise BatchError(f"every batch leaf needs the same leading (sample) dimension G; got {dims}")
  (g,) = set(dims.values())
  if g <= 0:
    raise BatchError(f"the global batch holds {g} samples; it needs at least one")
  problem = geometry.split_problem(g, grad_accum_steps, devices)
  if problem:
    raise BatchError(problem)
  return g


def injected_lr(opt_state) -> jax.Array | None:
  """The ``learning_rate`` an ``optax.inject_hyperparams`` optimizer keeps in its state, or
  None when the optimizer holds its lr as a Python constant (plain ``optax.sgd(0.1)``).

  Whether it is there is a property of the state's structure, not of its values, so this
  answers on the host and at trace time alike."""
  return optax.tree_utils.tree_get(
    opt_state,
    "learning_rate",
    default=None,
    filtering=lambda _, value: isinstance(value, jax.Array),
  )


def current_lr(opt_state) -> jax.Array:
  """The learning rate of the last update, if the optimizer injects it (else NaN)."""
  lr = injected_lr(opt_state)
  return jnp.asarray(jnp.nan if lr is None else lr, jnp.float32)


NO_INJECTED_LR = (
  "an lr= override needs the optimizer to keep its learning rate in its state: build it "
  "with optax.inject_hyperparams (e.g. optax.inject_hyperparams(optax.sgd)(learning_rate="
  "0.1)) or jaxstep.make_optimizer; this optimizer's lr is a constant inside it"
)


def apply_update(
  optimizer: optax.GradientTransformation,
  state: TrainState,
  grads,
  ok: jax.Array,
  lr=None,
  trainable: freeze.Trainable | None = None,
) -> TrainState:
  """Applies the optax chain once to the accumulated gradient, or skips.

  When ``ok`` is False, params and opt_state are returned unchanged (selected on device,
  no host round-trip) and ``skipped`` increments. ``step`` always advances: it counts
  update steps of the run, applied or not.

  ``lr`` overrides the optimizer's own learning rate for this update by rescaling its
  updates by ``lr / lr_sched``, where ``lr_sched`` is the injected lr this update used
  (exact for optax's SGD/Adam/AdamW, whose update is linear in the lr). So the optimizer
  must inject its lr (``optax.inject_hyperparams``; ``make_optimizer`` does), else
  ``ConfigError`` at trace time. An update whose ``lr_sched`` is 0 (the first step of a
  warmup from 0) is all zeros and no rescaling reaches another lr: it is skipped (counted
  in ``skipped``), never applied as NaN.

  ``trainable``: the optimizer sees (and ``grads`` hold) the trainable leaves only; the
  frozen ones are put back unchanged.
  """
  params, frozen = freeze.partition(state.params, trainable)
  updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
  if lr is not None:
    scheduled = injected_lr(new_opt_state)
    if scheduled is None:
      raise ConfigError(NO_INJECTED_LR)
    scheduled = jnp.asarray(scheduled, jnp.float32)
    rescalable = jnp.isfinite(scheduled) & (scheduled != 0)
    ratio = jnp.where(rescalable, lr / jnp.where(rescalable, scheduled, 1.0), 0.0)
    updates = optax.tree.scale(ratio, updates)
    ok = ok & rescalable
  new_params = optax.apply_updates(params, updates)
  return state.replace(
    step=state.step + 1,
    params=freeze.combine(optax.tree.where(ok, new_params, params), frozen),
    opt_state=optax.tree.where(ok, new_opt_state, state.opt_state),
    skipped=state.skipped + jnp.logical_not(ok).astype(jnp.int32),
  )


def _loss_spike(recent_losses: jax.Array, loss: jax.Array, factor: float) -> jax.Array:
  """``loss > factor × median(recent)`` once the window is at least half full (else False)."""
  if factor <= 0:
    return jnp.zeros((), bool)
  filled = jnp.isfinite(recent_losses)
  median = jnp.nanmedian(jnp.where(filled, recent_losses, jnp.nan))
  return (jnp.sum(filled) * 2 >= recent_losses.shape[0]) & (loss > factor * median)


def binds(fn, n: int) -> bool | None:
  """Can ``fn`` take ``n`` positional arguments? None if its signature is unknown."""
  try:
    inspect.signature(fn).bind(*range(n))
  except TypeError:
    return False
  except ValueError:  # a builtin or C callable without a signature
    return None
  return True


def check_loss_arity(loss_fn, model_state) -> None:
  """Fails at ``init``, on the host, when the loss's signature cannot take the form the
  step will call: 3 arguments without model state, 4 with it (a TypeError deep inside the
  traced step otherwise)."""
  takes3, takes4 = binds(loss_fn, 3), binds(loss_fn, 4)
  if model_state is None and takes3 is False and takes4:
    raise ConfigError(
      "the state holds no model state (model_state is None or empty: the model keeps "
      "none), so the step calls loss_fn(params, micro_batch, rng) -> (loss_sum, aux); "
      "drop the loss's model_state argument and return value"
    )
  if model_state is not None and takes4 is False and takes3:
    raise ConfigError(
      "the state holds a model state, so the step calls loss_fn(params, micro_batch, rng, "
      "model_state) -> (loss_sum, aux, model_state); give the loss that argument, or build "
      "the state without model_state="
    )


def make_train_step(
  loss_fn: LossFn,
  optimizer: optax.GradientTransformation,
  *,
  grad_accum_steps: int,
  units_fn: UnitsFn | None = None,
  precision: str | None = None,
  mesh: Mesh | None = None,
  scan_unroll: int = 1,
  loss_scale: DynamicLossScale | None = None,
  spike_factor: float = 0.0,
  spike_window: int = 32,
  trainable: freeze.Trainable | None = None,
) -> Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict]]:
  """Builds ``train_step(state, batch) -> (state, metrics)`` for one global batch, and
  ``train_step.init(params, rng)``, the state that step needs.

  Args:
    loss_fn: ``(params, micro_batch, rng) -> (loss_sum, aux)`` returning the
      *un-normalized* loss summed over the micro-batch and a dict of scalar metrics
      (summed over micro-steps). ``aux["extra_loss"]``, if present, is a mean-type term
      added to the objective as ``extra_loss / K``. A model with non-parameter state takes
      it and returns the new one: ``(params, micro_batch, rng, model_state) -> (loss_sum,
      aux, model_state)`` (used when the state was built with ``init(…, model_state=…)``).
    optimizer: an optax transformation (e.g. from ``jaxstep.make_optimizer``); it
      sees the accumulated gradient exactly once per update step.
    grad_accum_steps: K, the number of micro-batches per global batch (any integer type).
    units_fn: ``(global_batch) -> N``; defaults to counting ``batch["loss_mask"]``.
    precision: ``None``/``"fp32"``, ``"bf16"`` or ``"fp16"`` (low-precision compute, fp32
      params and accumulator; see ``jaxstep.core.precision``). A non-finite update is
      always skipped: a jitted program cannot raise, so halting is the caller's choice.
    mesh: a ``("data", "fsdp")`` mesh (``jaxstep.parallel.make_mesh``): ``init`` lays the
      state out on it, and the step accumulates device-locally under ``shard_map`` and
      reduces once per update (see ``sharded_accumulate``). The batch must be sharded over
      both axes (``jaxstep.parallel.put_batch``); G must divide by devices × K.
    scan_unroll: unroll factor of the micro-step scan (speed only).
    loss_scale: dynamic loss scaling (default on for ``precision="fp16"``, off otherwise);
      ``init`` starts the state at its initial scale. Grads are unscaled after the scan,
      before the norm and clipping.
    spike_factor: if > 0, skip an update whose loss exceeds ``spike_factor`` × the median
      loss of the last ``spike_window`` applied updates (once the window is half full).
    spike_window: applied updates in the spike guard's window.
    trainable: ``(name, leaf) -> bool`` on each params leaf (its path ``"a/b/0/c"``;
      ``jaxstep.core.freeze.by_patterns`` builds one from regexes). Only those leaves
      train: the frozen ones get no optimizer state, no accumulator slot, no share of
      ``grad_norm`` and the clip, and stay bitwise unchanged. None: every leaf trains.

  Returns:
    A pure function; jit it yourself (``donate_argnums=0`` is safe: ``init`` copies
    params). ``metrics`` holds device scalars: ``loss`` (Σ NLL / N), ``tokens`` (N),
    ``grad_norm`` (pre-clip), ``lr``, ``updated``, ``extra_loss`` and the summed aux
    entries. ``train_step.init(params, rng, *, model_state=None) -> TrainState``.

  Example:
    >>> train_step = make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=4)
    >>> state = train_step.init(params, rng=0)
    >>> state, metrics = jax.jit(train_step)(state, batch)  # batch leaves: leading dim G
  """
  grad_accum_steps = geometry.grad_accum_steps(grad_accum_steps)
  compute_dtype = precision_dtype(precision)
  units_fn = units_fn or default_units_fn
  scaler = loss_scale or (DynamicLossScale() if precision == "fp16" else None)
  devices = batch_shards(mesh) if mesh is not None else 1

  def accumulated(state: TrainState, batch, units, step_rng):
    params, frozen = freeze.partition(state.params, trainable)
    options = dict(
      compute_dtype=compute_dtype,
      unroll=scan_unroll,
      loss_scale=state.loss_scale.scale if scaler else 1.0,
      model_state=state.model_state,
      frozen=frozen if trainable is not None else None,
    )
    if mesh is None:
      micro = split_micro_batches(batch, grad_accum_steps)
      return accumulate(loss_fn, params, micro, units, step_rng, **options)
    return sharded_accumulate(
      loss_fn,
      params,
      batch,
      units,
      step_rng,
      grad_accum_steps=grad_accum_steps,
      mesh=mesh,
      param_specs=tree_specs(params, mesh),
      **options,
    )

  def train_step(state: TrainState, batch):
    global_batch_size(batch, grad_accum_steps, devices)  # trace-time checks, before the model
    units = units_fn(batch)  # global N: under jit with sharded inputs this is the global sum
    safe_units = jnp.maximum(units.astype(jnp.float32), 1.0)
    step_rng = jax.random.fold_in(state.rng, state.step)
    grads, loss, extra, aux, model_state = accumulated(state, batch, safe_units, step_rng)
    if scaler:  # unscale before anything looks at the gradient (norm, clipping, Adam)
      grads = optax.tree.scale(1.0 / state.loss_scale.scale, grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(extra) & jnp.isfinite(grad_norm)
    spike = _loss_spike(state.recent_losses, loss, spike_factor)
    ok = (units > 0) & finite & ~spike
    new_state = apply_update(optimizer, state, grads, ok, trainable=trainable)
    window = state.recent_losses.shape[0]
    new_state = new_state.replace(
      recent_losses=jnp.where(
        ok, state.recent_losses.at[state.step % window].set(loss), state.recent_losses
      ),
      model_state=optax.tree.where(ok, model_state, state.model_state),
    )
    if scaler:
      new_state = new_state.replace(loss_scale=scaler.adjust(state.loss_scale, finite))
    metrics = {
      "loss": loss,
      "tokens": units,
      "grad_norm": grad_norm,
      "lr": current_lr(new_state.opt_state),
      "updated": ok,
      "extra_loss": extra,
      "skipped_total": new_state.skipped,
      "spike": spike,
      "loss_scale": new_state.loss_scale.scale,
      **aux,
    }
    return new_state, metrics

  def init(params, rng: jax.Array | int, *, model_state=None) -> TrainState:
    """The state at update step 0 that this step needs: optimizer state, the loss scale's
    initial value (fp16), the spike window, the model state; laid out on ``mesh`` if set.

    ``rng`` is an int seed, a typed key (``jax.random.key``) or a raw ``uint32[2]`` key;
    the state stores it raw. An empty ``model_state`` (``{}``, what the adapters return
    for a model that keeps none) means none: the loss is then called with 3 arguments.
    Params and model state are copied, so donating the state never deletes the caller's
    arrays."""
    model_state = empty_to_none(model_state)
    check_loss_arity(loss_fn, model_state)
    copy = functools.partial(jax.tree.map, lambda x: jnp.array(x, copy=True))
    state = TrainState.create(
      params=copy(params),
      optimizer=optimizer,
      rng=rng,
      loss_scale=scaler.init() if scaler else 1.0,
      loss_window=spike_window,
      model_state=copy(model_state),
      trainable=trainable,
    )
    return state if mesh is None else jax.device_put(state, tree_shardings(state, mesh))

  train_step.init = init
  return train_step


def with_means(step, names, count: str = "tokens"):
  """``step`` (a ``make_train_step`` result) whose metrics ``names`` (sums over the global
  batch, where present) are divided by ``metrics[count]`` (at least 1): the means a record
  shows, e.g. per-pair or per-token ones, each over the whole global batch."""

  def train_step(state, batch):
    state, metrics = step(state, batch)
    n = jnp.maximum(metrics[count].astype(jnp.float32), 1.0)
    return state, {**metrics, **{k: metrics[k] / n for k in names if k in metrics}}

  train_step.init = step.init
  return train_step
