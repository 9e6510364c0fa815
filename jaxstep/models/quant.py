"""A frozen base stored quantized (QLoRA): 4-bit NormalFloat or int8 weights with one
fp32 scale per block, dequantized a layer at a time inside the forward pass.

A quantized weight ``W`` ``[..., in, out]`` (leading axes: stacked layers, experts) is
``Quantized(codes, scale)``: the input axis is cut into blocks of ``block`` rows, each
block of each output column gets ``scale = absmax`` of its values (over the quantized type's
bound: 1 for NF4, 127.5 for int8), and each value the code of its nearest level (NF4: the
QLoRA paper's 16 NormalFloat levels in ``[-1, 1]``; int8: ``round(w / scale)``). The
dequantized weight is ``level(code) · scale``, in the dtype the weight had. The blocks run
along the input axis because that is how bitsandbytes cuts a torch ``[out, in]`` weight's
rows (consecutive elements of a row), so a block here holds the same 64 values as one of
bitsandbytes' (its second-level "double" quantization of the scales is not done: the
scales cost 4/64 = 0.06 bytes per parameter).

qwix does the quantizing and the dequantizing (``qwix.quantize`` with ``tiled_axes``,
``qwix.dequantize``; its NF4 levels). jaxstep adds one thing qwix lacks: NF4 codes are
stored two to a byte (``uint8`` ``[..., in/2, out]``, the even row in the low nibble),
because qwix keeps them as ``uint4``, which jax counts as one byte each and orbax's
tensorstore cannot write; packed, an NF4 weight with its scales is 0.56 bytes per
parameter, 28 % of bf16.

Which leaves: the projection kernels and routed experts inside the blocks (``quantizable``);
the embeddings, the output head, norms, biases and an MoE router stay as they are, as
bitsandbytes leaves ``lm_head`` and every non-``Linear`` weight. ``materialized`` turns a
tree's ``Quantized`` nodes back into arrays: ``layers.walk`` calls it on each block's
params inside the (scanned, rematerialized) block body, so one layer's weights are
dequantized at a time, and again in the backward pass rather than kept.
"""

from __future__ import annotations

import functools
import re

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstep.core.trees import path_name
from jaxstep.errors import ConfigError

_QWIX_TYPE = {"int8": jnp.int8, "nf4": "nf4"}
# the block params that hold matmul weights: projection kernels and stacked experts
_WEIGHTS = re.compile(r"(^|/)blocks/.*(/kernel|/experts/(gate|up|down)_proj)$")
_KEPT = re.compile(r"/router/|/lora/")  # a router's logits and the adapters stay unquantized
_CHUNK = 2**22  # elements quantized per call (qwix's NF4 rounding holds 16 floats per value)


@flax.struct.dataclass
class Quantized:
  """A weight ``[..., in, out]`` stored quantized: ``codes`` (NF4: ``uint8``
  ``[..., in/2, out]``, two codes per byte; int8: ``int8`` ``[..., in, out]``) and ``scale``
  (``float32`` ``[..., in/block, out]``); ``dtype``: the dequantized weight's."""

  codes: jax.Array
  scale: jax.Array
  qtype: str = flax.struct.field(pytree_node=False, default="nf4")
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  @property
  def shape(self) -> tuple[int, ...]:
    *lead, rows, cols = self.codes.shape
    return (*lead, rows * (2 if self.qtype == "nf4" else 1), cols)

  @property
  def block(self) -> int:
    return self.shape[-2] // self.scale.shape[-2]


nnx.register_data_type(Quantized)


def is_quantized(x) -> bool:
  return isinstance(x, Quantized)


def quantizable(name: str) -> bool:
  """Whether the params leaf ``name`` (``"blocks/0/q_proj/kernel"``) is stored quantized."""
  return bool(_WEIGHTS.search(name)) and not _KEPT.search(name)


