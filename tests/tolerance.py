"""fp32 tolerances that follow from the computation, not from the machine that ran it.

Two fp32 programs that are equal in exact arithmetic but add in another order (another
attention kernel, K micro-batches against one, another device split, a masked softmax
against a plain one) differ by rounding. A sum of ``n`` terms of scale ``s`` rounded in
any order is off by at most about ``ε·n·s`` and typically ``ε·√n·s`` (ε = 2⁻²³, fp32's
machine epsilon): the errors of the partial sums are independent and add like a random
walk. Which order a machine takes depends on the processor XLA compiles for, so the last
bits do, and a tolerance must cover any order, not the one this machine took.

The rule (``docs/development.md`` says when to use which comparison):

- ``rtol = SAFETY·ε·√terms``, where ``terms`` is the longest sum on the path to the
  compared value (the largest reduced dimension: a matmul's inner size, a softmax's keys);
- the floor for values near 0 is that rtol times the scale of the whole comparison (the
  largest ``|expected|`` over every leaf): a value that came out of a sum of large terms
  and cancelled to ~0 keeps the absolute error of those terms, not of its own size.

``mismatch`` reports the largest error in units of that tolerance, so a test can show its
margin: ≤ 1 passes, and a deliberately wrong variant should measure ≥ ``WRONG`` (a wrong
normalization or a leak across documents is off by percents, 10⁴ and more of these units).
"""

import math
import os

import jax
import numpy as np

EPS = float(np.finfo(np.float32).eps)  # 2⁻²³ ≈ 1.19e-7
# covers depth (a few layers of sums in a row) and the gap between √n and the worst case;
# at terms = 100 it gives rtol ≈ 1e-5
SAFETY = 8.0
WRONG = 100.0  # a wrong variant must miss by this many tolerances at least


def rtol(terms: int) -> float:
  """The relative tolerance for fp32 results whose longest sum has ``terms`` terms."""
  return SAFETY * EPS * math.sqrt(max(int(terms), 1))


def _pairs(actual, expected):
  got, want = jax.tree.leaves(actual), jax.tree.leaves(expected)
  assert jax.tree.structure(actual) == jax.tree.structure(expected), (
    f"different trees: {jax.tree.structure(actual)} vs {jax.tree.structure(expected)}"
  )
  wide = lambda x: np.asarray(x, np.float64)  # noqa: E731
  return [(wide(a), wide(e)) for a, e in zip(got, want, strict=True)]


def mismatch(actual, expected, *, terms: int) -> float:
  """The largest ``|actual − expected|`` over every leaf, in units of the tolerance
  ``rtol(terms)·(|expected| + scale)`` (scale: the largest ``|expected|`` of the tree)."""
  pairs = _pairs(actual, expected)
  for a, e in pairs:
    assert a.shape == e.shape, f"shapes differ: {a.shape} vs {e.shape}"
  scale = max((float(np.abs(e).max(initial=0.0)) for _, e in pairs), default=0.0)
  tol = rtol(terms)
  worst = 0.0
  for a, e in pairs:
    if a.size:
      bound = tol * (np.abs(e) + scale) + np.finfo(np.float32).tiny
      worst = max(worst, float((np.abs(a - e) / bound).max()))
  return worst


def assert_close(actual, expected, *, terms: int) -> None:
  """``actual`` equals ``expected`` up to the rounding of a reordered fp32 sum."""
  got = mismatch(actual, expected, terms=terms)
  _log("close", got, terms)
  assert got <= 1.0, f"off by {got:.3g}× the fp32 tolerance for sums of {terms} terms"


def assert_far(wrong, expected, *, terms: int) -> None:
  """A deliberately wrong variant misses ``expected`` by ``WRONG`` tolerances or more: the
  tolerance of the comparison it stands beside would catch the bug it plants."""
  got = mismatch(wrong, expected, terms=terms)
  _log("wrong", got, terms)
  assert got >= WRONG, f"the wrong variant is only {got:.3g}× the tolerance away"


def planted(tree, relative: float = 0.01):
  """``tree`` with its largest entry off by ``relative`` (1 % by default): the smallest
  error an exact equality must still catch, where no natural wrong variant is at hand."""
  leaves, treedef = jax.tree.flatten(tree)
  biggest = max(range(len(leaves)), key=lambda i: float(np.abs(np.asarray(leaves[i])).max()))
  leaf = np.array(leaves[biggest], np.float32)
  at = np.unravel_index(np.abs(leaf).argmax(), leaf.shape)
  leaf[at] *= 1 + relative
  leaves[biggest] = leaf
  return jax.tree.unflatten(treedef, leaves)


def _log(kind: str, got: float, terms: int) -> None:
  """With ``JAXSTEP_TOLERANCE_LOG=FILE``, one line per comparison: how much of its
  tolerance it used on this machine (run the suite so on a new machine to see the margins)."""
  path = os.environ.get("JAXSTEP_TOLERANCE_LOG")
  if path:
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    with open(path, "a") as f:
      f.write(f"{kind}\t{got:.4g}\t{terms}\t{test}\n")
