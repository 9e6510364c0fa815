"""Models as ``(apply_fn, params)`` pairs: the step sees a plain params pytree.

``build`` makes the bundled GPT (``gpt.py``, with the CPU kernels of ``cpu_kernels.py``);
``from_nnx`` and ``from_linen`` adapt your own module into a ``Model`` (``adapters.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jaxstep.errors import ConfigError
from jaxstep.models.adapters import Model, from_linen, from_nnx
from jaxstep.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "Model", "build", "from_linen", "from_nnx", "num_params"]


def build(model_config: GPTConfig, rng: jax.Array | int) -> tuple[Callable, dict]:
  """Builds the bundled GPT: ``(apply_fn, params)`` with ``apply_fn(params, inputs, *,
  rng=None, train=False) -> logits``, params initialised from ``rng``. The GPT keeps no
  state besides its parameters, and takes its dropout key as ``rng``."""
  if model_config.vocab_size == 0:
    raise ConfigError("model.vocab_size 0 means 'the tokenizer's size': resolve it first")
  model = from_nnx(GPT(model_config, rngs=nnx.Rngs(params=rng)))

  def apply_fn(params, inputs, *, rng=None, train=False):
    return model.apply_fn(params, inputs, rng=rng, train=train)[0]

  return apply_fn, model.params


def num_params(params) -> int:
  """Total number of parameter elements."""
  return sum(x.size for x in jax.tree.leaves(params))