def quantize(w, qtype: str, block: int, name: str = "weight") -> Quantized:
  """``w`` ``[..., in, out]`` (numpy or jax, any float dtype) quantized in blocks of
  ``block`` input rows; a ``jax.ShapeDtypeStruct`` gives the abstract result."""
  *lead, rows, cols = w.shape
  if len(w.shape) < 2 or rows % block:
    raise ConfigError(
      f"model.lora.quant_block {block} does not divide the input size {rows} of {name} "
      f"{tuple(w.shape)}: set model.lora.quant_block to a divisor of it"
    )
  dtype = jnp.dtype(w.dtype).name
  if isinstance(w, jax.ShapeDtypeStruct):
    packed = (*lead, rows // 2, cols) if qtype == "nf4" else (*lead, rows, cols)
    codes = jax.ShapeDtypeStruct(packed, jnp.uint8 if qtype == "nf4" else jnp.int8)
    scale = jax.ShapeDtypeStruct((*lead, rows // block, cols), jnp.float32)
    return Quantized(codes, scale, qtype, dtype)
  flat = jnp.asarray(w).reshape(-1, rows, cols)
  step = max(1, _CHUNK // rows)  # output columns per call: bounds qwix's temporaries
  parts = [_quantize_2d(flat[:, :, j : j + step], qtype, block) for j in range(0, cols, step)]
  codes = jnp.concatenate([c for c, _ in parts], axis=-1)
  scale = jnp.concatenate([s for _, s in parts], axis=-1)
  return Quantized(
    codes.reshape(*lead, *codes.shape[1:]), scale.reshape(*lead, *scale.shape[1:]), qtype, dtype
  )


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_2d(w, qtype: str, block: int):
  import qwix  # here, not at import: the commands that never quantize never load it

  q = qwix.quantize(
    w.astype(jnp.float32),
    _QWIX_TYPE[qtype],
    channelwise_axes=(0, 2),
    tiled_axes={1: block},
    scale_dtype=jnp.float32,
  )
  codes = q.qvalue
  if qtype == "nf4":
    codes = codes.astype(jnp.uint8)
    codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
  return codes, q.scale


def dequantize(q: Quantized) -> jax.Array:
  """The weight ``q`` stands for, in its dtype: ``level(code) · scale`` per block."""
  import qwix

  codes = q.codes
  if q.qtype == "nf4":
    pairs = jnp.stack([codes & 0xF, codes >> 4], axis=-2)  # [..., in/2, 2, out]
    codes = pairs.reshape(q.shape).astype(jnp.uint4)
  qarray = qwix.QArray(codes, q.scale, qtype=_QWIX_TYPE[q.qtype])
  return qwix.dequantize(qarray).astype(q.dtype)


def materialized(tree):
  """``tree`` with every ``Quantized`` node dequantized (other leaves as they are)."""
  return jax.tree.map(lambda x: dequantize(x) if is_quantized(x) else x, tree, is_leaf=is_quantized)


def has_quantized(tree) -> bool:
  return any(is_quantized(x) for x in jax.tree.leaves(tree, is_leaf=is_quantized))


def quantized_leaf(name: str, x, qtype: str, block: int):
  """The params leaf ``name`` as a frozen base stores it: ``quantize``d when ``qtype`` is
  set and the leaf is ``quantizable`` (abstract leaves give abstract ``Quantized`` nodes);
  else, or already quantized, ``x`` as it is."""
  if qtype == "none" or is_quantized(x) or not quantizable(name):
    return x
  return quantize(x, qtype, block, name)


def quantized(params, qtype: str, block: int, frozen=lambda name: True):
  """``params`` with every leaf that is ``frozen(name)`` as ``quantized_leaf`` stores it;
  ``qtype`` ``"none"`` returns ``params`` unchanged."""
  if qtype == "none":
    return params

  def one(path, x):
    name = path_name(path)
    return quantized_leaf(name, x, qtype, block) if frozen(name) else x

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def nbytes(tree) -> int:
  """Bytes of ``tree``'s leaves as stored (quantized leaves at their packed size)."""
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
