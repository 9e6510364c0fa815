"""The device-side training state: one pytree that the step threads and orbax saves."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxstep.core.loss_scale import LossScaleState, fixed_state


@struct.dataclass
class TrainState:
  """Everything the jitted step reads and writes, as one pytree of device arrays.

  Attributes:
    step: number of update steps taken (int32 scalar). Counts optimizer *updates*
      attempted, skipped ones included; never micro-steps.
    params: the model parameters (fp32 master copy).
    opt_state: the optax optimizer state. Untouched by skipped updates, so its own
      internal count (and therefore the lr schedule) counts *applied* updates.
    rng: base PRNG key (raw ``uint32[2]``). Per-update keys are
      ``fold_in(rng, step)`` and per-micro-step keys ``fold_in(that, k)``, so a run
      resumed at step s draws exactly the same randomness.
    skipped: number of update steps skipped because the global batch had zero units or
      produced a non-finite loss/gradient (int32 scalar).
    loss_scale: ``LossScaleState(scale, good_steps)``; the scale stays 1.0 unless fp16
      training with dynamic loss scaling (``jaxstep.core.loss_scale``).
    recent_losses: float32 ring buffer of the last applied updates' losses (inf = empty;
      not NaN, which multi-process equality checks of the initial state reject),
      slot ``step % window``; the optional loss-spike guard compares against its median.
    model_state: the model's non-parameter state (BatchNorm statistics, any mutable
      collection), threaded through the micro-steps in order; ``None`` for a model without
      any (then ``loss_fn`` takes no ``model_state`` argument).
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  skipped: jax.Array
  loss_scale: LossScaleState
  recent_losses: jax.Array
  model_state: Any = None

  @classmethod
  def create(
    cls,
    *,
    params: Any,
    optimizer: optax.GradientTransformation,
    rng: jax.Array | int,
    loss_scale: float | LossScaleState = 1.0,
    loss_window: int = 32,
    model_state: Any = None,
  ) -> TrainState:
    """Builds the state at update step 0 from exactly what it is given.

    Prefer ``train_step.init(params, rng)``: the step knows its precision, loss scaling and
    spike window, so the state it builds always fits it.

    Args:
      params: parameter pytree (any JAX model's parameters).
      optimizer: the optax transformation the step will apply; used to init opt_state.
      rng: a raw PRNG key or an int seed.
      loss_scale: initial loss scale or scaler state (only meaningful for fp16).
      loss_window: length of ``recent_losses`` (the spike guard's running window).
      model_state: the model's non-parameter state, or None.

    Returns:
      A ``TrainState`` with ``step == 0`` and ``skipped == 0``.
    """
    if isinstance(rng, int):
      rng = jax.random.PRNGKey(rng)
    return cls(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=optimizer.init(params),
      rng=rng,
      skipped=jnp.zeros((), jnp.int32),
      loss_scale=loss_scale if isinstance(loss_scale, LossScaleState) else fixed_state(loss_scale),
      recent_losses=jnp.full((loss_window,), jnp.inf, jnp.float32),
      model_state=model_state,
    )
