"""Loss functions in the step's contract: un-normalized sums, normalized by the step."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxstep.core import chunked_loss

# Batch fields a document-masked batch adds (``Windows.rows(..., document_mask=True)``),
# passed to the model as keyword arguments of the same names: ``segment_ids`` and
# ``positions``, both ``int32[B, S]``.
DOCUMENT_FIELDS = ("segment_ids", "positions")


def document_fields(batch) -> dict:
  """The ``DOCUMENT_FIELDS`` ``batch`` holds, by name (``{}`` for a plain batch): what a
  call of the model adds to ``apply_fn(params, batch["inputs"], …)`` so each document of a
  packed window attends to itself only and counts its positions from its start."""
  return {name: batch[name] for name in DOCUMENT_FIELDS if name in batch}


def next_token_loss(apply_fn: Callable, chunk: int | str = 0) -> Callable:
  """Wraps ``apply_fn(params, inputs, *, rng, train) -> logits`` into a step ``loss_fn``.

  The batch is ``{"inputs": int32[B, S], "targets": int32[B, S], "loss_mask": {0,1}[B, S]}``
  with targets already shifted; a document-masked batch also holds ``segment_ids`` and
  ``positions`` (``DOCUMENT_FIELDS``), which go to ``apply_fn`` as keyword arguments. A
  batch without them calls ``apply_fn`` exactly as before (same trace, same program), so
  an ``apply_fn`` that takes no such arguments keeps working on plain batches.

  The loss is the NLL *summed* over masked positions, in fp32 (logits are upcast before the
  softmax, whatever the compute dtype); the step divides by the global masked-token count.

  ``chunk`` (``model.loss_chunk``: ``auto``, a number of tokens, 0 = off): an ``apply_fn``
  that ``emits_hidden`` (the bundled models') is called with ``as_hidden=True`` for the
  final hidden states and the head's ``[d, V]`` matrix, and the loss is computed chunk by
  chunk over the tokens without the whole logits (``chunked_loss``); any other ``apply_fn``
  gives its logits as before.

  Returns:
    ``loss_fn(params, batch, rng) -> (nll_sum, {"correct": Σ mask·[argmax == target]})``.
  """

  def loss_fn(params, batch, rng):
    nll, correct = token_nll(apply_fn, params, batch, chunk=chunk, rng=rng, train=True)
    return nll, {"correct": correct}

  return loss_fn


def token_nll(apply_fn: Callable, params, batch, *, chunk: int | str = 0, rng=None, train=False):
  """``(Σ mask·NLL, Σ mask·[argmax == target])`` of ``batch`` under ``apply_fn`` (fp32),
  from the hidden states in chunks when ``chunk`` and the model allow (``next_token_loss``),
  else from the whole logits: the training loss's and the held-out evaluation's sums."""
  inputs, fields = batch["inputs"], document_fields(batch)
  if chunk != 0 and getattr(apply_fn, "emits_hidden", False):
    size = chunked_loss.chunk_size(chunk, inputs.size, apply_fn.vocab_size)
    if size:
      h, w = apply_fn(params, inputs, rng=rng, train=train, as_hidden=True, **fields)
      return chunked_loss.chunked_nll(h, w, batch["targets"], batch["loss_mask"], size)
  logits = apply_fn(params, inputs, rng=rng, train=train, **fields)
  nll, aux = masked_nll(logits, batch["targets"], batch["loss_mask"])
  return nll, aux["correct"]


def masked_nll(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array):
  """Σ mask·NLL in fp32 and the count of masked argmax hits. Shapes ``[B, S, V]``, ``[B, S]``."""
  logits = logits.astype(jnp.float32)
  mask = loss_mask.astype(jnp.float32)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = argmax_hits(logits, targets).astype(jnp.float32)
  return jnp.sum(nll * mask), {"correct": jnp.sum(correct * mask)}


def argmax_hits(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """``argmax(logits, -1) == targets`` for finite or infinite logits, without argmax.

  The first index holding the row max, found as a min over indices, is argmax's answer
  (ties go to the first). The row max is the softmax's own, so this adds one plain
  min-reduction, where XLA:CPU runs argmax's (value, index) reduction unvectorized
  (docs/performance.md). Shapes ``[..., V]``, ``[...]``.
  """
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  first_max = jnp.min(jnp.where(logits == row_max, index, logits.shape[-1]), axis=-1)
  return first_max == targets
