"""The device-side training state: one pytree that the step threads and orbax saves."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxstep.core import freeze
from jaxstep.core.loss_scale import LossScaleState, fixed_state
from jaxstep.errors import ConfigError

# ``model_state`` entries a loss reads and never changes: a live reference's frozen copy and
# a distillation teacher. The step keeps them as they came, whatever the loss returns for
# them, on one device as on many (no average over the devices: an all-reduce of a whole
# model per update, and rounding drift on device counts that are not powers of two); a
# checkpoint leaves the teacher out. Reserved names: a state of your own that changes
# (an EMA teacher) takes another key.
READ_ONLY_STATE = ("reference", "teacher")


def raw_key(rng) -> jax.Array:
  """``rng`` as the one form the state stores: a raw threefry key, ``uint32[2]``.

  Accepts an int seed (``PRNGKey(seed)``), a new-style typed key (``jax.random.key``; its
  ``key_data``) or a raw key. One stored form keeps checkpoints and resume the same
  whichever the caller passed, and a typed key and its ``key_data`` draw the same numbers.
  Always a new array: a step jitted with ``donate_argnums=0`` consumes the state's key,
  never the caller's (a key's ``key_data`` and ``astype`` to its own dtype share its buffer).
  """
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    return jax.random.PRNGKey(int(rng))
  if jax.dtypes.issubdtype(getattr(rng, "dtype", None), jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  rng = jnp.asarray(rng)
  if rng.shape != (2,) or not jnp.issubdtype(rng.dtype, jnp.integer):
    raise ConfigError(
      f"rng must be an int seed, a jax.random.key or a raw uint32[2] key (PRNGKey); got "
      f"{rng.dtype}{list(rng.shape)}"
    )
  return jnp.array(rng, jnp.uint32, copy=True)


def empty_to_none(model_state: Any) -> Any:
  """``None`` for a model state without any array (``{}``, an empty pytree): such a model
  keeps no state, and its loss takes no ``model_state`` argument."""
  if model_state is None or not jax.tree.leaves(model_state):
    return None
  return model_state


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
    trainable=None,
  ) -> TrainState:
    """Builds the state at update step 0 from exactly what it is given.

    Prefer ``train_step.init(params, rng)``: the step knows its precision, loss scaling and
    spike window, so the state it builds always fits it.

    Args:
      params: parameter pytree (any JAX model's parameters).
      optimizer: the optax transformation the step will apply; used to init opt_state.
      rng: an int seed, a typed key (``jax.random.key``) or a raw ``uint32[2]`` key;
        stored raw (``raw_key``).
      loss_scale: initial loss scale or scaler state (only meaningful for fp16).
      loss_window: length of ``recent_losses`` (the spike guard's running window).
      model_state: the model's non-parameter state, or None; an empty one (``{}``, as
        ``from_linen`` returns for a stateless module) is None.
      trainable: ``(name, leaf) -> bool`` (``jaxstep.core.freeze``); the optimizer state
        covers the trainable leaves only. None: every leaf trains.

    Returns:
      A ``TrainState`` with ``step == 0`` and ``skipped == 0``.
    """
    return cls(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=optimizer.init(freeze.partition(params, trainable)[0]),
      rng=raw_key(rng),
      skipped=jnp.zeros((), jnp.int32),
      loss_scale=loss_scale if isinstance(loss_scale, LossScaleState) else fixed_state(loss_scale),
      recent_losses=jnp.full((loss_window,), jnp.inf, jnp.float32),
      model_state=empty_to_none(model_state),
    )
