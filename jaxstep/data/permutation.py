"""A keyed pseudo-random permutation of ``range(n)``, evaluated one index at a time.

Each epoch's window order is ``π(i)`` for ``i = 0 … n-1``, where ``π`` depends only on
(seed, epoch, n). Materializing ``π`` (``rng.permutation(n)``) costs O(n) time and memory
for every global batch; here ``π(i)`` is computed for just the G indices a batch needs, so a
batch costs O(G) whatever the corpus size, and a resumed run seeks to any batch directly.

Construction (format-preserving encryption by cycle walking):

- ``E`` is a Feistel network on the ``k``-bit domain ``[0, 2^k)``, the smallest with
  ``2^k ≥ n`` (``k ≥ 2``): the index is split into a high part ``L`` (``⌈k/2⌉`` bits) and a
  low part ``R`` (``⌊k/2⌋`` bits); each of ``ROUNDS`` rounds maps ``(L, R) → (R, L ⊕
  F(R, key_r) mod 2^|L|)``. A round is invertible whatever ``F`` is (``R`` is kept, so ``L``
  is recovered by xoring ``F(R)`` again), so ``E`` is a bijection of ``[0, 2^k)``. The
  halves' widths swap each round and ``ROUNDS`` is even, so they end as they started.
- ``F`` is splitmix64's finalizer of ``R ⊕ key_r``: a 64-bit mix in which every input bit
  flips about half the output bits.
- ``π(i)`` applies ``E`` until the value falls below ``n`` (cycle walking). The walk stays
  on ``i``'s cycle of ``E``, which contains ``i < n``, so it ends; it maps ``range(n)`` onto
  itself one to one. Since ``2^k < 2n``, a step lands in range with probability ``n/2^k >
  1/2``: under 2 steps on average per index.
- The round keys come from ``np.random.SeedSequence([seed, epoch])`` (its output is fixed
  across numpy versions and platforms), so every process computes the same order.

Grain ships a similar shuffle (``grain.experimental.index_shuffle``), but it maps one Python
int per call and takes a 32-bit seed; this one maps a numpy array at once, with 64-bit keys.
"""

from __future__ import annotations

import functools

import numpy as np

ROUNDS = 8  # even: the halves' widths return to their start; 4 suffice for a random F
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@functools.lru_cache(maxsize=64)
def _round_keys(seed: int, epoch: int) -> tuple[np.uint64, ...]:
  """``ROUNDS`` 64-bit keys, a pure function of (seed, epoch)."""
  state = np.random.SeedSequence([seed, epoch]).generate_state(ROUNDS, np.uint64)
  return tuple(np.uint64(k) for k in state)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
  """The round function ``F``: splitmix64's finalizer of ``x ⊕ key`` (uint64, wrapping)."""
  x = x ^ key
  x = (x ^ (x >> np.uint64(30))) * _MIX1
  x = (x ^ (x >> np.uint64(27))) * _MIX2
  return x ^ (x >> np.uint64(31))


def _feistel(x: np.ndarray, bits: int, keys: tuple[np.uint64, ...]) -> np.ndarray:
  """``E``: a bijection of ``[0, 2^bits)`` applied elementwise to ``x`` (uint64)."""
  high, low = bits - bits // 2, bits // 2  # widths of L and R
  left, right = x >> np.uint64(low), x & np.uint64((1 << low) - 1)
  for key in keys:
    left, right = right, (left ^ _mix(right, key)) & np.uint64((1 << high) - 1)
    high, low = low, high
  return (left << np.uint64(low)) | right


def shuffled_index(seed: int, epoch: int, n: int, index: np.ndarray) -> np.ndarray:
  """``π(index)``: where each of ``index`` (in ``[0, n)``) goes in the order of ``epoch``.

  A pure function of (seed, epoch, n, index): any chunking, order or process gives the same
  values. O(len(index)) time and memory, independent of ``n``.

  Args:
    seed, epoch: the permutation's key (non-negative integers).
    n: the number of windows, ``1 ≤ n < 2^63``.
    index: integer array of positions in the epoch.

  Returns:
    int64 array shaped like ``index``: the window at each position.

  Raises:
    ValueError: a negative seed or epoch, ``n`` out of range, or an index outside ``[0, n)``.
  """
  if seed < 0 or epoch < 0:
    raise ValueError(f"seed and epoch must be non-negative, got seed={seed}, epoch={epoch}")
  n = int(n)
  if not 1 <= n < 2**63:
    raise ValueError(f"n must be in [1, 2^63), got {n}")
  index = np.asarray(index)
  if index.size and (index.min() < 0 or index.max() >= n):
    raise ValueError(f"an index is outside [0, {n}): {index.min()} … {index.max()}")
  bits, keys = max(2, (n - 1).bit_length()), _round_keys(seed, epoch)
  out = _feistel(index.reshape(-1).astype(np.uint64), bits, keys)
  walking = np.flatnonzero(out >= np.uint64(n))
  while walking.size:  # cycle walking: under 2 steps per index on average
    out[walking] = _feistel(out[walking], bits, keys)
    walking = walking[out[walking] >= np.uint64(n)]
  return out.astype(np.int64).reshape(index.shape)
