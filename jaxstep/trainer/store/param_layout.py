"""Restoring a checkpoint whose bundled GPT holds its fused q/k/v columns in the order an
older jaxstep used.

Layout 1 (run states without ``param_layout``) kept GPT-2's order ``[q | k | v]``; layout 2
keeps them head-major, ``[heads, 3, head_dim]``, so a tensor-parallel split of the columns
gives each device whole heads (``models.gpt.head_major``). The shapes are the same, so
nothing but this record tells the two apart: a layout-1 GPT checkpoint read as layout 2
would resume with every head's q, k and v mixed. Such a checkpoint is permuted as it is
read: every leaf on a ``qkv`` path whose last axis holds the fused columns (the kernel, the
bias, a LoRA ``B``, and each optimizer moment or frozen copy of them).

Only a run state that names the model (``RunState.model``, what the CLI writes), or a reader
that knows it (``Checkpointer(model=…)``: a Python-API trainer of a bundled model), says the
checkpoint holds the bundled GPT; any other checkpoint is read as it is. Every checkpoint
jaxstep writes now records ``param_layout``.
"""

from __future__ import annotations

import functools
import logging

import jax

from jaxstep.core.trees import key_name
from jaxstep.models import gpt, hf_gpt2

log = logging.getLogger("jaxstep")
PARAM_LAYOUT = 2  # the version a run state written now records


def needs_upgrade(run: dict | None, model: dict | None = None) -> bool:
  """Whether a checkpoint with run state ``run`` holds a GPT in layout 1; ``model``: the
  model's config section (``family``, ``n_heads``, ``d_model``) when ``run`` names none."""
  model = (run or {}).get("model") or model
  if not isinstance(model, dict) or model.get("family", "gpt") != "gpt":
    return False  # another model, or none named (checkpoints older than model.family: GPTs)
  return int((run or {}).get("param_layout", 1)) < PARAM_LAYOUT


def upgrade(state, run: dict | None, model: dict | None = None):
  """``state`` (read from a checkpoint with run state ``run``) in the current layout: the
  fused columns permuted to head-major when ``needs_upgrade``, placed as they were read
  (each leaf's old copy donated: no second copy of the state at once)."""
  if not needs_upgrade(run, model):
    return state
  model = (run or {}).get("model") or model
  n_heads, width = int(model["n_heads"]), 3 * int(model["d_model"])
  log.info(
    "the checkpoint's GPT holds its q/k/v columns as [q | k | v] (written by an older "
    "jaxstep): permuted to head-major in the parameters and the optimizer state"
  )
  permute = functools.partial(gpt.head_major, n_heads=n_heads)

  def leaf(path, x):
    keys = tuple(key_name(k) for k in path)
    if not hf_gpt2.permuted(keys) or not getattr(x, "ndim", 0) or x.shape[-1] != width:
      return x
    return jax.jit(permute, out_shardings=x.sharding, donate_argnums=0)(x)

  return jax.tree_util.tree_map_with_path(leaf, state)
