"""The exact gradient-accumulation train step (DESIGN §2).

One update step consumes one *global batch* of G samples. It is split into K micro-batches
of G/K samples, walked by ``lax.scan``; every micro-gradient is of ``loss_sum_k / N`` where
N is the number of normalization units (e.g. loss-masked target tokens) in the WHOLE global
batch. Summing those K gradients gives exactly ``grad(Σ_k loss_sum_k / N)`` -- the gradient
of the token-weighted mean over the global batch -- however unevenly the units fall across
micro-batches (a mean of per-micro-batch means would not).

This module is pure JAX: no I/O, no logging, no config objects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstep.errors import BatchError
from jaxstep.layout import AXES, tree_specs
from jaxstep.loss_scale import DynamicLossScale
from jaxstep.state import TrainState

LossFn = Callable[[Any, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, dict]]
UnitsFn = Callable[[Mapping[str, jax.Array]], jax.Array]

PRECISIONS = {None: None, "fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}
NONFINITE_POLICIES = ("skip", "halt")


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


def global_batch_size(batch: Mapping[str, Any], grad_accum_steps: int) -> int:
  """Returns G, checking every leaf shares a leading dim G > 0 with G % K == 0.

  Runs on static shapes, so it fails at trace time with a readable message instead of a
  reshape error from inside XLA.
  """
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise BatchError("the batch is empty: it has no arrays")
  dims = {
    jax.tree_util.keystr(path): (leaf.shape[0] if leaf.ndim else None) for path, leaf in leaves
  }
  if len(set(dims.values())) != 1 or None in dims.values():
    raise BatchError(f"every batch leaf needs the same leading (sample) dimension G; got {dims}")
  (g,) = set(dims.values())
  if g <= 0:
    raise BatchError(f"the global batch holds {g} samples; it needs at least one")
  if g % grad_accum_steps:
    raise ValueError(
      f"global batch size {g} is not divisible by grad_accum_steps {grad_accum_steps}; "
      f"pick a global_batch_size that is a multiple of {grad_accum_steps}"
    )
  return g


def split_micro_batches(batch: Mapping[str, jax.Array], grad_accum_steps: int):
  """Reshapes every leaf ``[G, ...] -> [K, G/K, ...]``, micro-batch k = rows k, k+K, ….

  Reshaping ``[G/K, K]`` then swapping axes (as MaxText does) keeps each micro-batch spread
  evenly over the data-parallel devices when G is sharded in contiguous blocks, so no
  device idles during a micro-step and no resharding is needed.
  """
  k = grad_accum_steps
  return jax.tree.map(
    lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch
  )


def micro_gradients(
  loss_fn: LossFn,
  params,
  micro_batch,
  units,
  rng,
  *,
  grad_accum_steps: int,
  compute_dtype=None,
  loss_scale=1.0,
):
  """Gradient of one micro-batch's share of the global objective.

  The objective is ``loss_sum_k / N + extra_loss_k / K``: the un-normalized loss sum is
  divided by the global unit count N; a per-micro-batch mean-type ``aux["extra_loss"]`` is
  averaged over the K micro-steps (MaxText's treatment of aux losses).

  Args:
    loss_fn: ``(params, micro_batch, rng) -> (loss_sum, aux)``.
    params: fp32 master parameters.
    micro_batch: one micro-batch, leaves ``[G/K, ...]``.
    units: N for the whole global batch (float32 scalar, already clamped to ≥ 1).
    rng: this micro-step's PRNG key.
    grad_accum_steps: K.
    compute_dtype: if set (bf16/fp16), floating params are cast to it at the model
      boundary; gradients still flow back to (and come out as) fp32.
    loss_scale: the objective is multiplied by it before differentiation (fp16), so the
      returned grads are scaled; the reported loss is not.

  Returns:
    ``(grads, (loss_sum, extra_loss, aux))`` with fp32 grads shaped like params.
  """

  def objective(p):
    if compute_dtype is not None:
      p = jax.tree.map(
        lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p
      )
    loss_sum, aux = loss_fn(p, micro_batch, rng)
    aux = dict(aux)
    extra = jnp.asarray(aux.pop("extra_loss", 0.0), jnp.float32)
    loss_sum = jnp.asarray(loss_sum, jnp.float32)
    objective = loss_sum / units + extra / grad_accum_steps
    return objective * loss_scale, (loss_sum, extra, aux)

  grads, out = jax.grad(objective, has_aux=True)(params)
  return optax.tree.cast(grads, jnp.float32), out


def accumulate(
  loss_fn: LossFn,
  params,
  micro_batches,
  units,
  step_rng,
  *,
  compute_dtype=None,
  extra_terms: int | None = None,
  unroll: int = 1,
  loss_scale=1.0,
):
  """Sums the K micro-gradients with ``lax.scan`` into an fp32 accumulator.

  Args:
    micro_batches: leaves ``[K, G/K, ...]`` (see ``split_micro_batches``).
    units: global N as float32, clamped to ≥ 1 (a zero-unit batch is skipped later).
    step_rng: this update's key; micro-step k uses ``fold_in(step_rng, k)``.
    extra_terms: how many ``extra_loss`` values are averaged: K, or K × devices when each
      device computes its own (default K).
    unroll: ``lax.scan`` unroll factor (a speed knob; the result is the same).
    loss_scale: multiplies every micro-objective (fp16); the caller unscales the sum.

  Returns:
    ``(grads, loss, extra_loss, aux)``: ``grads = Σ_k grad(loss_sum_k / N + extra_k / K)``,
    ``loss = Σ_k loss_sum_k / N``, ``extra_loss = Σ_k extra_k / K`` and aux summed over k.
  """
  k_steps = jax.tree.leaves(micro_batches)[0].shape[0]
  extra_terms = extra_terms or k_steps
  grad_fn = lambda mb, rng: micro_gradients(  # noqa: E731
    loss_fn,
    params,
    mb,
    units,
    rng,
    grad_accum_steps=extra_terms,
    compute_dtype=compute_dtype,
    loss_scale=loss_scale,
  )
  first = jax.tree.map(lambda x: x[0], micro_batches)
  _, (_, _, aux_shape) = jax.eval_shape(grad_fn, first, step_rng)
  zero_aux = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)

  def body(carry, xs):
    grads_acc, loss_acc, extra_acc, aux_acc = carry
    k, mb = xs
    grads, (loss_sum, extra, aux) = grad_fn(mb, jax.random.fold_in(step_rng, k))
    return (
      optax.tree.add(grads_acc, grads),
      loss_acc + loss_sum / units,
      extra_acc + extra / extra_terms,
      jax.tree.map(lambda a, b: a + b.astype(jnp.float32), aux_acc, aux),
    ), None

  init = (
    optax.tree.zeros_like(params, jnp.float32),
    jnp.zeros((), jnp.float32),
    jnp.zeros((), jnp.float32),
    zero_aux,
  )
  (grads, loss, extra, aux), _ = jax.lax.scan(
    body, init, (jnp.arange(k_steps), micro_batches), unroll=unroll
  )
  return grads, loss, extra, aux


def sharded_accumulate(
  loss_fn: LossFn,
  params,
  batch,
  units,
  step_rng,
  *,
  grad_accum_steps: int,
  mesh: Mesh,
  param_specs,
  compute_dtype=None,
  unroll: int = 1,
  loss_scale=1.0,
):
  """``accumulate`` with device-local accumulators and ONE reduction per update step.

  Under ``jax.shard_map`` over ``("data", "fsdp")`` each device: all-gathers its fsdp-sharded
  parameters once, splits ITS rows of the global batch into K micro-batches (the same
  micro-batch membership as the unsharded split when ``K`` divides the per-device rows),
  scans them into a local fp32 accumulator, and only after the scan reduces: ``psum`` over
  ``data`` then ``psum_scatter`` over ``fsdp`` (or ``psum`` over both for replicated
  leaves). Plain ``jit`` instead all-reduces (and re-gathers) inside every micro-step.

  Args:
    batch: the global batch, leaves ``[G, ...]`` sharded ``P(("data", "fsdp"))``.
    units: global N (float32, ≥ 1), computed on the global batch outside.
    param_specs: ``PartitionSpec`` per parameter leaf (see ``jaxstep.sharding``).
  """
  devices = mesh.devices.size

  def local(params, batch, units, step_rng, loss_scale):
    full = jax.tree.map(_gather, params, param_specs)
    grads, loss, extra, aux = accumulate(
      loss_fn,
      full,
      split_micro_batches(batch, grad_accum_steps),
      units,
      step_rng,
      compute_dtype=compute_dtype,
      extra_terms=grad_accum_steps * devices,
      unroll=unroll,
      loss_scale=loss_scale,
    )
    grads = jax.tree.map(_reduce, grads, param_specs)
    return grads, *jax.lax.psum((loss, extra, aux), AXES)

  specs = (param_specs, P(AXES), P(), P(), P())
  # check_vma=False: the scan's zero-initialized carries are device-invariant while the
  # per-device sums vary; every reduction below is an explicit psum, so nothing is implicit.
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=specs,
    out_specs=(param_specs, P(), P(), P()),
    check_vma=False,
  )(params, batch, units, step_rng, jnp.asarray(loss_scale, jnp.float32))


def _fsdp_dim(spec: P) -> int | None:
  return next((d for d, name in enumerate(spec) if name == "fsdp"), None)


def _gather(x, spec: P):
  dim = _fsdp_dim(spec)
  return x if dim is None else jax.lax.all_gather(x, "fsdp", axis=dim, tiled=True)


def _reduce(g, spec: P):
  dim = _fsdp_dim(spec)
  if dim is None:
    return jax.lax.psum(g, AXES)
  return jax.lax.psum_scatter(jax.lax.psum(g, "data"), "fsdp", scatter_dimension=dim, tiled=True)


def current_lr(opt_state) -> jax.Array:
  """The learning rate of the last update, if the optimizer injects it (else NaN)."""
  return jnp.asarray(
    optax.tree_utils.tree_get(
      opt_state,
      "learning_rate",
      default=jnp.nan,
      filtering=lambda _, value: isinstance(value, jax.Array),
    ),
    jnp.float32,
  )


def apply_update(
  optimizer: optax.GradientTransformation, state: TrainState, grads, ok: jax.Array, lr=None
) -> TrainState:
  """Applies the optax chain once to the accumulated gradient, or skips.

  When ``ok`` is False, params and opt_state are returned unchanged (selected on device,
  no host round-trip) and ``skipped`` increments. ``step`` always advances: it counts
  update steps of the run, applied or not. ``lr`` overrides the optimizer's own learning
  rate for this update by rescaling its updates (exact for optax's SGD/Adam/AdamW, whose
  update is linear in the lr); the optimizer must inject its lr (``make_optimizer`` does).
  """
  updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
  if lr is not None:
    updates = optax.tree.scale(lr / current_lr(new_opt_state), updates)
  new_params = optax.apply_updates(state.params, updates)
  return state.replace(
    step=state.step + 1,
    params=optax.tree.where(ok, new_params, state.params),
    opt_state=optax.tree.where(ok, new_opt_state, state.opt_state),
    skipped=state.skipped + jnp.logical_not(ok).astype(jnp.int32),
  )


def loss_spike(recent_losses: jax.Array, loss: jax.Array, factor: float) -> jax.Array:
  """``loss > factor × median(recent)`` once the window is at least half full (else False)."""
  if factor <= 0:
    return jnp.zeros((), bool)
  filled = jnp.isfinite(recent_losses)
  median = jnp.nanmedian(jnp.where(filled, recent_losses, jnp.nan))
  return (jnp.sum(filled) * 2 >= recent_losses.shape[0]) & (loss > factor * median)


def make_train_step(
  loss_fn: LossFn,
  optimizer: optax.GradientTransformation,
  *,
  grad_accum_steps: int,
  units_fn: UnitsFn | None = None,
  precision: str | None = None,
  nonfinite: str = "skip",
  mesh: Mesh | None = None,
  scan_unroll: int = 1,
  loss_scale: DynamicLossScale | None = None,
  spike_factor: float = 0.0,
) -> Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict]]:
  """Builds ``train_step(state, batch) -> (state, metrics)`` for one global batch.

  Args:
    loss_fn: ``(params, micro_batch, rng) -> (loss_sum, aux)`` returning the
      *un-normalized* loss summed over the micro-batch and a dict of scalar metrics
      (summed over micro-steps). ``aux["extra_loss"]``, if present, is a mean-type term
      added to the objective as ``extra_loss / K``.
    optimizer: an optax transformation (e.g. from ``jaxstep.optim.make_optimizer``); it
      sees the accumulated gradient exactly once per update step.
    grad_accum_steps: K, the number of micro-batches per global batch.
    units_fn: ``(global_batch) -> N``; defaults to counting ``batch["loss_mask"]``.
    precision: ``None``/``"fp32"`` or ``"bf16"`` (bf16 compute, fp32 params and
      accumulator).
    nonfinite: ``"skip"`` or ``"halt"``. The step itself always skips a bad update (a
      jitted program cannot raise); ``"halt"`` is acted on by the driver.
    mesh: a ``("data", "fsdp")`` mesh: accumulate device-locally under ``shard_map`` and
      reduce once per update (see ``sharded_accumulate``). Params must then be laid out by
      ``jaxstep.sharding`` rules and the batch sharded over both axes.
    scan_unroll: unroll factor of the micro-step scan (speed only).
    loss_scale: dynamic loss scaling (default on for ``precision="fp16"``, off otherwise);
      its state lives in ``state.loss_scale``. Grads are unscaled after the scan, before
      the norm and clipping.
    spike_factor: if > 0, skip an update whose loss exceeds ``spike_factor`` × the median
      loss of the last applied updates (``state.recent_losses``, once half full).

  Returns:
    A pure function; jit it yourself (with shardings and ``donate_argnums=0`` if wanted).
    ``metrics`` holds device scalars: ``loss`` (Σ NLL / N), ``tokens`` (N), ``grad_norm``
    (pre-clip), ``lr``, ``updated``, ``extra_loss`` and the summed aux entries.

  Example:
    >>> step = jax.jit(make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=4))
    >>> state, metrics = step(state, batch)  # batch leaves have leading dim G
  """
  if not isinstance(grad_accum_steps, int) or grad_accum_steps <= 0:
    raise ValueError(f"grad_accum_steps must be a positive int, got {grad_accum_steps!r}")
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
  if nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
  units_fn = units_fn or default_units_fn
  compute_dtype = PRECISIONS[precision]
  scaler = loss_scale or (DynamicLossScale() if precision == "fp16" else None)

  def param_specs(params):
    return tree_specs(params, mesh)

  def train_step(state: TrainState, batch):
    global_batch_size(batch, grad_accum_steps)  # trace-time checks, before the model runs
    units = units_fn(batch)  # global N: under jit with sharded inputs this is the global sum
    safe_units = jnp.maximum(units.astype(jnp.float32), 1.0)
    step_rng = jax.random.fold_in(state.rng, state.step)
    scale = state.loss_scale.scale if scaler else 1.0
    if mesh is None:
      grads, loss, extra, aux = accumulate(
        loss_fn,
        state.params,
        split_micro_batches(batch, grad_accum_steps),
        safe_units,
        step_rng,
        compute_dtype=compute_dtype,
        unroll=scan_unroll,
        loss_scale=scale,
      )
    else:
      grads, loss, extra, aux = sharded_accumulate(
        loss_fn,
        state.params,
        batch,
        safe_units,
        step_rng,
        grad_accum_steps=grad_accum_steps,
        mesh=mesh,
        param_specs=param_specs(state.params),
        compute_dtype=compute_dtype,
        unroll=scan_unroll,
        loss_scale=scale,
      )
    if scaler:  # unscale before anything looks at the gradient (norm, clipping, Adam)
      grads = optax.tree.scale(1.0 / scale, grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(extra) & jnp.isfinite(grad_norm)
    spike = loss_spike(state.recent_losses, loss, spike_factor)
    ok = (units > 0) & finite & ~spike
    new_state = apply_update(optimizer, state, grads, ok)
    window = state.recent_losses.shape[0]
    new_state = new_state.replace(
      recent_losses=jnp.where(
        ok, state.recent_losses.at[state.step % window].set(loss), state.recent_losses
      )
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

  return train_step
