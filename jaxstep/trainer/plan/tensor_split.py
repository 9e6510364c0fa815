"""Whether a model splits over ``mesh.tensor`` the Megatron way, checked before anything is
built: query heads, the MLP's hidden width and the vocabulary must divide by the tensor size
(one ``error:`` line naming the numbers and the nearest sizes that work; a vocabulary that
follows the tokenizer, ``model.vocab_size`` 0, once the data has given it: ``check_vocab``),
never padded or replicated behind the user's back; key/value heads
fewer than (or not divisible by) it stay whole on every device, said in one line; with
``mesh.sequence_parallel`` the sequence length must divide too."""

from __future__ import annotations

import logging

import jax

from jaxstep.core import layout
from jaxstep.errors import ConfigError

log = logging.getLogger("jaxstep")


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def nearest(n: int, t: int) -> str:
  """The tensor sizes next to ``t`` that divide ``n``."""
  below = max(d for d in divisors(n) if d <= t)
  above = [d for d in divisors(n) if d > t]
  return f"{below}" + (f" or {above[0]}" if above else "")


def check(model, mesh, seq_len: int) -> None:
  """Raises ``ConfigError`` for a dimension ``mesh.tensor`` cannot split; sets the split
  rules (``layout.split_rules``): the kv-head fallback (logged) and sequence parallelism."""
  t = mesh.tensor
  if t == 1:
    if mesh.sequence_parallel:
      raise ConfigError("mesh.sequence_parallel needs a tensor axis: set mesh.tensor > 1")
    layout.split_rules()
    return
  if mesh.sequence_parallel and seq_len % t:
    raise ConfigError(
      f"mesh.sequence_parallel splits train.seq_len {seq_len} over mesh.tensor={t}: use a "
      f"seq_len that {t} divides, or mesh.tensor={nearest(seq_len, t)}"
    )
  local = jax.local_device_count()
  if t > local:
    log.warning(
      "mesh.tensor=%d spans hosts (%d devices each): every layer's collectives cross the "
      "network; keep mesh.tensor within a host and use data/fsdp across hosts",
      t,
      local,
    )
  kv = getattr(model, "resolved_kv_heads", model.n_heads)
  dims = (
    ("model.n_heads", model.n_heads, "query heads"),
    ("the MLP's hidden width", model.mlp_hidden, "MLP units"),
    ("model.vocab_size", model.vocab_size, "vocabulary rows"),
  )
  for name, n, what in dims:
    if n % t:
      raise ConfigError(
        f"mesh.tensor={t} does not divide {name} {n} ({what} split over the tensor axis); "
        f"use mesh.tensor={nearest(n, t)}"
      )
  layout.split_rules(
    **({"kv_heads": None} if kv % t else {}),
    seq=layout.TENSOR if mesh.sequence_parallel else None,
  )
  if kv % t:
    log.info(
      "mesh.tensor=%d: the %d key/value heads do not split over it; k/v projections stay "
      "whole on every device (the query heads split)",
      t,
      kv,
    )


def check_vocab(vocab_size: int, tensor: int, tokenizer_size: int) -> None:
  """Raises ``ConfigError`` when ``mesh.tensor`` does not divide ``model.vocab_size`` as the
  tokenizer's ``tokenizer_size`` ids resolved it (``model.vocab_size`` 0: the mesh was
  checked before the data was read, against a vocabulary of 0). Names the tensor sizes that
  divide it and the smallest ``model.vocab_size`` that ``tensor`` divides and holds every id."""
  if tensor == 1 or vocab_size % tensor == 0:
    return
  fits = -(-tokenizer_size // tensor) * tensor
  raise ConfigError(
    f"mesh.tensor={tensor} does not divide model.vocab_size {vocab_size} (the tokenizer's "
    f"{tokenizer_size} ids, padded; vocabulary rows split over the tensor axis); use "
    f"mesh.tensor={nearest(vocab_size, tensor)}, or set model.vocab_size={fits}"
  )
