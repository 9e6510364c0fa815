"""``train.grad_accum_steps: auto``: the smallest K whose compiled step fits the budget,
found by a binary search that compiles few candidates and runs none."""

import math

import jax
import pytest
from conftest import make_cfg
from hypothesis import given
from hypothesis import strategies as st

from jaxstep import ConfigError
from jaxstep.trainer.plan import auto_accum
from jaxstep.trainer.plan.numbers import mesh_for
from jaxstep.trainer.plan.steps import abstract_batch, abstract_state, jit_step, train_step


def test_candidates_split_g_over_the_devices():
  assert auto_accum.candidates(16, 1) == [1, 2, 4, 8, 16]
  assert auto_accum.candidates(24, 2) == [1, 2, 3, 4, 6, 12]
  assert auto_accum.candidates(6, 4) == []


@given(
  n=st.integers(1, 40),
  data=st.data(),
)
def test_search_finds_the_smallest_fitting_k_in_few_compiles(n, data):
  ks = list(range(1, n + 1))
  # bytes fall as K grows (ties allowed): what a smaller micro-batch does
  drops = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
  table = {k: 10_000 - sum(drops[:i]) for i, k in enumerate(ks)}
  budget = data.draw(st.integers(table[ks[-1]], 10_000))
  calls = []
  k, compiled = auto_accum.search(ks, lambda k: calls.append(k) or table[k], budget)
  assert k == min(c for c in ks if table[c] <= budget)
  assert len(calls) <= math.ceil(math.log2(n)) + 1 if n > 1 else len(calls) <= 1
  assert compiled == [(c, table[c]) for c in calls]


def test_search_says_when_nothing_fits():
  with pytest.raises(
    ConfigError, match=r"even K=4 .* needs 0\.00 GiB; raise train.memory_budget_gb"
  ):
    auto_accum.search([1, 2, 4], lambda k: 100 // k, 10)


@pytest.fixture(scope="module")
def compiled_tiny(tmp_path_factory):
  """Every candidate K of a small config (G = 16 on one device) compiled once: ``(cfg,
  compile_k, bytes by K)``."""
  cfg = make_cfg(
    tmp_path_factory.mktemp("auto"),
    "train.global_batch_size=16",
    "train.grad_accum_steps=auto",
    "model.vocab_size=264",
    "mesh.data=1",
  )
  mesh = mesh_for(cfg)
  apply_fn, state = abstract_state(cfg, mesh, 64)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  cache = {}

  def compile_k(k):
    if k not in cache:
      step = train_step(cfg, apply_fn, mesh, 64, k)
      cache[k] = jit_step(step, shardings, mesh).lower(state, abstract_batch(cfg, mesh))
      cache[k] = cache[k].compile()
    return cache[k]

  sizes = {k: auto_accum.compiled_bytes(compile_k(k)) for k in auto_accum.candidates(16, 1)}
  return cfg, compile_k, sizes


@pytest.mark.slow
def test_budgets_around_each_candidate_pick_the_expected_k(compiled_tiny):
  _, compile_k, sizes = compiled_tiny
  ks = sorted(sizes)
  assert [sizes[k] for k in ks] == sorted(sizes.values(), reverse=True)  # monotone here
  limit = math.ceil(math.log2(len(ks))) + 1
  for i, k in enumerate(ks):
    counted = []

    def counting(c, counted=counted):
      counted.append(c)
      return compile_k(c)

    assert auto_accum.choose(16, 1, counting, sizes[k])[0] == k  # just fits
    assert len(counted) <= limit
    if i + 1 < len(ks):  # one byte short: the next K
      assert auto_accum.choose(16, 1, compile_k, sizes[k] - 1)[0] == ks[i + 1]
    else:
      with pytest.raises(ConfigError, match="no train.grad_accum_steps fits"):
        auto_accum.choose(16, 1, compile_k, sizes[k] - 1)


@pytest.mark.slow
def test_a_run_with_auto_trains_with_the_chosen_k(tmp_path, compiled_tiny, caplog):
  import logging

  from jaxstep import trainer
  from jaxstep.trainer.store.records import read_records

  _, _, sizes = compiled_tiny
  budget_gb = (sizes[4] + 1) / auto_accum.GIB  # K = 4 fits, K = 2 does not
  cfg = make_cfg(
    tmp_path,
    "train.global_batch_size=16",
    "train.grad_accum_steps=auto",
    f"train.memory_budget_gb={budget_gb}",
    "train.max_steps=2",
    "mesh.data=1",
  )
  with caplog.at_level(logging.INFO, logger="jaxstep"):
    result = trainer.train(cfg)
  assert "→ K=4 (micro-batch of 4 samples per device)" in caplog.text
  assert "K=2: " in caplog.text and "(over)" in caplog.text
  assert result.run_state.grad_accum_steps == 4 and result.run_state.step == 2
  assert "grad_accum_steps: 4" in (tmp_path / "run" / "config.yaml").read_text()
  assert len(read_records(tmp_path / "run" / "metrics.jsonl")) >= 1


def test_auto_on_cpu_without_a_budget_is_one_clear_line(tmp_path):
  from jaxstep import trainer

  cfg = make_cfg(tmp_path, "train.grad_accum_steps=auto", "train.max_steps=1")
  with pytest.raises(ConfigError, match="auto on cpu needs train.memory_budget_gb"):
    trainer.train(cfg)
  assert not (tmp_path / "run").exists()


def test_grad_accum_steps_takes_a_count_or_auto(tmp_path):
  with pytest.raises(ConfigError, match="a positive integer or auto, got 'max'"):
    make_cfg(tmp_path, "train.grad_accum_steps=max")
  with pytest.raises(ConfigError, match="memory_budget_gb must be >= 0"):
    make_cfg(tmp_path, "train.memory_budget_gb=-1")
