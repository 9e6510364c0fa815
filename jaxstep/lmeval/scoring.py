"""Log-likelihoods of token continuations, in batches of fixed shapes.

A request is ``(context ids, continuation ids)``; its row is the last ``max_length + 1``
ids of ``context + continuation`` (cut from the left, as lm-evaluation-harness's HF model
cuts them), fed as inputs ``row[:-1]`` against targets ``row[1:]``. The request's answer
is

    log p(continuation | context) = Σ_t log softmax(logits_t)[target_t]   (nats, fp32)

over the continuation's positions, and whether every one of its tokens is the argmax there
(the harness's ``is_greedy``). Only those two numbers per row leave the device, never the
``[rows, S, V]`` log-probs.

Rows are right-padded to a width bucket (the next multiple of ``WIDTH_STEP`` positions, at
most ``max_length``) and batches to ``rows`` rows, so that a handful of compiled shapes
serves a task (its requests' lengths fall in a few buckets) while a row pays for at most
``WIDTH_STEP − 1`` padded positions; a causal model never lets a padded position change an
earlier one. With several
local devices the rows are split over them (the params replicated), unless the params are
split over a tensor axis (``jaxstep evaluate --tensor``): they then stay split, and the
compiler partitions each batch's model work over their devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxstep.core import chunked_loss
from jaxstep.core.layout import TENSOR
from jaxstep.errors import ConfigError

WIDTH_STEP = 32


def tensor_split(params) -> bool:
  """Whether ``params`` lie split over a tensor axis (``core.layout``'s)."""
  shardings = (getattr(x, "sharding", None) for x in jax.tree.leaves(params))
  return any(isinstance(s, NamedSharding) and TENSOR in s.mesh.axis_names for s in shardings)


def width_bucket(length: int, max_length: int) -> int:
  """The compiled width a row of ``length`` inputs is padded to: the next multiple of
  ``WIDTH_STEP``, at most ``max_length``."""
  return min(-(-max(length, 1) // WIDTH_STEP) * WIDTH_STEP, max_length)


def request_row(context: Sequence[int], continuation: Sequence[int], max_length: int):
  """``(inputs, targets, scored)``: the request's row cut to ``max_length`` inputs from the
  left, and how many of its last targets are the continuation's."""
  whole = (list(context) + list(continuation))[-(max_length + 1) :]
  return whole[:-1], whole[1:], len(continuation)


class Scorer:
  """``score(requests)`` → ``[(log-likelihood, is_greedy)]`` for one model's params.

  Args:
    apply_fn: ``apply_fn(params, tokens [B, S]) -> logits [B, S, V]``.
    params: the model's params.
    rows: rows per compiled batch.
    max_length: the most input positions a row takes.
    pad_id: the id padded positions hold (never scored).
    chunk: ``model.loss_chunk``: with an ``apply_fn`` that ``emits_hidden``, the log-probs
      and greedy flags from the hidden states a chunk of tokens at a time
      (``core/chunked_loss.py``), never the whole ``[B, S, V]`` logits; 0: from the logits.
  """

  def __init__(self, apply_fn, params, *, rows: int, max_length: int, pad_id: int, chunk=0):
    devices = jax.local_devices()[: 1 if tensor_split(params) else None]
    self.rows = -(-rows // len(devices)) * len(devices)  # a whole number of rows per device
    self.max_length, self.pad_id = max_length, pad_id
    self._place = self._replicated = None
    if len(devices) > 1:
      mesh = jax.sharding.Mesh(np.asarray(devices), ("rows",))
      spec = jax.sharding.PartitionSpec
      self._replicated = jax.sharding.NamedSharding(mesh, spec())
      split = jax.sharding.NamedSharding(mesh, spec("rows"))
      self._place = lambda x: jax.device_put(x, split)
    self.set_params(params)

    hidden = chunk != 0 and getattr(apply_fn, "emits_hidden", False)

    def scores(params, inputs, targets, mask):  # [B, S] each; mask: the scored targets
      size = chunked_loss.chunk_size(chunk, inputs.size, apply_fn.vocab_size) if hidden else 0
      if size:
        h, w = apply_fn(params, inputs, as_hidden=True)
        picked, hits = chunked_loss.chunked_scores(h, w, targets, size)
      else:
        logits = apply_fn(params, inputs).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        hits = jnp.argmax(logits, axis=-1) == targets
      greedy = hits | (mask == 0)
      return jnp.sum(picked * mask, axis=-1), jnp.all(greedy, axis=-1)

    self._scores = jax.jit(scores)

  def set_params(self, params) -> None:
    """The params the next batches are scored with (on every device when there are several:
    a run's sharded params are gathered)."""
    if self._replicated is not None and params is not None:
      params = jax.device_put(params, self._replicated)
    self.params = params

  def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]):
    """One batch of at most ``rows`` requests → ``[(float, bool)]`` in their order."""
    assert 0 < len(requests) <= self.rows, (len(requests), self.rows)
    longest = max(len(continuation) for _, continuation in requests)
    if longest > self.max_length:
      raise ConfigError(
        f"a request's continuation is {longest} tokens, longer than the {self.max_length} "
        f"positions a request takes: raise max_length (at most the model's context)"
      )
    made = [request_row(c, t, self.max_length) for c, t in requests]
    width = width_bucket(max(len(inputs) for inputs, _, _ in made), self.max_length)
    inputs = np.full((self.rows, width), self.pad_id, np.int32)
    targets = np.full((self.rows, width), self.pad_id, np.int32)
    mask = np.zeros((self.rows, width), np.float32)
    for row, (ins, outs, scored) in enumerate(made):
      inputs[row, : len(ins)], targets[row, : len(outs)] = ins, outs
      mask[row, len(outs) - scored : len(outs)] = 1.0
    arrays = (inputs, targets, mask)
    if self._place is not None:
      arrays = tuple(map(self._place, arrays))
    sums, greedy = jax.device_get(self._scores(self.params, *arrays))
    return [(float(sums[r]), bool(greedy[r])) for r in range(len(requests))]
