"""Whether a model splits over ``mesh.tensor`` the Megatron way, checked before anything is
built: query heads, the MLP's hidden width and the vocabulary must divide by the tensor size
(one ``error:`` line naming the numbers and the nearest sizes that work); key/value heads
fewer than (or not divisible by) it stay whole on every device, said in one line."""

from __future__ import annotations

import logging

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


def check(model, t: int) -> None:
  """Raises ``ConfigError`` for a dimension ``t`` cannot split; sets (``layout.split_rules``)
  and logs the kv-head fallback."""
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
  layout.split_rules(**({"kv_heads": None} if kv % t else {}))
  if kv % t:
    log.info(
      "mesh.tensor=%d: the %d key/value heads do not split over it; k/v projections stay "
      "whole on every device (the query heads split)",
      t,
      kv,
    )
