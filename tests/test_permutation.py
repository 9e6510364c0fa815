"""The keyed permutation behind each epoch's window order: a bijection, a pure function of
(seed, epoch, n, index) however it is chunked, and O(1) per index whatever n is."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstep.data.dataset import epoch_order
from jaxstep.data.permutation import shuffled_index

sizes = st.integers(1, 5000)
seeds = st.integers(0, 2**63 - 1)
epochs = st.integers(0, 10**6)


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=seeds, epoch=epochs)
def test_the_map_is_a_bijection_on_range_n(n, seed, epoch):
  out = shuffled_index(seed, epoch, n, np.arange(n))
  assert out.dtype == np.int64 and out.shape == (n,)
  assert np.array_equal(np.sort(out), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=seeds, epoch=epochs, data=st.data())
def test_any_chunking_or_order_gives_the_values_computed_all_at_once(n, seed, epoch, data):
  whole = shuffled_index(seed, epoch, n, np.arange(n))
  k = data.draw(st.integers(0, n - 1), label="seek to")
  cuts = sorted(data.draw(st.lists(st.integers(k, n), max_size=5), label="chunk ends"))
  pieces, start = [], k
  for end in [*cuts, n]:  # seek to k, then continue in uneven chunks
    pieces.append(shuffled_index(seed, epoch, n, np.arange(start, end)))
    start = end
  np.testing.assert_array_equal(np.concatenate(pieces), whole[k:])
  picked = data.draw(st.lists(st.integers(0, n - 1), max_size=50), label="any order")
  np.testing.assert_array_equal(
    shuffled_index(seed, epoch, n, np.array(picked, int)), whole[picked]
  )
  assert [int(shuffled_index(seed, epoch, n, np.array([i]))[0]) for i in picked] == [
    int(whole[i]) for i in picked
  ]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(10, 5000), seed=seeds, epoch=epochs)
def test_other_epochs_and_seeds_give_other_orders(n, seed, epoch):
  index = np.arange(n)
  first = shuffled_index(seed, epoch, n, index)
  assert not np.array_equal(first, shuffled_index(seed, epoch + 1, n, index))
  assert not np.array_equal(first, shuffled_index(seed ^ 1, epoch, n, index))


def test_epoch_order_is_the_permutation_of_every_index():
  np.testing.assert_array_equal(
    epoch_order(7, 2, 1000), shuffled_index(7, 2, 1000, np.arange(1000))
  )


def test_a_batch_of_a_billion_windows_maps_quickly_and_stays_in_range():
  n, index = 10**9, np.arange(5 * 10**8, 5 * 10**8 + 256)
  shuffled_index(3, 4, n, index)  # warm
  t = time.perf_counter()
  out = shuffled_index(3, 4, n, index)
  assert time.perf_counter() - t < 0.05
  assert len(np.unique(out)) == 256 and out.min() >= 0 and out.max() < n


def test_an_index_outside_range_n_or_a_negative_seed_is_an_error():
  with pytest.raises(ValueError, match="index"):
    shuffled_index(0, 0, 10, np.array([10]))
  with pytest.raises(ValueError, match="index"):
    shuffled_index(0, 0, 10, np.array([-1]))
  with pytest.raises(ValueError, match="seed"):
    shuffled_index(-1, 0, 10, np.array([0]))
  assert shuffled_index(0, 0, 10, np.zeros(0, int)).shape == (0,)
