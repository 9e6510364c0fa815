"""Adapters from a framework's module to the step's ``(apply_fn, params)`` pair."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from flax import nnx


def from_nnx(module: nnx.Module) -> tuple[Callable, dict]:
  """Adapts any NNX module to ``apply_fn(params, inputs, *, rng=None, train=False)``.

  ``nnx.split`` separates the ``nnx.Param`` variables (returned as a plain nested dict, the
  pytree the optimizer and checkpoints see) from all other state, which is closed over and
  constant. ``rng`` and ``train`` are passed on only if the module's ``__call__`` takes them.

  Returns:
    ``(apply_fn, params)``.
  """
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  accepts = inspect.signature(type(module).__call__).parameters

  def apply_fn(params, inputs, *, rng=None, train=False):
    model = nnx.merge(graphdef, params, rest)
    kwargs = {}
    if "rng" in accepts:
      kwargs["rng"] = rng
    if "train" in accepts:
      kwargs["train"] = train
    return model(inputs, **kwargs)

  return apply_fn, nnx.to_pure_dict(params)
