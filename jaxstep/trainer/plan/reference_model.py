"""The reference model a preference or RL loss compares with, in one place: the LoRA base
(the same weights with the adapters switched off: no second copy), a frozen copy carried in
the train state's ``model_state`` (``live``), or none."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxstep.core import chunked_loss
from jaxstep.core.distill import teacher_loss
from jaxstep.core.trees import is_stored_weight
from jaxstep.models import lora

REFERENCE = "reference"  # the live reference's key in the state's model_state


def loss_with_reference(kind: str, apply_fn: Callable, build: Callable) -> Callable:
  """The step's ``loss_fn`` from ``build(reference) -> loss_fn(params, batch, rng)``, where
  ``reference`` is ``(params, inputs) -> logits`` of the ``kind`` of reference (None for
  ``"none"``). A live reference rides in the state's ``model_state``: the result is then
  the step's 4-argument form, returning the state unchanged."""
  if kind == "live":

    def with_reference(params, batch, rng, model_state):
      loss = build(_reference(kind, apply_fn, model_state))
      return (*loss(params, batch, rng), model_state)

    return with_reference
  return build(_reference(kind, apply_fn))


def _reference(kind: str, apply_fn: Callable, model_state=None) -> Callable | None:
  """The reference of ``kind``: the live copy ``model_state`` holds, the params with their
  LoRA adapters off, or None."""
  if kind == "live":
    frozen = model_state[REFERENCE]
    return _like(apply_fn, lambda _, inputs, **kw: apply_fn(frozen, inputs, **kw))
  if kind == "adapters":
    off = lambda params, inputs, **kw: apply_fn(lora.adapters_off(params), inputs, **kw)  # noqa: E731
    return _like(apply_fn, off)
  return None


def _like(apply_fn: Callable, reference: Callable) -> Callable:
  """``reference`` run without dropout (``train=False``), and marked as ``apply_fn`` is for
  a loss computed from the hidden states in chunks (``emits_hidden``, ``vocab_size``)."""

  def run(params, inputs, **kw):
    return reference(params, inputs, train=False, **kw)

  return chunked_loss.like(run, apply_fn)


def frozen_copy(params, dtype: str = "fp32") -> dict:
  """A live reference's ``model_state``: ``{"reference": a copy of params}``, the floating
  leaves in ``dtype`` (``fp32``, or ``bf16``: half the bytes)."""
  cast = jnp.bfloat16 if dtype == "bf16" else None

  def copy(x):
    if is_stored_weight(x):  # a quantized weight: copied as it is stored
      return jax.tree.map(jnp.copy, x)
    return x.astype(cast) if cast and jnp.issubdtype(x.dtype, jnp.floating) else jnp.copy(x)

  return {REFERENCE: jax.tree.map(copy, params, is_leaf=is_stored_weight)}


def loss_with_teacher(kind: str, apply_fn: Callable, teacher_apply: Callable, build: Callable):
  """The step's 4-argument ``loss_fn`` from ``build(reference, teacher) -> loss_fn(params,
  batch, rng)``: ``teacher`` is ``distill.teacher_loss``'s (``teacher_apply`` on the frozen
  params the state's ``model_state`` carries under ``distill.TEACHER``, without dropout),
  and ``reference`` is ``loss_with_reference``'s of ``kind``. The state comes back
  unchanged."""

  def with_teacher(params, batch, rng, model_state):
    reference = _reference(kind, apply_fn, model_state)
    loss = teacher_loss(lambda teacher: build(reference, teacher), teacher_apply)
    return loss(params, batch, rng, model_state)

  return with_teacher
