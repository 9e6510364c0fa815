"""Restoring a checkpoint written in the other block layout (``model.scan_layers`` changed
since it was written): the target is converted to the saved layout for orbax, and what
orbax read is converted back and placed like the target. Values are unchanged
(``models.layers`` has the layouts)."""

from __future__ import annotations

import logging

import jax
from jax.sharding import NamedSharding

from jaxstep import parallel
from jaxstep.models import layers

log = logging.getLogger("jaxstep")


def like_saved(saved_tree, abstract):
  """``abstract``, or (``model.scan_layers`` changed since the save) it in the block layout
  of ``saved_tree`` (orbax's metadata of the checkpoint)."""
  have, want = layers.layout_of(saved_tree), layers.layout_of(abstract)
  if have is None or want is None or have == want:
    return abstract
  return in_layout(abstract, have)


def in_layout(abstract, stacked: bool):
  """``abstract`` (``ShapeDtypeStruct`` leaves with shardings) in the other block layout,
  every leaf laid out by the same rules as the target (``parallel.tree_shardings`` on the
  target's mesh, or the target's single device)."""
  converted = jax.eval_shape(lambda t: layers.convert_layout(t, stacked), abstract)
  sharding = jax.tree.leaves(abstract)[0].sharding
  if isinstance(sharding, NamedSharding):
    shardings = parallel.tree_shardings(converted, sharding.mesh)
  else:
    shardings = jax.tree.map(lambda _: sharding, converted)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), converted, shardings
  )


def back_to(restored, abstract):
  """``restored`` (read in the saved layout) in ``abstract``'s layout and placement."""
  stacked = layers.layout_of(abstract)
  log.info(
    "the checkpoint's blocks are %s, the model's %s: parameters and optimizer state "
    "converted (model.scan_layers changed)",
    "per block" if stacked else "stacked",
    "stacked" if stacked else "per block",
  )
  converted = layers.convert_layout(restored, stacked)
  return jax.device_put(converted, jax.tree.map(lambda x: x.sharding, abstract))
