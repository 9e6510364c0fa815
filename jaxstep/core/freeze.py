"""Frozen parameters: which leaves of the params tree train, and the tree split in two.

A *trainable* predicate ``(name, leaf) -> bool`` sees each leaf's path as ``"a/b/0/c"``
(``core.trees.path_name``). The step differentiates, accumulates, clips and updates the
trainable part only: a frozen leaf has no optimizer state, no fp32 accumulator slot, no
share of the global gradient norm, no weight decay, and no update ever writes it (it stays
bitwise what it was, in whatever dtype it has).

The split keeps the tree's structure: ``partition`` gives two trees of the params' shape
where the other part's leaves are ``None`` (an empty subtree to ``jax.tree`` functions and
optax alike), and ``combine`` puts them back together.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxstep.core.trees import is_stored_weight, param_count, path_name
from jaxstep.errors import ConfigError

Trainable = Callable[[str, object], bool]


def by_patterns(patterns: Sequence[str]) -> Trainable:
  """The predicate "the leaf's name matches one of ``patterns``" (``re.search``); no
  patterns: every leaf trains."""
  compiled = [_compile(p) for p in patterns]
  if not compiled:
    return lambda name, leaf: True
  return lambda name, leaf: any(p.search(name) for p in compiled)


def _compile(pattern: str) -> re.Pattern:
  try:
    return re.compile(pattern)
  except re.error as e:
    raise ConfigError(f"optim.trainable: {pattern!r} is not a regular expression ({e})") from None


def mask(params, trainable: Trainable | None):
  """A tree of bools shaped like ``params``: True where the leaf trains."""
  if trainable is None:
    return jax.tree.map(lambda _: True, params)

  def one(path, x):  # a quantized weight is judged whole, by its own name
    train = bool(trainable(path_name(path), x))
    return jax.tree.map(lambda _: train, x) if is_stored_weight(x) else train

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_stored_weight)


def partition(params, trainable: Trainable | None):
  """``(train, frozen)``: two trees of ``params``' shape, the other part's leaves None."""
  m = mask(params, trainable)
  train = jax.tree.map(lambda x, t: x if t else None, params, m)
  frozen = jax.tree.map(lambda x, t: None if t else x, params, m)
  return train, frozen


def combine(train, frozen):
  """The params tree back from ``partition``'s two parts."""
  if frozen is None:
    return train
  return jax.tree.map(
    lambda t, f: f if t is None else t, train, frozen, is_leaf=lambda x: x is None
  )


def cast_frozen(params, trainable: Trainable | None, dtype, keep=lambda node: False):
  """``params`` with the frozen floating leaves cast to ``dtype`` (the trainable ones, the
  fp32 masters, unchanged); abstract leaves stay abstract. A node ``keep`` is true of (a
  quantized weight, whose scales keep their dtype) stays as it is."""
  if trainable is None:
    return params
  train, frozen = partition(params, trainable)

  def cast(x):
    if keep(x) or not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None))
    return x.astype(dtype)

  return combine(train, jax.tree.map(cast, frozen, is_leaf=keep))


def check_patterns(params, patterns: Sequence[str]) -> None:
  """``ConfigError`` for a pattern that matches no leaf (naming some leaves)."""
  names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  for pattern in patterns:
    if not any(_compile(pattern).search(n) for n in names):
      shown = ", ".join(names[:6]) + (", …" if len(names) > 6 else "")
      raise ConfigError(
        f"optim.trainable: {pattern!r} matches no parameter; the parameters are {shown}"
      )


def count(params, trainable: Trainable | None) -> tuple[int, int]:
  """``(trainable, frozen)`` parameter elements."""
  train, frozen = partition(params, trainable)
  return param_count(train), param_count(frozen)
