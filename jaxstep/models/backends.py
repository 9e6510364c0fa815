"""Which kernels the bundled GPT runs on which platform: the one place that decides.

Attention (``model.attention``):

- ``blocked``: ``cpu_kernels.causal_attention``, query blocks that skip the fully masked
  scores and a hand-written backward whose dots suit XLA:CPU. It keeps the fp32
  probabilities (``B·H·S²·4`` bytes per layer, roughly halved by the skipped blocks) as
  backward residuals: right for CPU, wasteful on a GPU.
- ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``, plain XLA (any
  platform, any dtype); autodiff's backward.
- ``cudnn``: the same call with ``implementation="cudnn"``: cuDNN's fused flash attention
  (CUDA GPUs, bf16/fp16, head dim a multiple of 8 up to 128), which never materializes
  the S×S probabilities.
- ``auto``: ``blocked`` on CPU; on a GPU ``cudnn`` where it supports the dtype and head
  dim, else ``xla`` (logged once per reason); ``xla`` on any other platform.

Document masking (``segment_ids``, ``docs/data.md``): query ``i`` also needs key ``j`` in
its own document. ``blocked`` tests it inside its blocks
(``cpu_kernels.segment_causal_attention``, same backward); ``xla`` takes it as the boolean
``mask`` of ``jax.nn.dot_product_attention``, joined there with the causal one. ``cudnn``
runs ``xla`` instead, logged once (``CUDNN_SEGMENT_PROBLEM`` says why). Without segment ids
every kernel runs exactly the program it runs without this feature.

The CPU-only backward tricks (``dense_dot_general`` for every projection, the closed-form
``LayerNorm`` backward) are used when the platform is CPU and nowhere else: on
accelerators autodiff's backward is already what the hardware wants. Either way the
parameters and the math are the same, so a checkpoint moves freely between platforms.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from jaxstep.errors import ConfigError
from jaxstep.models import cpu_kernels

ATTENTION_BACKENDS = ("auto", "blocked", "xla", "cudnn")
CUDNN_MAX_HEAD_DIM = 128
# Why a document-masked batch does not run on cuDNN. The public API's cuDNN path has no
# segment mask: it takes a boolean mask only by turning it into an additive bias [B, 1, S, S]
# in the compute dtype, whose gradient it then always computes (a dbias that size per layer,
# thrown away). Earlier jax releases refused that gradient for a bias with a batch over 1 or
# fewer heads than the query (cuDNN's limit then); this one no longer checks, and no GPU has
# shown it to work. cuDNN's packed-segment layout (per-sequence offsets) is not public API.
CUDNN_SEGMENT_PROBLEM = (
  "jax.nn.dot_product_attention's cuDNN path has no segment mask, only a dense [B, 1, S, S] "
  "additive bias whose gradient cuDNN is not known to support for a batch over 1"
)

log = logging.getLogger("jaxstep")
_logged: set[str] = set()


def platform() -> str:
  """The platform arrays are computed on (``"cpu"``, ``"gpu"``, ``"tpu"``): what every
  choice in this module follows. Tests replace it to see the GPU choices on CPU."""
  return jax.default_backend()


def use_cpu_kernels() -> bool:
  """Whether projections and LayerNorm use the backward passes written for XLA:CPU."""
  return platform() == "cpu"


def cudnn_problem(dtype, head_dim: int) -> str | None:
  """Why cuDNN's fused attention cannot take these inputs, or None if it can."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN attention needs bf16 or fp16 inputs, these are {jnp.dtype(dtype).name}"
  if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
    return (
      f"cuDNN attention needs a head dim that is a multiple of 8 up to "
      f"{CUDNN_MAX_HEAD_DIM}, this one is {head_dim}"
    )
  return None


def check_attention(choice: str) -> None:
  """Raises ConfigError if ``model.attention`` cannot run on this platform at all."""
  if choice not in ATTENTION_BACKENDS:
    raise ConfigError(
      f"model.attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {choice!r}"
    )
  if choice == "cudnn" and platform() != "gpu":
    raise ConfigError(
      f"model.attention=cudnn needs a CUDA GPU, this run is on {platform()}; use auto or xla"
    )


