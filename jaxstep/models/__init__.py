"""Models as ``(apply_fn, params)`` pairs: the step sees a plain params pytree (DESIGN §4)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
from flax import nnx

from jaxstep.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "build", "from_nnx", "num_params"]


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


def build(model_config: GPTConfig, rng: jax.Array | int) -> tuple[Callable, dict]:
  """Builds the bundled GPT: ``(apply_fn, params)``, params initialised from ``rng``."""
  return from_nnx(GPT(model_config, rngs=nnx.Rngs(params=rng)))


def num_params(params) -> int:
  """Total number of parameter elements."""
  return sum(x.size for x in jax.tree.leaves(params))
