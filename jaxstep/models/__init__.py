"""Models as ``(apply_fn, params)`` pairs: the step sees a plain params pytree.

``build`` makes the bundled GPT (``gpt.py``, with the CPU kernels of ``cpu_kernels.py``);
``from_nnx`` adapts any NNX module (``adapters.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jaxstep.models.adapters import from_nnx
from jaxstep.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "build", "from_nnx", "num_params"]


def build(model_config: GPTConfig, rng: jax.Array | int) -> tuple[Callable, dict]:
  """Builds the bundled GPT: ``(apply_fn, params)``, params initialised from ``rng``."""
  return from_nnx(GPT(model_config, rngs=nnx.Rngs(params=rng)))


def num_params(params) -> int:
  """Total number of parameter elements."""
  return sum(x.size for x in jax.tree.leaves(params))
