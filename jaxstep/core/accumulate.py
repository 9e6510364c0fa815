"""The accumulation math of the step: micro-batch split, micro-gradients, the scan, and its
device-local ``shard_map`` form. Pure JAX; ``step.py`` and ``session.py`` build on it.

Every micro-gradient is of ``loss_sum_k / N`` (N = units in the WHOLE global batch), so the
sum over k is ``grad(Σ_k loss_sum_k / N)`` exactly, however unevenly units fall.

A model's non-parameter state (BatchNorm statistics) is threaded through the micro-steps in
order: micro-step k sees the state micro-step k − 1 left, as a PyTorch loop with gradient
accumulation would. It is not differentiated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstep.core import collectives
from jaxstep.core.freeze import combine
from jaxstep.core.layout import (
  batch_axes,
  batch_shards,
  inside_step,
  manual_spec,
  sum_over_batch,
  tree_specs,
)
from jaxstep.core.precision import cast_floating
from jaxstep.core.state import READ_ONLY_STATE

# (params, micro_batch, rng) -> (loss_sum, aux); with model state:
# (params, micro_batch, rng, model_state) -> (loss_sum, aux, new_model_state)
LossFn = Callable[..., tuple]
# The key under which a loss with a ``global_sums`` method finds those sums over the whole
# global batch in each micro-batch, when K > 1 (``accumulate``).
GLOBAL_SUMS = "global_sums"


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
  model_state=None,
  frozen=None,
  global_sums=None,
):
  """Gradient of one micro-batch's share of the global objective.

  The objective is ``loss_sum_k / N + extra_loss_k / K + extra_share_k``: the
  un-normalized loss sum is divided by the global unit count N; a per-micro-batch
  mean-type ``aux["extra_loss"]`` is averaged over the K micro-steps (MaxText's treatment
  of aux losses); ``aux["extra_share"]`` is this micro-batch's share of a term that is
  exact over the global batch (the shares of all micro-batches and devices sum to it: an
  MoE model's load-balancing loss, ``core/router_loss.py``), added as it is.

  Args:
    loss_fn: ``(params, micro_batch, rng) -> (loss_sum, aux)``, or with ``model_state``
      ``(params, micro_batch, rng, model_state) -> (loss_sum, aux, new_model_state)``.
    params: fp32 master parameters.
    micro_batch: one micro-batch, leaves ``[G/K, ...]``.
    units: N for the whole global batch (float32 scalar, already clamped to ≥ 1).
    rng: this micro-step's PRNG key.
    grad_accum_steps: K.
    compute_dtype: if set (bf16/fp16), floating params AND the floating leaves of the
      micro-batch are cast to it at the model boundary, so a model fed fp32 features
      computes in that dtype instead of promoting back to fp32; integer leaves (token
      ids, int masks) are untouched. Gradients still flow back to (and come out as) fp32.
    loss_scale: the objective is multiplied by it before differentiation (fp16), so the
      returned grads are scaled; the reported loss is not.
    model_state: the model's non-parameter state, or None for a model without any.
    frozen: the frozen part of the params (``core.freeze.partition``; ``params`` is then
      the trainable part): the loss sees both, only ``params`` is differentiated.
    global_sums: the loss's ``global_sums`` over the whole global batch (``accumulate``),
      handed to it as ``micro_batch[GLOBAL_SUMS]``; None: not given.

  Returns:
    ``(grads, (loss_sum, extra_loss, aux, model_state))`` with fp32 grads shaped like params
    and the model state after this micro-step (None stays None).
  """

  micro_batch = cast_floating(micro_batch, compute_dtype)  # data, not differentiated
  if global_sums is not None:  # after the cast: counts stay exact in fp32
    micro_batch = {**micro_batch, GLOBAL_SUMS: global_sums}
  frozen = cast_floating(frozen, compute_dtype)

  def objective(p):
    p = combine(cast_floating(p, compute_dtype), frozen)
    if model_state is None:
      loss_sum, aux = loss_fn(p, micro_batch, rng)
      new_model_state = None
    else:
      loss_sum, aux, new_model_state = loss_fn(p, micro_batch, rng, model_state)
    aux = dict(aux)
    extra = jnp.asarray(aux.pop("extra_loss", 0.0), jnp.float32)
    share = jnp.asarray(aux.pop("extra_share", 0.0), jnp.float32)
    loss_sum = jnp.asarray(loss_sum, jnp.float32)
    objective = loss_sum / units + extra / grad_accum_steps + share
    # the reported extra loss: the mean-type term's share of the average, and the share
    reported = extra + share * grad_accum_steps
    return objective * loss_scale, (loss_sum, reported, aux, new_model_state)

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
  model_state=None,
  frozen=None,
):
  """Sums the K micro-gradients with ``lax.scan`` into an fp32 accumulator.

  Args:
    micro_batches: leaves ``[K, G/K, ...]`` from ``split_micro_batches`` in the same jit
      (then no copy of the batch is made; see below).
    units: global N as float32, clamped to ≥ 1 (a zero-unit batch is skipped later).
    step_rng: this update's key; micro-step k uses ``fold_in(step_rng, k)``.
    extra_terms: how many ``extra_loss`` values are averaged: K, or K × devices when each
      device computes its own (default K).
    unroll: ``lax.scan`` unroll factor (a speed knob; the result is the same).
    loss_scale: multiplies every micro-objective (fp16); the caller unscales the sum.
    model_state: the model's non-parameter state before micro-step 0, or None.
    frozen: the frozen part of the params, or None (``micro_gradients``); the accumulator
      holds the trainable part only.

  Returns:
    ``(grads, loss, extra_loss, aux, model_state)``: ``grads = Σ_k grad(loss_sum_k / N +
    extra_k / K)``, ``loss = Σ_k loss_sum_k / N``, ``extra_loss = Σ_k extra_k / K``, aux
    summed over k, and the model state after micro-step K − 1.
  """
  k_steps = jax.tree.leaves(micro_batches)[0].shape[0]
  extra_terms = extra_terms or k_steps
  # Micro-batch k is read in place from the [G/K, K, ...] view of the batch: swapping the
  # split's axes back undoes split_micro_batches' swap (XLA folds the two transposes into a
  # free reshape), where scanning over [K, G/K, ...] would first copy the whole global batch
  # into micro-batch order, scratch memory that grows with G = K × micro-batch.
  in_place = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), micro_batches)
  micro = lambda k: jax.tree.map(  # noqa: E731
    lambda x: jax.lax.dynamic_index_in_dim(x, k, 1, keepdims=False), in_place
  )
  sums = None
  if getattr(loss_fn, "global_sums", None) is not None and k_steps > 1:
    sums_fn = loss_fn.global_sums
    sums = _global_sums(sums_fn, params, frozen, micro, k_steps, step_rng, compute_dtype)
  grad_fn = lambda mb, rng, ms: micro_gradients(  # noqa: E731
    loss_fn,
    params,
    mb,
    units,
    rng,
    grad_accum_steps=extra_terms,
    compute_dtype=compute_dtype,
    loss_scale=loss_scale,
    model_state=ms,
    frozen=frozen,
    global_sums=sums,
  )

  def body(carry, k):
    grads_acc, loss_acc, extra_acc, ms = carry
    mb = micro(k)
    grads, (loss_sum, extra, aux, ms) = grad_fn(mb, jax.random.fold_in(step_rng, k), ms)
    return (
      optax.tree.add(grads_acc, grads),
      loss_acc + loss_sum / units,
      extra_acc + extra / extra_terms,
      ms,
    ), _as_fp32(aux)

  init = (
    optax.tree.zeros_like(params, jnp.float32),
    jnp.zeros((), jnp.float32),
    jnp.zeros((), jnp.float32),
    model_state,
  )
  (grads, loss, extra, after), auxes = jax.lax.scan(body, init, jnp.arange(k_steps), unroll=unroll)
  return grads, loss, extra, summed_over_steps(auxes), _read_only_kept(after, model_state)


def _read_only_kept(after, before):
  """``after`` with its ``READ_ONLY_STATE`` entries as they were ``before`` the scan: what a
  loss returns for them is not kept, on one device as on many (``_averaged``)."""
  if not isinstance(after, dict):
    return after
  return {k: before[k] if k in READ_ONLY_STATE and k in before else v for k, v in after.items()}


def _averaged(after, before, specs, axes):
  """The model state a device hands back: its ``READ_ONLY_STATE`` entries as they came in
  (``before``, its shard), every other leaf of ``after`` averaged over the devices
  (``collectives.average``)."""
  average = functools.partial(collectives.average, axes=axes)
  if not isinstance(after, dict):
    return jax.tree.map(average, after, specs)
  return {
    k: before[k] if k in READ_ONLY_STATE else jax.tree.map(average, v, specs[k])
    for k, v in after.items()
  }


def _as_fp32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def summed_over_steps(stacked):
  """Σ_k over the leading axis of every leaf ``[K, ...]``, added in step order,
  ``((0 + a_0) + a_1) + …``, as a scan carry would add them.

  The micro-steps' aux values and global sums leave their scan stacked and are summed
  afterwards, instead of in a carry: a carry needs their shapes before the scan, which
  means tracing the loss (forward and backward) a second time, and tracing is most of what
  compiling a step costs. They are metrics and counts, so K copies of them are small."""
  if not jax.tree.leaves(stacked):
    return stacked
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), stacked)
  total, _ = jax.lax.scan(lambda acc, a: (optax.tree.add(acc, a), None), zeros, stacked)
  return total


def _global_sums(sums_fn, params, frozen, micro, k_steps, step_rng, compute_dtype):
  """``sums_fn(params, micro_batch, rng)`` summed over the K micro-batches (each with its
  micro-step's key, so a dropout-dependent sum is the one its micro-step computes) and over
  every device: a forward-only pass before the micro-gradients, for a loss term that needs
  a count over the whole global batch (an MoE router's expert loads)."""
  full = combine(cast_floating(params, compute_dtype), cast_floating(frozen, compute_dtype))
  full = jax.lax.stop_gradient(full)

  def one(_, k):
    mb = cast_floating(micro(k), compute_dtype)
    return None, _as_fp32(sums_fn(full, mb, jax.random.fold_in(step_rng, k)))

  _, stacked = jax.lax.scan(one, None, jnp.arange(k_steps))
  return sum_over_batch(summed_over_steps(stacked))


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
  model_state=None,
  frozen=None,
):
  """``accumulate`` with device-local accumulators and ONE reduction per update step.

  Under ``jax.shard_map`` over the batch axes (``("data", "fsdp")``, and ``"expert"`` when the
  mesh has one: ``layout.batch_axes``) each device: all-gathers its fsdp-sharded
  parameters once, splits ITS rows of the global batch into K micro-batches (the same
  micro-batch membership as the unsharded split when ``K`` divides the per-device rows),
  scans them into a local fp32 accumulator, and only after the scan reduces:
  ``psum_scatter`` over ``fsdp`` then ``psum`` over ``data`` of the shard (or ``psum`` over
  both for replicated leaves; ``collectives.reduce``). Plain ``jit`` instead all-reduces (and
  re-gathers) inside every micro-step.

  The model state is laid out like params; each device threads it through its own rows'
  micro-steps, and after the scan its floating leaves are averaged over all devices (other
  leaves take the maximum), the way data-parallel BatchNorm without cross-device
  statistics ends up when the replicas' buffers are averaged; its read-only entries (a
  live reference, a teacher: ``state.READ_ONLY_STATE``) come back as they went in.

  Args:
    batch: the global batch, leaves ``[G, ...]`` sharded ``P(("data", "fsdp"))``.
    units: global N (float32, ≥ 1), computed on the global batch outside.
    param_specs: ``PartitionSpec`` per parameter leaf (see ``jaxstep.core.layout``).
    model_state: the model's non-parameter state, or None.
    frozen: the frozen part of the params (laid out by ``core.layout``'s rule), gathered
      once per update like the trainable part, never reduced.
  """
  devices = batch_shards(mesh)
  state_specs = tree_specs(model_state, mesh)
  frozen_specs = tree_specs(frozen, mesh)
  manual = lambda specs: jax.tree.map(manual_spec, specs)  # noqa: E731

  def local(params, batch, units, step_rng, loss_scale, model_state, frozen):
    full = jax.tree.map(collectives.gather, params, param_specs)
    with inside_step(mesh):
      return _local_sums(full, batch, units, step_rng, loss_scale, model_state, frozen)

  def _local_sums(full, batch, units, step_rng, loss_scale, model_state, frozen):
    grads, loss, extra, aux, after = accumulate(
      loss_fn,
      full,
      split_micro_batches(batch, grad_accum_steps),
      units,
      step_rng,
      compute_dtype=compute_dtype,
      extra_terms=grad_accum_steps * devices,
      unroll=unroll,
      loss_scale=loss_scale,
      model_state=jax.tree.map(collectives.gather, model_state, state_specs),
      frozen=jax.tree.map(collectives.gather, frozen, frozen_specs),
    )
    grads, loss, extra, aux = collectives.reduce(grads, (loss, extra, aux), param_specs, axes)
    return grads, loss, extra, aux, _averaged(after, model_state, state_specs, axes)

  axes = batch_axes(mesh)
  specs = (manual(param_specs), P(axes), P(), P(), P(), manual(state_specs), manual(frozen_specs))
  # check_vma=False: the scan's zero-initialized carries are device-invariant while the
  # per-device sums vary; every reduction below is an explicit psum, so nothing is implicit.
  # A tensor axis stays automatic: the compiler partitions each layer over it from the
  # leaves' shardings (``layout``), the rows' collectives stay these explicit ones.
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=specs,
    out_specs=(manual(param_specs), P(), P(), P(), manual(state_specs)),
    axis_names=frozenset(axes),
    check_vma=False,
  )(params, batch, units, step_rng, jnp.asarray(loss_scale, jnp.float32), model_state, frozen)
