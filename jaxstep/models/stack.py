"""What the bundled GPT and the Llama family share around their blocks: the training
forward pass and the forward pass over a key/value cache.

A subclass sets ``cfg`` (with ``n_layers``, ``max_seq_len``, ``scan_layers``, ``remat``),
``blocks`` (a list, or one stacked module: ``layers.py``) and ``dropout``, and defines
``embed_inputs(inputs, positions)``, ``_logits(x)``, ``_hidden_and_head(x)`` and
``_cache_heads()``; each block has
``__call__(x, rng=, train=, segment_ids=None, positions=None)`` and ``decode(x, cache,
positions)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstep.core import layout
from jaxstep.errors import BatchError
from jaxstep.models import layers


class DecoderStack(nnx.Module):
  """Embeddings → blocks → logits ``[B, S, vocab]``, with or without a key/value cache."""

  def __call__(
    self,
    inputs: jax.Array,
    *,
    rng: jax.Array | None = None,
    train: bool = False,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    route_weights: jax.Array | None = None,
    as_hidden: bool = False,
  ) -> jax.Array:
    """Logits of ``inputs [B, S]`` at positions ``0 … S-1``; dropout (one key per block
    and one for the embeddings, split from ``rng``) only when ``train``.

    Document masking (a packed window of several documents, ``Windows.rows(...,
    document_mask=True)``): ``segment_ids`` ``int32[B, S]`` lets query ``i`` attend to key
    ``j`` only if ``j ≤ i`` and ``segment_ids[b, i] == segment_ids[b, j]``; ``positions``
    ``int32[B, S]`` replace ``0 … S-1`` in the position embeddings (GPT) or rotations
    (Llama). With both, each document's logits are those it gets run alone from position 0.
    Either may come without the other; neither (None) is the plain causal forward pass,
    traced exactly as it is without this feature.

    A mixture-of-experts model (``cfg.num_experts > 0``) returns ``(logits, sums)``: each
    layer's routing sums (``models/moe.py``) stacked ``[L, …]``, over the tokens weighted
    by ``route_weights`` ``[B, S]`` (the loss mask; None: every token).

    ``as_hidden``: ``(h, W)`` in place of the logits, the final hidden states after the
    last norm ``[B, S, d]`` and the head's ``[d, V]`` matrix (``h·W`` is the logits), for a
    loss that computes them a chunk at a time (``core/chunked_loss.py``)."""
    s, n = inputs.shape[1], self.cfg.n_layers
    if s > self.cfg.max_seq_len:
      raise BatchError(f"sequence length {s} exceeds model.max_seq_len {self.cfg.max_seq_len}")
    block_inputs = {}
    for name, value in (("segment_ids", segment_ids), ("positions", positions)):
      if value is not None:
        if value.shape != inputs.shape:
          raise BatchError(f"{name} has shape {value.shape}, the inputs {inputs.shape}")
        block_inputs[name] = value
    sparse = bool(getattr(self.cfg, "num_experts", 0))
    if sparse:
      block_inputs["route_weights"] = route_weights
    keys = jax.random.split(rng, n + 1) if rng is not None else None
    x = self.embed_inputs(inputs, jnp.arange(s) if positions is None else positions)
    x = self.dropout(x, deterministic=not train, rngs=None if keys is None else keys[0])
    x = layout.constrain_sequence(x)
    x = layers.walk(
      self.blocks,
      x,
      None if keys is None else keys[1:],
      scanned=self.cfg.scan_layers,
      remat=self.cfg.remat,
      train=train,
      inputs=block_inputs,
      sums=sparse,
    )
    out = self._hidden_and_head if as_hidden else self._logits
    if sparse:
      x, sums = x
      return out(x), sums
    return out(x)

  def block_list(self) -> list[nnx.Module]:
    """The ``n_layers`` blocks in order, one module each (a stacked layout's layer ``i``
    sliced out, ``layers.layer``): to walk them one at a time, as ``decode`` and
    ``hf_parity`` do."""
    if self.cfg.scan_layers:
      blocks = [layers.layer(self.blocks, i) for i in range(self.cfg.n_layers)]
    else:
      blocks = list(self.blocks)
    return [layers.dequantized(b) for b in blocks]

  def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> tuple:
    """An empty key/value cache for ``batch`` rows of ``length`` positions: per block the
    keys ``[batch, heads, head_dim, length]`` (transposed, so both attention dots read the
    cache as it lies) and values ``[batch, heads, length, head_dim]``, with ``heads`` and
    ``head_dim`` as the model's ``_cache_heads()`` says."""
    if length > self.cfg.max_seq_len:
      raise BatchError(f"cache length {length} exceeds model.max_seq_len {self.cfg.max_seq_len}")
    h, dh = self._cache_heads()
    return tuple(
      (jnp.zeros((batch, h, dh, length), dtype), jnp.zeros((batch, h, length, dh), dtype))
      for _ in range(self.cfg.n_layers)
    )

  def decode(
    self, inputs: jax.Array, positions: jax.Array, cache: tuple
  ) -> tuple[jax.Array, tuple]:
    """Logits ``[B, S, vocab]`` for ``inputs [B, S]`` at ``positions [B, S]`` (each row its
    own), attending to every cached position ``<=`` the query's; returns the cache with
    this call's keys and values written. Prefill is one call with the prompts (positions
    ``0 … S-1``), each decode step one call with ``S = 1``. No dropout. A position written
    here and later re-written (a shorter prompt's padding) is never seen before that: a
    query sees only positions up to its own."""
    x = self.embed_inputs(inputs, positions)
    new_cache = []
    for block, layer_cache in zip(self.block_list(), cache, strict=True):
      x, layer_cache = block.decode(x, layer_cache, positions)
      new_cache.append(layer_cache)
    return self._logits(x), tuple(new_cache)
