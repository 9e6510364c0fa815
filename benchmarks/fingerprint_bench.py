"""The cost of the base-weights fingerprint (``hf_weights.FingerprintDigest``): the xxh3-128
of every byte, hashed as ``load_pretrained`` reads the weights, as a share of the load.

``python -m benchmarks.fingerprint_bench [--rounds 5] [--quick]``: ``hf_load``'s ~124 M-
parameter fp32 Llama folder (~500 MB; built once with ``transformers`` under the temporary
folder), loaded in this process as ``hf_load.load_jax`` does (fp32 params, each tensor
``jax.device_put``, then ``block_until_ready``) with the hashing and without it (its
``new_hasher`` replaced by one that does nothing), interleaved round after round (the order
alternating), after one warm-up load of each (the folder in the page cache). Prints JSON:
each round's seconds, the median ratio with/without, and xxh3's own speed on the bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import numpy as np

from jaxstep.models import hf_weights

_XXH3 = hf_weights.new_hasher  # the fingerprint's hasher, before a round replaces it


class _NoHash:
  """A hasher that hashes nothing: the load without the fingerprint's cost."""

  def update(self, _data) -> None:
    pass

  def digest(self) -> bytes:
    return b""

  def hexdigest(self) -> str:
    return ""


class _TimedHash:
  """xxh3-128 (``hf_weights.new_hasher``'s) that adds the seconds its updates take to
  ``spent``: the hashing's own time inside a load."""

  spent = 0.0

  def __init__(self):
    self._hasher = _XXH3()

  def update(self, data) -> None:
    t = time.perf_counter()
    self._hasher.update(data)
    _TimedHash.spent += time.perf_counter() - t

  def digest(self) -> bytes:
    return self._hasher.digest()

  def hexdigest(self) -> str:
    return self._hasher.hexdigest()


def _load(path: str, hashing: bool) -> tuple[float, float]:
  """``(seconds, of which hashing)`` of one ``load_pretrained`` of ``path``."""
  import jax

  from jaxstep.models.pretrained import load_pretrained

  _TimedHash.spent = 0.0
  with mock.patch.object(hf_weights, "new_hasher", _TimedHash if hashing else _NoHash):
    t = time.perf_counter()
    loaded = load_pretrained(path, dtype=np.float32, place=lambda _, a: jax.device_put(a))
    jax.block_until_ready(loaded.params)
    seconds = time.perf_counter() - t
  return seconds, _TimedHash.spent


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--quick", action="store_true", help="hf_load's ~2 M-parameter folder")
  args = parser.parse_args(argv)
  import xxhash

  from benchmarks import hf_load

  info = hf_load.make_folder(hf_load.QUICK_FOLDER if args.quick else hf_load.FOLDER)
  path = info["path"]
  nbytes = sum(v for k, v in info["files_bytes"].items() if k.endswith(".safetensors"))
  _load(path, True), _load(path, False)  # warm-up: the page cache, the backend
  with_s, without_s, hashing_s = [], [], []
  for r in range(args.rounds):
    for hashing in (True, False) if r % 2 == 0 else (False, True):
      seconds, spent = _load(path, hashing)
      (with_s if hashing else without_s).append(seconds)
      if hashing:
        hashing_s.append(spent)
  ratios = [a / b for a, b in zip(with_s, without_s, strict=True)]
  inside = [h / (s - h) for h, s in zip(hashing_s, with_s, strict=True)]
  data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
  t = time.perf_counter()
  xxhash.xxh3_128(data).digest()
  hash_s = time.perf_counter() - t
  result = {
    "folder": path,
    "params": info["params"],
    "weight_bytes": nbytes,
    "with_hash_s": [round(s, 3) for s in with_s],
    "without_hash_s": [round(s, 3) for s in without_s],
    "hashing_in_load_s": [round(s, 4) for s in hashing_s],
    "median_ratio": round(statistics.median(ratios), 4),
    "hash_share": round(statistics.median(ratios) - 1, 4),
    "hashing_share_timed": round(statistics.median(inside), 4),
    "xxh3_gb_per_s": round(nbytes / hash_s / 1e9, 1),
    "hash_alone_share": round(hash_s / statistics.median(without_s), 4),
  }
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
