"""Names of pytree leaves, written once: ``embed/embedding``-style strings from key paths."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax


def key_name(key) -> str:
  """One key-path entry as text: a dict key, a sequence index or an attribute name."""
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def is_stored_weight(x) -> bool:
  """A quantized weight (``models/quant.py``): one parameter tensor stored in parts."""
  return getattr(x, "codes", None) is not None


def param_count(tree) -> int:
  """Parameter elements in ``tree``, a quantized weight counted as the weight it stands for
  (not its codes and scales)."""
  leaves = jax.tree.leaves(tree, is_leaf=is_stored_weight)
  return sum(int(math.prod(x.shape)) for x in leaves)


def path_name(path: Sequence) -> str:
  """A leaf's key path as ``"a/b/0/c"``."""
  return "/".join(key_name(k) for k in path)


def node_at(tree, path: Sequence):
  """The node of a nested-dict (or list) tree at a key path from ``jax.tree_util``."""
  for entry in path:
    tree = tree[getattr(entry, "key", getattr(entry, "idx", entry))]
  return tree
