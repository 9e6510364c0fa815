"""A GPT's blocks as a list or as one stack: walking them (with or without remat, unrolled
or scanned) and converting parameters between the two layouts.

Layouts of ``params["blocks"]``:

- per block (``model.scan_layers=false``): ``{0: {"qkv": {"kernel": [D, 3D]}, …}, 1: …}``
- stacked (``model.scan_layers=true``): ``{"qkv": {"kernel": [L, D, 3D]}, …}``, layer ``i``
  at index ``i`` of the leading axis.

Layer ``i`` has the same values in both (``stack_blocks`` / ``unstack_blocks``), and a
seed initialises the same model in either layout, so a checkpoint of one layout loads into
the other through ``convert_layout``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.core import layout
from jaxstep.models import quant

REMAT_POLICIES = {
  "none": None,  # keep every activation the backward pass needs
  "block": jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
  # keep the projections' matmul outputs (no batch dims: not attention's S×S products)
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def stack_modules(blocks: list[nnx.Module]) -> nnx.Module:
  """One module of ``blocks[0]``'s kind whose every variable holds all blocks' values
  along a new leading axis (what ``walk(..., scanned=True)`` takes)."""
  graphdef, _ = nnx.split(blocks[0])
  states = [nnx.state(b) for b in blocks]
  return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def layer(stacked: nnx.Module, i: int) -> nnx.Module:
  """Block ``i`` of a stacked module, as a module of its own."""
  graphdef, state = nnx.split(stacked)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def dequantized(block: nnx.Module) -> nnx.Module:
  """``block`` with a quantized base's weights dequantized (``quant.py``); else itself."""
  graphdef, state = nnx.split(block)
  if not quant.has_quantized(state):
    return block
  return nnx.merge(graphdef, quant.materialized(state))


def _apply(graphdef, state, x, key, inputs, train):
  # a quantized base (QLoRA): this block's weights dequantized here, inside the block's
  # (rematerialized) body, so one layer at a time is ever in full precision
  return nnx.merge(graphdef, quant.materialized(state))(x, rng=key, train=train, **inputs)


def walk(
  blocks,
  x: jax.Array,
  keys,
  *,
  scanned: bool,
  remat: str,
  train: bool,
  inputs=None,
  sums: bool = False,
):
  """``x`` through every block in order. ``blocks``: a list of modules, or one stacked
  module (``scanned``: walked by ``lax.scan``, one compiled block body); ``keys``: one
  dropout key per block (a ``[L, …]`` key array) or None; ``remat``: a ``REMAT_POLICIES``
  name, applied to each block; ``inputs``: keyword arrays every block takes as they are
  (document masking's ``segment_ids`` and ``positions``), None or ``{}`` for none, which
  traces exactly the walk without them. ``sums``: each block returns ``(x, sums)`` (an
  MoE model's routing sums, ``models/moe.py``), and the walk ``(x, sums stacked [L, …])``."""
  policy, inputs = REMAT_POLICIES[remat], inputs or {}
  if scanned:
    graphdef, state = nnx.split(blocks)

    def body(x, layer_xs):
      layer_state, key = layer_xs
      out = _apply(graphdef, layer_state, x, key, inputs, train)
      x, per_layer = out if sums else (out, None)
      return layout.constrain_sequence(x), per_layer

    if remat != "none":
      body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    x, stacked = jax.lax.scan(body, x, (state, keys))
    return (x, stacked) if sums else x
  collected = []
  for i, block in enumerate(blocks):
    key = None if keys is None else keys[i]
    if remat == "none" and not quant.has_quantized(nnx.state(block)):
      out = block(x, rng=key, train=train, **inputs)
    else:
      graphdef, state = nnx.split(block)
      apply = functools.partial(_apply, graphdef, train=train)
      if remat != "none":
        apply = jax.checkpoint(apply, policy=policy)
      out = apply(state, x, key, inputs)
    if sums:
      out, per_layer = out
      collected.append(per_layer)
    x = layout.constrain_sequence(out)  # sequence parallelism: between blocks
  if sums:
    return x, jax.tree.map(lambda *xs: jnp.stack(xs), *collected)
  return x


def is_stacked(blocks: dict) -> bool:
  """Whether a ``params["blocks"]`` mapping is the stacked layout (not keyed by index)."""
  return not all(isinstance(k, int) or str(k).isdigit() for k in blocks)


def stack_blocks(blocks: dict) -> dict:
  """Per-block ``{0: tree, 1: tree, …}`` → one tree whose leaves are ``[L, …]``."""
  layers = [blocks[k] for k in sorted(blocks, key=int)]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def unstack_blocks(stacked: dict) -> dict:
  """A stacked tree (leaves ``[L, …]``) → per-block ``{0: tree, 1: tree, …}``."""
  n = jax.tree.leaves(stacked)[0].shape[0]
  return {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)}


def _holds_blocks(node) -> bool:
  return isinstance(node, dict) and "blocks" in node


def convert_layout(tree, scan_layers: bool):
  """``tree`` with every mapping that holds ``"blocks"`` (params, Adam moments, a whole
  train state) in the stacked (``scan_layers``) or the per-block layout. Values are
  unchanged; a tree already in that layout comes back as it is."""

  def convert(node):
    if not _holds_blocks(node) or is_stacked(node["blocks"]) == scan_layers:
      return node
    blocks = node["blocks"]
    return {**node, "blocks": stack_blocks(blocks) if scan_layers else unstack_blocks(blocks)}

  return jax.tree.map(convert, tree, is_leaf=_holds_blocks)


def layout_of(tree) -> bool | None:
  """True if ``tree``'s first ``"blocks"`` mapping is stacked, False if per block, None if
  it holds none."""
  found = []
  jax.tree.map(lambda n: found.append(n) if _holds_blocks(n) else None, tree, is_leaf=_holds_blocks)
  return is_stacked(found[0]["blocks"]) if found else None
