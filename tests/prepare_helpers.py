"""Helpers the prepare tests share: a random small corpus and a split read back from its
shards."""

import numpy as np

from jaxstep.data.manifest import read_manifest


def stream(folder, split="train"):
  """A split's tokens (and flags, for chat) read back from its shard files."""
  manifest = read_manifest(folder)
  dtype, entry = np.dtype(manifest["dtype"]), manifest["splits"][split]
  tokens = np.concatenate([np.fromfile(folder / s["file"], dtype) for s in entry["shards"]])
  flags = (
    np.concatenate([np.fromfile(folder / s["file"], np.uint8) for s in entry["flags"]])
    if entry["flags"]
    else None
  )
  starts = np.fromfile(folder / entry["docs"]["file"], np.uint64)
  return tokens, flags, starts


def write_corpus(path, n=300, seed=0):
  rng = np.random.default_rng(seed)
  words = ["the", "cat", "sat", "on", "a", "mat", "Grüße", "naïve", "☕", "42"]
  docs = [" ".join(rng.choice(words, rng.integers(3, 30))) for _ in range(n)]
  path.write_text("\n\n".join(docs) + "\n")
  return docs
