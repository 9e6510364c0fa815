"""Compute precisions: the one table of names and what each means for the step.

Parameters, gradients and the gradient accumulator stay fp32 under every precision; only
the forward and backward compute runs in the named dtype. At the model boundary the params
are cast (inside the differentiated function, so gradients flow back to fp32) and so are
the floating leaves of each micro-batch: a bf16 weight times an fp32 input would promote
the matmul back to fp32. Integer leaves (token ids, int masks) are left as they are, and
the step counts the normalization units N on the uncast global batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxstep.errors import ConfigError

# name -> compute dtype (None: fp32, no cast)
PRECISIONS = {"fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def compute_dtype(precision: str | None):
  """The compute dtype of ``precision`` (``None`` means fp32), or ``ConfigError``."""
  if precision is None:
    return None
  if precision not in PRECISIONS:
    raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
  return PRECISIONS[precision]


def cast_floating(tree, dtype):
  """Every floating leaf of ``tree`` cast to ``dtype`` (a no-op for ``dtype=None``)."""
  if dtype is None:
    return tree
  return jax.tree.map(
    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
  )
