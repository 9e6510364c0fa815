"""The reference model a preference or RL loss compares with, in one place: the LoRA base
(the same weights with the adapters switched off: no second copy), a frozen copy carried in
the train state's ``model_state`` (``live``), or none."""

from __future__ import annotations

from collections.abc import Callable

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
