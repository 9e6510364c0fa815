"""Cross-entropy from the final hidden states and the output head, chunk by chunk over the
tokens, so that the step never holds a ``[tokens × vocab]`` array.

The full-logits loss computes ``logits = h·W`` (``h`` ``[T, d]``, ``W`` ``[d, V]``), keeps
them (and their softmax) for the backward pass, and differentiates: two or three ``[T, V]``
fp32 arrays alive at once, the step's largest buffers on any real vocabulary (SmolLM2's
49,152 ids at 8 × 2,048 tokens: 3.2 GB each). Here the tokens are cut into chunks of ``C``
and a ``lax.scan`` walks them: each chunk's logits, its NLL sum and argmax hits, and, when
the loss is differentiated, its gradients at once (Liger's fused linear cross-entropy):
``g = (softmax − onehot)·mask``, ``dh_c = g·Wᵀ`` and ``dW += h_cᵀ·g``; then the chunk's
logits are dropped. The backward pass only scales ``dh`` and ``dW`` by the loss's cotangent
(a scalar), so nothing is computed twice: the same three products of the head's size as the
whole logits' forward and backward. Peak: ``[C, V]`` for ``[T, V]``, plus ``dW`` (the
head's size) and ``dh`` (``h``'s) held from the forward to the backward pass.

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
import optax

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


def chunk_size(setting, tokens: int, vocab: int) -> int:
  """Tokens per chunk for ``tokens`` positions over ``vocab`` ids (0: the whole logits).
  ``auto``: whole below ``AUTO_ABOVE`` logits (EasyDeL's 2^28), else chunks of
  ``AUTO_CHUNK`` logits (a multiple of 8 tokens, at least 8)."""
  if setting == "auto":
    if tokens * vocab < AUTO_ABOVE:
      return 0
    return max(8, AUTO_CHUNK // vocab // 8 * 8)
  return 0 if setting >= tokens else int(setting)


def chunked_nll(h: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array, chunk: int):
  """``(Σ mask·NLL, Σ mask·[argmax == target])`` of ``logits = h·W`` without them whole.

  ``h`` ``[..., d]`` (the final hidden states, after the last norm), ``w`` ``[d, V]``,
  ``targets`` and ``mask`` shaped like ``h`` without its last axis; ``chunk`` tokens per
  chunk (the last one padded with masked rows). The hits carry no gradient."""
  d = h.shape[-1]
  h, targets = h.reshape(-1, d), targets.reshape(-1)
  mask = mask.reshape(-1).astype(jnp.float32)
  pad = -h.shape[0] % chunk
  if pad:
    h = jnp.concatenate([h, jnp.zeros((pad, d), h.dtype)])
    targets = jnp.concatenate([targets, jnp.zeros((pad,), targets.dtype)])
    mask = jnp.concatenate([mask, jnp.zeros((pad,), mask.dtype)])
  nll, hits = _nll(h, w, targets, mask, chunk)
  return nll, jax.lax.stop_gradient(hits)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
  return x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:])


def _sums(h_c, w, t_c, m_c):
  """One chunk's logits (fp32), its ``Σ m·NLL`` and ``Σ m·hits``."""
  from jaxstep.core.losses import argmax_hits  # losses imports this module

  logits = jnp.matmul(h_c, w).astype(jnp.float32)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, t_c)
  hits = argmax_hits(logits, t_c).astype(jnp.float32)
  return logits, jnp.sum(nll * m_c), jnp.sum(hits * m_c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _nll(h, w, targets, mask, chunk: int):
  """The sums alone (no gradient asked: an evaluation)."""

  def one(acc, xs):
    _, nll, hits = _sums(xs[0], w, xs[1], xs[2])
    return (acc[0] + nll, acc[1] + hits), None

  zero = jnp.zeros((), jnp.float32)
  xs = (_chunks(h, chunk), _chunks(targets, chunk), _chunks(mask, chunk))
  return jax.lax.scan(one, (zero, zero), xs)[0]


def _nll_fwd(h, w, targets, mask, chunk: int):
  """The sums, and their gradients computed chunk by chunk on the way (Liger's fused
  linear cross-entropy): ``g = (softmax − onehot)·m`` of the chunk, ``dh_c = g·Wᵀ``,
  ``dW += h_cᵀ·g``; the chunk's logits are then dropped. Three products of the head's size,
  as the whole logits' forward and backward take, and nothing recomputed; one pass of
  ``exp`` over the logits serves the NLL and the softmax."""
  from jaxstep.core.losses import argmax_hits  # losses imports this module

  w_t = w.T  # [V, d], laid out once: each chunk's g·Wᵀ is then a plain product

  def one(carry, xs):
    nll_sum, hits_sum, dw = carry
    h_c, t_c, m_c = xs
    logits = jnp.matmul(h_c, w).astype(jnp.float32)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(logits - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    rows = jnp.arange(t_c.shape[0])
    nll = (jnp.log(total) + top)[:, 0] - logits[rows, t_c]
    hits = argmax_hits(logits, t_c).astype(jnp.float32)
    g = (e / total).at[rows, t_c].add(-1.0) * m_c[:, None]
    g = g.astype(h.dtype)
    dw = dw + jnp.matmul(h_c.T, g, preferred_element_type=jnp.float32)
    sums = (nll_sum + jnp.sum(nll * m_c), hits_sum + jnp.sum(hits * m_c), dw)
    return sums, jnp.matmul(g, w_t).astype(h.dtype)

  zero = jnp.zeros((), jnp.float32)
  init = (zero, zero, jnp.zeros(w.shape, jnp.float32))
  xs = (_chunks(h, chunk), _chunks(targets, chunk), _chunks(mask, chunk))
  (nll, hits, dw), dh = jax.lax.scan(one, init, xs)
  return (nll, hits), (dh.reshape(h.shape), dw.astype(w.dtype), targets, mask)


def _nll_bwd(chunk: int, residuals, cotangents):
  """The forward's gradients times the NLL sum's cotangent (a scalar; the hits have none)."""
  del chunk
  dh, dw, targets, mask = residuals
  g = cotangents[0]
  no_grad = np.zeros(targets.shape, jax.dtypes.float0)  # integer ids
  return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), no_grad, jnp.zeros_like(mask)


_nll.defvjp(_nll_fwd, _nll_bwd)


def chunked_logps(h: jax.Array, w: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
  """``log softmax(h·W)[target]`` per token (fp32, shaped like ``targets``), a chunk of
  ``chunk`` tokens at a time: for a loss that is not a plain sum of them (a preference
  loss, whose gradient scales each row's tokens by that row's cotangent). The forward pass
  keeps each token's log-sum-exp; the backward pass computes each chunk's logits again and
  ``g = (onehot − softmax)·c`` from the tokens' cotangents ``c``: one product of the head's
  size more than the whole logits, for a ``[C, V]`` peak."""
  d = h.shape[-1]
  flat_h, flat_t = h.reshape(-1, d), targets.reshape(-1)
  pad = -flat_h.shape[0] % chunk
  if pad:
    flat_h = jnp.concatenate([flat_h, jnp.zeros((pad, d), flat_h.dtype)])
    flat_t = jnp.concatenate([flat_t, jnp.zeros((pad,), flat_t.dtype)])
  out = _logps(flat_h, w, flat_t, chunk)
  return out[: targets.size].reshape(targets.shape)


def _lse_and_target(h_c, w, t_c):
  logits = jnp.matmul(h_c, w).astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  return logits, lse, logits[jnp.arange(t_c.shape[0]), t_c]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _logps(h, w, targets, chunk: int):
  return _logps_fwd(h, w, targets, chunk)[0]


def _logps_fwd(h, w, targets, chunk: int):
  def one(_, xs):
    _, lse, picked = _lse_and_target(xs[0], w, xs[1])
    return None, (picked - lse, lse)

  _, (logp, lse) = jax.lax.scan(one, None, (_chunks(h, chunk), _chunks(targets, chunk)))
  return logp.reshape(-1), (h, w, targets, lse)


def _logps_bwd(chunk: int, residuals, cotangent):
  h, w, targets, lse = residuals
  w_t = w.T

  def one(dw, xs):
    h_c, t_c, lse_c, c_c = xs
    logits = jnp.matmul(h_c, w).astype(jnp.float32)
    g = -jnp.exp(logits - lse_c[:, None])
    g = g.at[jnp.arange(t_c.shape[0]), t_c].add(1.0) * c_c[:, None]
    g = g.astype(h.dtype)
    dw = dw + jnp.matmul(h_c.T, g, preferred_element_type=jnp.float32)
    return dw, jnp.matmul(g, w_t).astype(h.dtype)

  xs = (_chunks(h, chunk), _chunks(targets, chunk), lse, _chunks(cotangent, chunk))
  dw, dh = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), xs)
  return dh.reshape(h.shape), dw.astype(w.dtype), np.zeros(targets.shape, jax.dtypes.float0)


