"""The tests' fp32 tolerance: any summation order passes it, a 1 % error does not."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import assert_close, assert_far, mismatch, planted, rtol


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 4096), seed=st.integers(0, 2**32 - 1))
def test_a_sum_in_any_order_passes(n, seed):
  """Sums of n fp32 terms of mixed signs, added left to right, in a shuffled order and
  pairwise (numpy's own), equal the exact sum (float64) within the tolerance for n terms."""
  rng = np.random.default_rng(seed)
  terms = rng.normal(size=(8, n)).astype(np.float32)
  exact = terms.astype(np.float64).sum(axis=1)
  left_to_right = np.zeros(8, np.float32)
  for column in terms[:, rng.permutation(n)].T:
    left_to_right += column
  for got in (left_to_right, terms.sum(axis=1), terms[:, ::-1].sum(axis=1)):
    assert_close(got, exact, terms=n)


@pytest.mark.parametrize("n", [16, 128, 1024])  # past ~2,000 terms 1 % is < 100 tolerances
def test_a_one_percent_error_is_caught(n):
  values = np.random.default_rng(0).normal(size=(4, 32)).astype(np.float32)
  assert_far(planted(values), values, terms=n)
  assert_far({"a": values, "b": planted(values)}, {"a": values, "b": values}, terms=n)


def test_values_near_zero_are_judged_at_the_comparisons_scale():
  """A gradient that cancelled to ~0 keeps the rounding of its large terms: a difference
  of 1e-7 on it passes beside entries of order 1, and fails alone at its own scale."""
  expected = {"big": np.ones(3, np.float32), "small": np.zeros(3, np.float32)}
  actual = {"big": np.ones(3, np.float32), "small": np.full(3, 1e-7, np.float32)}
  assert mismatch(actual, expected, terms=16) < 1
  assert mismatch(actual["small"], np.full(3, 1e-9), terms=16) > 1


def test_the_tolerance_grows_with_the_square_root_of_the_terms():
  assert rtol(400) == pytest.approx(2 * rtol(100))
  assert 9e-6 < rtol(100) < 1e-5
