"""Names of pytree leaves, written once: ``embed/embedding``-style strings from key paths."""

from __future__ import annotations

from collections.abc import Sequence


def key_name(key) -> str:
  """One key-path entry as text: a dict key, a sequence index or an attribute name."""
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path: Sequence) -> str:
  """A leaf's key path as ``"a/b/0/c"``."""
  return "/".join(key_name(k) for k in path)


def node_at(tree, path: Sequence):
  """The node of a nested-dict (or list) tree at a key path from ``jax.tree_util``."""
  for entry in path:
    tree = tree[getattr(entry, "key", getattr(entry, "idx", entry))]
  return tree