def resolve_attention(choice: str, dtype, head_dim: int) -> str:
  """The kernel ``choice`` means for inputs of ``dtype`` with ``head_dim`` on this
  platform: ``blocked``, ``xla`` or ``cudnn`` (see the module docstring)."""
  check_attention(choice)
  if choice != "auto":
    if choice == "cudnn" and (problem := cudnn_problem(dtype, head_dim)):
      raise ConfigError(f"model.attention=cudnn: {problem}; use auto or xla")
    return choice
  where = platform()
  if where == "cpu":
    return "blocked"
  if where != "gpu":
    return "xla"
  if problem := cudnn_problem(dtype, head_dim):
    if problem not in _logged:
      _logged.add(problem)
      log.warning("model.attention=auto uses xla, not cudnn: %s", problem)
    return "xla"
  return "cudnn"


def causal_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  choice: str,
  segment_ids: jax.Array | None = None,
  window: int = 0,
  cap: float = 0.0,
) -> jax.Array:
  """Causal softmax attention ``q [B, S, H, Dh]``, ``k``, ``v [B, S, KV, Dh]`` →
  ``[B, S, H, Dh]`` with the kernel ``choice`` resolves to; ``KV`` divides ``H`` and query
  head ``h`` reads key/value head ``h // (H / KV)`` (every kernel takes the grouped heads
  as they are: none repeats them). Scores and softmax are fp32 in every kernel.

  ``segment_ids`` (``int32[B, S]``, or None): document masking, query ``i`` sees key ``j``
  only if ``j ≤ i`` and both are in the same segment. None traces the plain causal kernel,
  exactly as before. ``window`` > 0: sliding-window attention, query ``i`` sees keys
  ``i − window < j ≤ i`` (transformers' ``sliding_window``), on every kernel
  (``jax.nn.dot_product_attention``'s ``local_window_size``). ``cap`` > 0: Gemma 2's
  soft-capped scores, ``cap · tanh(s / cap)``: the blocked kernel's own, else plain XLA
  (``softcapped_attention``; neither ``jax.nn.dot_product_attention`` nor cuDNN caps)."""
  kernel = resolve_attention(choice, q.dtype, q.shape[-1])
  if cap and kernel != "blocked":
    return softcapped_attention(q, k, v, segment_ids, window, cap)
  if segment_ids is not None:
    return _segment_attention(q, k, v, kernel, segment_ids, window, cap)
  if kernel == "blocked":
    return cpu_kernels.causal_attention(q, k, v, window, cap)
  return jax.nn.dot_product_attention(
    q, k, v, is_causal=True, implementation=kernel, local_window_size=_local(window)
  )


def _local(window: int) -> tuple[int, int] | None:
  """``local_window_size`` for a window of ``window`` keys, the query's own included."""
  return (window - 1, 0) if window else None


def softcapped_attention(q, k, v, segment_ids, window: int, cap: float) -> jax.Array:
  """Causal attention with soft-capped scores in plain XLA (autodiff's backward): the
  grouped query heads against their key/value head, scores and softmax in fp32, masked
  causally, to the window and to the documents as the other kernels mask."""
  b, s, h, dh = q.shape
  kv = k.shape[2]
  qg = q.reshape(b, s, kv, h // kv, dh)
  scores = jnp.einsum("bqngd,bknd->bngqk", qg, k).astype(jnp.float32) / math.sqrt(dh)
  scores = cap * jnp.tanh(scores / cap)
  rows, keys = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
  allowed = (keys <= rows) & ((keys > rows - window) if window else True)
  allowed = allowed[None, None, None]
  if segment_ids is not None:
    allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
  p = jax.nn.softmax(jnp.where(allowed, scores, jnp.finfo(jnp.float32).min), axis=-1)
  out = jnp.einsum("bngqk,bknd->bqngd", p.astype(v.dtype), v)
  return out.reshape(b, s, h, dh)


def _segment_attention(q, k, v, kernel: str, segment_ids, window: int, cap: float):
  """``causal_attention`` within the segments of ``segment_ids`` on ``kernel``."""
  if kernel == "blocked":
    return cpu_kernels.segment_causal_attention(q, k, v, segment_ids, window, cap)
  if kernel == "cudnn":
    if CUDNN_SEGMENT_PROBLEM not in _logged:
      _logged.add(CUDNN_SEGMENT_PROBLEM)
      log.warning("document-masked batches use xla, not cudnn: %s", CUDNN_SEGMENT_PROBLEM)
    kernel = "xla"
  same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, S, S], broadcast over heads
  return jax.nn.dot_product_attention(
    q, k, v, mask=same[:, None], is_causal=True, implementation=kernel,
    local_window_size=_local(window),
  )  # fmt: skip
