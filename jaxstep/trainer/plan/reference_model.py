"""The reference model a preference or RL loss compares with, in one place: the LoRA base
(the same weights with the adapters switched off: no second copy), a frozen copy carried in
the train state's ``model_state`` (``live``), or none."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxstep.models import lora

REFERENCE = "reference"  # the live reference's key in the state's model_state


def loss_with_reference(kind: str, apply_fn: Callable, build: Callable) -> Callable:
  """The step's ``loss_fn`` from ``build(reference) -> loss_fn(params, batch, rng)``, where
  ``reference`` is ``(params, inputs) -> logits`` of the ``kind`` of reference (None for
  ``"none"``). A live reference rides in the state's ``model_state``: the result is then
  the step's 4-argument form, returning the state unchanged."""
  if kind == "live":

    def with_reference(params, batch, rng, model_state):
      frozen = model_state[REFERENCE]
      loss = build(lambda _, inputs: apply_fn(frozen, inputs, train=False))
      return (*loss(params, batch, rng), model_state)

    return with_reference
  if kind == "adapters":
    return build(lambda params, inputs: apply_fn(lora.adapters_off(params), inputs, train=False))
  return build(None)


def frozen_copy(params, dtype: str = "fp32") -> dict:
  """A live reference's ``model_state``: ``{"reference": a copy of params}``, the floating
  leaves in ``dtype`` (``fp32``, or ``bf16``: half the bytes)."""
  cast = jnp.bfloat16 if dtype == "bf16" else None

  def copy(x):
    return x.astype(cast) if cast and jnp.issubdtype(x.dtype, jnp.floating) else jnp.copy(x)

  return {REFERENCE: jax.tree.map(copy, params)}
