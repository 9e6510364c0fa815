"""Cross-entropy from the final hidden states and the output head, chunk by chunk over the
tokens, so that the step never holds a ``[tokens × vocab]`` array.

The full-logits loss computes ``logits = h·W`` (``h`` ``[B, S, d]``, ``W`` ``[d, V]``),
keeps them (and their softmax) for the backward pass, and differentiates: two or three
``[B, S, V]`` fp32 arrays alive at once, the step's largest buffers on any real vocabulary
(SmolLM2's 49,152 ids at 8 × 2,048 tokens: 3.2 GB each). Here the positions are cut into
chunks of ``P``, every row of the batch in each (a chunk holds ``C = B·P`` tokens, and a
batch split over devices stays split), and a ``lax.scan`` walks them: each chunk's
logits, its NLL sum and argmax hits, and, when the loss is differentiated, its gradients
at once (Liger's fused linear cross-entropy):
``g = (softmax − onehot)·mask``, ``dh_c = g·Wᵀ`` and ``dW += h_cᵀ·g``; then the chunk's
logits are dropped. The backward pass only scales ``dh`` and ``dW`` by the loss's cotangent
(a scalar), so nothing is computed twice: the same three products of the head's size as the
whole logits' forward and backward. Peak: ``[B, P, V]`` for ``[B, S, V]``, plus ``dW``
(the head's size) and ``dh`` (``h``'s), kept in fp32 from the forward to the backward pass
(the loss scale of fp16 training multiplies them there, so they must not underflow first).

The sums are the full-logits loss's to float rounding (the same products, summed in
another order): ``Σ mask·NLL`` in fp32 from logits upcast after the head's product, and
``Σ mask·[argmax == target]``. Chunking over the tokens (not the vocabulary) keeps each
row's softmax in one piece: no running logsumexp, and a vocabulary split over the tensor
axis stays split (the compiler reduces each chunk's logsumexp across it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.errors import ConfigError

AUTO_ABOVE = 2**28  # auto chunks when one micro-step's logits pass this many elements
AUTO_CHUNK = 2**24  # … into chunks of about this many logits (64 MiB in fp32)


def check_setting(value, key: str = "model.loss_chunk") -> None:
  """``ConfigError`` unless ``value`` is ``auto`` or an integer >= 0."""
  if value == "auto":
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ConfigError(
      f"{key} must be auto, 0 (off: the whole logits) or a number of tokens per chunk > 0, "
      f"got {value!r}"
    )


def like(wrapper, model):
  """``wrapper`` (a function calling ``model``, an ``apply_fn``) marked as ``model`` is for
  the chunked path (``emits_hidden``, ``vocab_size``), so wrapping a model does not turn
  chunking off; returns ``wrapper``."""
  for name in ("emits_hidden", "vocab_size"):
    if hasattr(model, name):
      setattr(wrapper, name, getattr(model, name))
  return wrapper


def chunk_size(setting, tokens: int, vocab: int) -> int:
  """Tokens per chunk for ``tokens`` positions over ``vocab`` ids (0: the whole logits).
  ``auto``: whole below ``AUTO_ABOVE`` logits (EasyDeL's 2^28), else chunks of
  ``AUTO_CHUNK`` logits (a multiple of 8 tokens, at least 8)."""
  if setting == "auto":
    if tokens * vocab < AUTO_ABOVE:
      return 0
    return max(8, AUTO_CHUNK // vocab // 8 * 8)
  return 0 if setting >= tokens else int(setting)


def _rows(x: jax.Array, tail: int) -> jax.Array:
  """``x`` ``[..., S, *tail]`` as ``[B, S, *tail]`` (the leading axes as rows; none: 1)."""
  lead = x.shape[: x.ndim - 1 - tail]
  return x.reshape(int(np.prod(lead, dtype=int)), *x.shape[len(lead) :])


def _split(x: jax.Array, positions: int) -> jax.Array:
  """``[B, S, …]`` → ``[n, B, P, …]``: chunks of ``P`` positions (the last padded with
  zeros), every row in each."""
  pad = -x.shape[1] % positions
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  b, n = x.shape[0], x.shape[1] // positions
  return jnp.moveaxis(x.reshape(b, n, positions, *x.shape[2:]), 1, 0)


def _join(x: jax.Array, like: jax.Array) -> jax.Array:
  """``_split``'s inverse: ``[n, B, P, …]`` → ``like``'s shape (``[..., S]``) plus ``…``."""
  b, tail = x.shape[1], x.shape[3:]
  whole = jnp.moveaxis(x, 0, 1).reshape(b, -1, *tail)[:, : like.shape[-1]]
  return whole.reshape(*like.shape, *tail)


def _chunks(h, chunk: int, *per_token):
  """``h`` and the per-token arrays ``per_token`` (shaped like ``h`` without its last axis)
  split into chunks of ``chunk`` tokens: ``max(1, chunk // B)`` positions of all ``B`` rows."""
  rows = _rows(h, 1)
  positions = max(1, chunk // rows.shape[0])
  return _split(rows, positions), *(_split(_rows(x, 0), positions) for x in per_token)


def _logits(h_c: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.matmul(h_c, w).astype(jnp.float32)


def _picked(logits: jax.Array, t_c: jax.Array) -> jax.Array:
  return jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]


def _sums(h_c, w, t_c, m_c):
  """One chunk's logits (fp32), its ``Σ m·NLL`` and ``Σ m·hits``."""
  from jaxstep.core.losses import argmax_hits  # losses imports this module

  logits = _logits(h_c, w)
  nll = jax.nn.logsumexp(logits, axis=-1) - _picked(logits, t_c)
  hits = argmax_hits(logits, t_c).astype(jnp.float32)
  return logits, jnp.sum(nll * m_c), jnp.sum(hits * m_c)


def chunked_nll(h: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array, chunk: int):
  """``(Σ mask·NLL, Σ mask·[argmax == target])`` of ``logits = h·W`` without them whole.

  ``h`` ``[..., S, d]`` (the final hidden states, after the last norm), ``w`` ``[d, V]``,
  ``targets`` and ``mask`` shaped like ``h`` without its last axis; ``chunk`` tokens per
  chunk (padded positions are masked). The hits carry no gradient."""
  nll, hits = _nll(h, w, targets, mask.astype(jnp.float32), chunk)
  return nll, jax.lax.stop_gradient(hits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _nll(h, w, targets, mask, chunk: int):
  """The sums alone (no gradient asked: an evaluation)."""

  def one(acc, xs):
    _, nll, hits = _sums(xs[0], w, xs[1], xs[2])
    return (acc[0] + nll, acc[1] + hits), None

  zero = jnp.zeros((), jnp.float32)
  return jax.lax.scan(one, (zero, zero), _chunks(h, chunk, targets, mask))[0]


def _grad_dtype(h: jax.Array):
  """What a chunk's logit gradient is multiplied in: the compute dtype, fp32 under fp16
  (its small softmax terms would underflow before the loss scale reaches them)."""
  return jnp.float32 if h.dtype == jnp.float16 else h.dtype


def _nll_fwd(h, w, targets, mask, chunk: int):
  """The sums, and their gradients computed chunk by chunk on the way (Liger's fused
  linear cross-entropy): ``g = (softmax − onehot)·m`` of the chunk, ``dh_c = g·Wᵀ``,
  ``dW += h_cᵀ·g``; the chunk's logits are then dropped. Three products of the head's size,
  as the whole logits' forward and backward take, and nothing recomputed; one pass of
  ``exp`` over the logits serves the NLL and the softmax."""
  from jaxstep.core.losses import argmax_hits  # losses imports this module

  w_t, dtype = w.T, _grad_dtype(h)  # [V, d], laid out once: g·Wᵀ is a plain product

  def one(carry, xs):
    nll_sum, hits_sum, dw = carry
    h_c, t_c, m_c = xs
    logits = _logits(h_c, w)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(logits - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    nll = (jnp.log(total) + top)[..., 0] - _picked(logits, t_c)
    hits = argmax_hits(logits, t_c).astype(jnp.float32)
    target = jnp.arange(logits.shape[-1]) == t_c[..., None]
    g = (jnp.where(target, e / total - 1.0, e / total) * m_c[..., None]).astype(dtype)
    h2, g2 = h_c.reshape(-1, h_c.shape[-1]).astype(dtype), g.reshape(-1, g.shape[-1])
    dw = dw + jnp.matmul(h2.T, g2, preferred_element_type=jnp.float32)
    dh = jnp.matmul(g, w_t.astype(dtype), preferred_element_type=jnp.float32)
    return (nll_sum + jnp.sum(nll * m_c), hits_sum + jnp.sum(hits * m_c), dw), dh

  zero = jnp.zeros((), jnp.float32)
  init = (zero, zero, jnp.zeros(w.shape, jnp.float32))
  (nll, hits, dw), dh = jax.lax.scan(one, init, _chunks(h, chunk, targets, mask))
  dtypes = (jnp.zeros((0,), h.dtype), jnp.zeros((0,), w.dtype))  # what the gradients become
  return (nll, hits), (_join(dh, h[..., 0]), dw, targets, mask, dtypes)


def _nll_bwd(chunk: int, residuals, cotangents):
  """The forward's gradients times the NLL sum's cotangent (a scalar; the hits have none),
  cast to the inputs' dtypes only then."""
  del chunk
  dh, dw, targets, mask, (h_like, w_like) = residuals
  g = cotangents[0]
  no_grad = np.zeros(targets.shape, jax.dtypes.float0)  # integer ids
  return (g * dh).astype(h_like.dtype), (g * dw).astype(w_like.dtype), no_grad, jnp.zeros_like(mask)


_nll.defvjp(_nll_fwd, _nll_bwd)


def chunked_logps(h: jax.Array, w: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
  """``log softmax(h·W)[target]`` per token (fp32, shaped like ``targets``), a chunk of
  ``chunk`` tokens at a time: for a loss that is not a plain sum of them (a preference
  loss, whose gradient scales each row's tokens by that row's cotangent). The forward pass
  keeps each token's log-sum-exp; the backward pass computes each chunk's logits again and
  ``g = (onehot − softmax)·c`` from the tokens' cotangents ``c``: one product of the head's
  size more than the whole logits, for a ``[B, P, V]`` peak."""
  return _logps(h, w, targets, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _logps(h, w, targets, chunk: int):
  return _logps_fwd(h, w, targets, chunk)[0]


def _logps_fwd(h, w, targets, chunk: int):
  def one(_, xs):
    logits = _logits(xs[0], w)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return None, (_picked(logits, xs[1]) - lse, lse)

  _, (logp, lse) = jax.lax.scan(one, None, _chunks(h, chunk, targets))
  return _join(logp, targets), (h, w, targets, lse)


def _logps_bwd(chunk: int, residuals, cotangent):
  h, w, targets, lse = residuals
  w_t, dtype = w.T, _grad_dtype(h)

  def one(dw, xs):
    h_c, t_c, lse_c, c_c = xs
    logits = _logits(h_c, w)
    p = jnp.exp(logits - lse_c[..., None])
    target = jnp.arange(logits.shape[-1]) == t_c[..., None]
    g = (jnp.where(target, 1.0 - p, -p) * c_c[..., None]).astype(dtype)
    h2, g2 = h_c.reshape(-1, h_c.shape[-1]).astype(dtype), g.reshape(-1, g.shape[-1])
    dw = dw + jnp.matmul(h2.T, g2, preferred_element_type=jnp.float32)
    return dw, jnp.matmul(g, w_t.astype(dtype), preferred_element_type=jnp.float32)

  h_s, t_s, c_s = _chunks(h, chunk, targets, cotangent)
  dw, dh = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), (h_s, t_s, lse, c_s))
  dh = _join(dh, h[..., 0]).astype(h.dtype)
  return dh, dw.astype(w.dtype), np.zeros(targets.shape, jax.dtypes.float0)


_logps.defvjp(_logps_fwd, _logps_bwd)


def chunked_scores(h: jax.Array, w: jax.Array, targets: jax.Array, chunk: int):
  """``(log p(target), [argmax == target])`` per token (fp32 and bool, shaped like
  ``targets``), a chunk of tokens at a time, without gradient: what a log-likelihood scorer
  reads (``lmeval/scoring.py``); argmax's ties go to the first index, as ``jnp.argmax``."""
  from jaxstep.core.losses import argmax_hits  # losses imports this module

  def one(_, xs):
    logits = _logits(xs[0], w)
    logp = _picked(logits, xs[1]) - jax.nn.logsumexp(logits, axis=-1)
    return None, (logp, argmax_hits(logits, xs[1]))

  _, (logp, hits) = jax.lax.scan(one, None, _chunks(h, chunk, targets))
  return _join(logp, targets), _join(hits, targets)


def chunked_map(fn, h: jax.Array, w: jax.Array, targets: jax.Array, chunk: int):
  """``fn(logits [B, P, V], targets [B, P]) -> tuple of [B, P] arrays`` over the positions
  a chunk at a time, the results shaped like ``targets``: for per-token terms with more
  arithmetic than a log-softmax (RL's sampler transforms: temperature, top-k / top-p,
  allowed ids, the entropy). The chunk body is under ``jax.checkpoint``: the backward pass
  computes each chunk's logits and ``fn`` again, one chunk at a time, and autodiff
  differentiates ``fn`` as it does on the whole logits."""

  @jax.checkpoint
  def one(_, xs):
    return None, fn(_logits(xs[0], w), xs[1])

  _, out = jax.lax.scan(one, None, _chunks(h, chunk, targets))
  return tuple(_join(x, targets) for x in out)


def chunked_pair_map(fn, student: tuple, teacher: tuple, targets: jax.Array, chunk: int):
  """``chunked_map`` for a student and a frozen teacher over the same tokens: ``student``
  and ``teacher`` are ``(h, W)`` pairs (their final hidden states, widths may differ, and
  heads of the same vocabulary), ``fn(logits, teacher_logits, targets) -> tuple of [B, P]
  arrays`` a chunk at a time. Neither model's ``[B, S, V]`` logits exist whole; the
  backward pass computes each chunk's logits of both again (the teacher's carry no
  gradient)."""
  (h, w), (h_t, w_t) = student, teacher

  @jax.checkpoint
  def one(_, xs):
    h_c, ht_c, t_c = xs
    frozen = jax.lax.stop_gradient(_logits(ht_c, w_t))
    return None, fn(_logits(h_c, w), frozen, t_c)

  h_s, t_s = _chunks(h, chunk, targets)
  (ht_s,) = _chunks(h_t, chunk)
  _, out = jax.lax.scan(one, None, (h_s, ht_s, t_s))
  return tuple(_join(x, targets) for x in out)
