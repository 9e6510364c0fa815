"""Dynamic loss scaling for fp16 (no maintained library fits a scan-accumulated step).

The loss is multiplied by ``scale`` before differentiation so small fp16 gradients do not
flush to zero; gradients are divided by ``scale`` after the scan, *before* clipping. A
non-finite gradient skips the update and halves the scale; ``growth_interval`` finite
updates in a row double it. Shaped like an optax transform: a NamedTuple state, a pure
``init`` and a pure ``adjust``.

(``jmp`` is archived; flax's ``DynamicScale`` wraps ``value_and_grad`` of one batch and so
cannot see the accumulated gradient.)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossScaleState(NamedTuple):
  scale: jax.Array  # float32 scalar multiplying the loss
  good_steps: jax.Array  # int32: finite updates since the scale last changed


def fixed_state(scale: float = 1.0) -> LossScaleState:
  return LossScaleState(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  init_scale: float = 2.0**15  # starting scale
  growth_interval: int = 2000  # finite updates in a row before the scale doubles
  min_scale: float = 1.0  # never halve below this
  max_scale: float = 2.0**24  # never double above this

  def init(self) -> LossScaleState:
    return fixed_state(self.init_scale)

  def adjust(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
    """Halve on a non-finite update; double after ``growth_interval`` finite ones."""
    good = state.good_steps + 1
    grow = good >= self.growth_interval
    grown = jnp.where(grow, jnp.minimum(state.scale * 2, self.max_scale), state.scale)
    return LossScaleState(
      scale=jnp.where(finite, grown, jnp.maximum(state.scale / 2, self.min_scale)),
      good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32),
    )