_logps.defvjp(_logps_fwd, _logps_bwd)


def chunked_scores(h: jax.Array, w: jax.Array, targets: jax.Array, chunk: int):
  """``(log p(target), [argmax == target])`` per token (fp32 and bool, shaped like
  ``targets``), a chunk of tokens at a time, without gradient: what a log-likelihood scorer
  reads (``lmeval/scoring.py``); argmax's ties go to the first index, as ``jnp.argmax``."""
  from jaxstep.core.losses import argmax_hits  # losses imports this module

  d = h.shape[-1]
  flat_h, flat_t = h.reshape(-1, d), targets.reshape(-1)
  pad = -flat_h.shape[0] % chunk
  if pad:
    flat_h = jnp.concatenate([flat_h, jnp.zeros((pad, d), flat_h.dtype)])
    flat_t = jnp.concatenate([flat_t, jnp.zeros((pad,), flat_t.dtype)])

  def one(_, xs):
    logits, lse, picked = _lse_and_target(xs[0], w, xs[1])
    return None, (picked - lse, argmax_hits(logits, xs[1]))

  _, (logp, hits) = jax.lax.scan(one, None, (_chunks(flat_h, chunk), _chunks(flat_t, chunk)))
  n = targets.size
  return logp.reshape(-1)[:n].reshape(targets.shape), hits.reshape(-1)[:n].reshape(targets.shape)
