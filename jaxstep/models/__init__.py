"""Models as ``(apply_fn, params)`` pairs: the step sees a plain params pytree.

``build`` makes the bundled GPT (``gpt.py``) or a Llama-family decoder (``llama.py``) from
its config (kernels per platform: ``backends.py``; the blocks as a list or a scanned
stack: ``layers.py``);
``from_nnx`` and ``from_linen`` adapt your own module into a ``Model`` (``adapters.py``);
Hugging Face model folders come in through ``hf_config.py`` + ``hf_weights.py`` and go out
through ``hf_export.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
from flax import nnx

from jaxstep.errors import ConfigError
from jaxstep.models import backends, lora
from jaxstep.models.adapters import Model, from_linen, from_nnx
from jaxstep.models.gpt import GPT, GPTConfig
from jaxstep.models.llama import Llama, LlamaConfig

__all__ = [
  "GPT",
  "FAMILIES",
  "Decoder",
  "GPTConfig",
  "Llama",
  "LlamaConfig",
  "Model",
  "build",
  "decoder",
  "family_of",
  "from_linen",
  "from_nnx",
  "num_params",
]


# ``model.family`` in a config: which model a model section builds
FAMILIES = {"gpt": GPTConfig, "llama": LlamaConfig}


def family_of(model_config: GPTConfig | LlamaConfig) -> str:
  """The ``model.family`` name of a model config."""
  return next(name for name, cls in FAMILIES.items() if isinstance(model_config, cls))


def _module(model_config: GPTConfig | LlamaConfig) -> type[GPT] | type[Llama]:
  """The module class a config builds."""
  return Llama if isinstance(model_config, LlamaConfig) else GPT


def build(
  model_config: GPTConfig | LlamaConfig, rng: jax.Array | int, *, abstract: bool = False
) -> tuple[Callable, dict]:
  """Builds the bundled GPT (or Llama, for a ``LlamaConfig``): ``(apply_fn, params)`` with
  ``apply_fn(params, inputs, *, rng=None, train=False, segment_ids=None, positions=None)
  -> logits``, params initialised from ``rng`` (``as_hidden=True``: ``(h, W)``, the final
  hidden states after the last norm and the head's ``[d, V]`` matrix, whose product is the
  logits: for a loss computed in chunks, ``emits_hidden`` says so); ``segment_ids`` and
  ``positions`` (``int32[B, S]``) are document masking (``DecoderStack.__call__``), None as
  before. A mixture-of-experts model also takes ``route_weights`` and, with ``with_routing=True``,
  returns ``(logits, routing sums)`` (``core/router_loss.py`` trains on them).
  Either model keeps no state besides its parameters, and takes its dropout key as
  ``rng``. ``abstract``: the params are ``jax.ShapeDtypeStruct`` leaves, nothing
  is initialised (to compile a model too large for this host)."""
  if model_config.vocab_size == 0:
    raise ConfigError("model.vocab_size 0 means 'the tokenizer's size': resolve it first")
  backends.check_attention(model_config.attention)
  make = lambda: _module(model_config)(model_config, rngs=nnx.Rngs(params=rng))  # noqa: E731
  model = from_nnx(nnx.eval_shape(make) if abstract else make())

  sparse = bool(getattr(model_config, "num_experts", 0))

  def apply_fn(
    params,
    inputs,
    *,
    rng=None,
    train=False,
    segment_ids=None,
    positions=None,
    route_weights=None,
    with_routing=False,
    as_hidden=False,
  ):
    fields = {"segment_ids": segment_ids, "positions": positions}
    if sparse:
      fields["route_weights"] = route_weights
    if as_hidden:
      fields["as_hidden"] = True
    out = model.apply_fn(params, inputs, rng=rng, train=train, **fields)[0]
    return out[0] if sparse and not with_routing else out

  # the chunked loss (core/chunked_loss.py) asks for (final hidden states, head [d, V]);
  # logits soft-capped after the head (Gemma 2) are computed whole
  apply_fn.emits_hidden, apply_fn.vocab_size = _emits_hidden(model_config), model_config.vocab_size
  params = model.params
  if model_config.lora.rank and not abstract:  # adapters from a stream of their own
    params = lora.initialised(params, lora.adapter_key(rng))
  return apply_fn, params


def _emits_hidden(model_config) -> bool:
  """Whether the model's logits are ``h · W`` (no soft-cap after the head)."""
  return not getattr(model_config, "final_logit_softcapping", 0.0)


class Decoder(NamedTuple):
  """The bundled GPT (or Llama) over a key/value cache, as pure functions of its params."""

  apply_fn: Callable  # (params, inputs [B, S]) -> logits: the full forward pass, no dropout
  decode_fn: Callable  # (params, inputs [B, S], positions [B, S], cache) -> (logits, cache)
  init_cache: Callable  # (batch, length, dtype) -> cache
  max_seq_len: int


def decoder(model_config: GPTConfig | LlamaConfig) -> Decoder:
  """``decode`` and ``init_cache`` of the config's model (``GPT`` or ``Llama``) for params
  shaped like ``build``'s (nothing is initialised: the module's structure comes from
  ``nnx.eval_shape``, 2 s for a 30-block model on a 2-core CPU, so one per config: a
  harness run's scorer and generator share it)."""
  try:
    hash(model_config)
  except TypeError:  # a field given as a list from Python: built each time
    return _decoder(model_config)
  return _cached_decoder(model_config)


@functools.lru_cache(maxsize=8)
def _cached_decoder(model_config) -> Decoder:
  return _decoder(model_config)


def _decoder(model_config) -> Decoder:
  abstract = nnx.eval_shape(lambda: _module(model_config)(model_config, rngs=nnx.Rngs(0)))
  graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
  rest = nnx.to_pure_dict(rest)

  def merged(params) -> GPT | Llama:
    return nnx.merge(graphdef, params, rest, copy=True)

  sparse = bool(getattr(model_config, "num_experts", 0))

  def apply_fn(params, inputs, *, segment_ids=None, positions=None, as_hidden=False):
    out = merged(params)(inputs, segment_ids=segment_ids, positions=positions, as_hidden=as_hidden)
    return out[0] if sparse else out

  apply_fn.emits_hidden, apply_fn.vocab_size = _emits_hidden(model_config), model_config.vocab_size

  def decode_fn(params, inputs, positions, cache):
    return merged(params).decode(inputs, positions, cache)

  def init_cache(batch, length, dtype=jax.numpy.float32):
    return abstract.init_cache(batch, length, dtype)

  return Decoder(apply_fn, decode_fn, init_cache, model_config.max_seq_len)


def num_params(params) -> int:
  """Total number of parameter elements (a quantized weight counts as the weight)."""
  from jaxstep.core.trees import param_count

  return param_count(params)
