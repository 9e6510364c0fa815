"""The mixture of sources by weight: shares, determinism, seeking, cycling, per-source
counts — on windows that say which window they are, so every draw can be checked."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstep.data import mixture
from jaxstep.errors import ConfigError

S = 4  # tokens per window


class Marked:
  """``n`` windows; window ``i`` of source ``tag`` holds tokens ``tag·10⁶ + i`` and a loss
  mask of ``1 + i % 3`` targets."""

  def __init__(self, n: int, tag: int):
    self.n, self.tag = n, tag

  def __len__(self):
    return self.n

  def rows(self, index, num_rows, pad_id):
    index = np.asarray(index)
    tokens = np.full((num_rows, S), pad_id, np.int64)
    mask = np.zeros((num_rows, S), np.int32)
    tokens[: len(index)] = (self.tag * 10**6 + index)[:, None]
    for r, i in enumerate(index):
      mask[r, : 1 + i % 3] = 1
    return {"inputs": tokens, "targets": tokens, "loss_mask": mask}


class Seeded:
  """A mixture with the run's seed bound, as the loader calls it."""

  def __init__(self, m, seed):
    self.m, self.seed = m, seed

  def global_batch(self, b, g, pad_id, rows=None):
    return self.m.global_batch(self.seed, b, g, pad_id, rows)

  def source_tokens(self, batch):
    return self.m.source_tokens(batch)


def mix(sizes, weights, seed=0):
  sources = [
    mixture.Source(f"s{i}", Marked(n, i), w)
    for i, (n, w) in enumerate(zip(sizes, weights, strict=True))
  ]
  return Seeded(mixture.Mixture(sources), seed)


@settings(max_examples=25, deadline=None)
@given(
  weights=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4),
  seed=st.integers(0, 2**32),
)
def test_sample_shares_follow_the_weights_within_one_percent(weights, seed):
  m = mix([500] * len(weights), weights, seed)
  g, batches = 64, 96  # 6144 samples: three whole blocks
  sources = np.concatenate([m.global_batch(b, g, 0)["source"] for b in range(batches)])
  shares = np.bincount(sources, minlength=len(weights)) / len(sources)
  np.testing.assert_allclose(shares, np.asarray(weights) / sum(weights), atol=0.01)


def test_a_batch_is_a_pure_function_of_its_number_however_the_run_got_there():
  m = mix([300, 50, 7], [0.5, 0.3, 0.2], seed=3)
  straight = [m.global_batch(b, 32, 0) for b in range(200)]
  fresh = mix([300, 50, 7], [0.5, 0.3, 0.2], seed=3)  # a resumed run: nothing replayed
  for b in (199, 64, 0, 130):
    again = fresh.global_batch(b, 32, 0)
    for key in straight[b]:
      np.testing.assert_array_equal(again[key], straight[b][key])
  rows = np.array([1, 5, 30])
  part = fresh.global_batch(77, 32, 0, rows=rows)
  np.testing.assert_array_equal(part["inputs"], straight[77]["inputs"][rows])


def test_each_source_cycles_through_all_its_windows_once_per_pass():
  m = mix([40, 7], [0.5, 0.5], seed=1)
  drawn = {0: [], 1: []}
  for b in range(40):
    batch = m.global_batch(b, 16, 0)
    for src, token in zip(batch["source"], batch["inputs"][:, 0], strict=True):
      drawn[int(src)].append(int(token) % 10**6)
  for s, n in ((0, 40), (1, 7)):
    passes = [drawn[s][i : i + n] for i in range(0, len(drawn[s]) - n + 1, n)]
    assert len(passes) >= 2
    assert all(sorted(p) == list(range(n)) for p in passes)  # every window once a pass
    assert passes[0] != passes[1]  # and a new order each pass


def test_per_source_token_counts_equal_an_independent_count():
  m = mix([100, 100, 100], [0.2, 0.3, 0.5], seed=9)
  batch = m.global_batch(5, 64, 0)
  counts = m.source_tokens(batch)
  for s in range(3):
    windows = [
      int(t) % 10**6
      for t, src in zip(batch["inputs"][:, 0], batch["source"], strict=True)
      if src == s
    ]
    assert counts[f"tokens_s{s}"] == sum(1 + i % 3 for i in windows)
  assert sum(counts.values()) == batch["loss_mask"].sum()


def test_quotas_fill_a_block_and_refuse_a_weight_below_one_sample():
  q = mixture.quotas([1, 1, 1])
  assert q.sum() == mixture.BLOCK and max(q) - min(q) <= 1
  with pytest.raises(ConfigError, match=r"data.sources\[1\] weight"):
    mixture.quotas([1.0, 1e-6])


def _sources(tmp_path) -> str:
  docs = [
    {"text": "".join(f"def f{i}_{j}(x): return x + {j}\n" for j in range(8))} for i in range(60)
  ]
  (tmp_path / "code.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  return (
    f"data.sources=[{{name: web, path: 'bundled:text', weight: 3}}, "
    f"{{name: code, path: '{tmp_path / 'code.jsonl'}', weight: 1}}]"
  )


TINY = ["train.global_batch_size=8", "train.grad_accum_steps=2", "train.progress=false"]


@pytest.mark.slow
def test_a_mixture_run_killed_with_sigkill_resumes_bitwise(tmp_path):
  import jax
  from conftest import restore_state_arrays, straight_and_killed

  args = [_sources(tmp_path), *TINY, "train.max_steps=8", "train.eval_every=0"]
  args += ["checkpoint.every=2", "mesh.cpu_devices=1", "train.log_every=1"]
  straight_and_killed(tmp_path, args, kill_at=4)
  (step_a, a), (step_b, b) = (restore_state_arrays(tmp_path / n) for n in ("straight", "killed"))
  assert step_a == step_b == 8
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)

  def counts(run):
    lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["tokens_web"], r["tokens_code"]) for r in map(json.loads, lines)]

  assert counts("killed") == counts("straight")


@pytest.mark.slow
def test_a_mixture_run_logs_tokens_per_source_and_evaluates_each_source(tmp_path):
  from jaxstep.trainer import config_run as loop
  from jaxstep.trainer.config import loading as config_lib

  overrides = [_sources(tmp_path), *TINY, "train.max_steps=4", f"run_dir={tmp_path / 'run'}"]
  overrides += ["train.log_every=1", "data.eval_fraction=0.2"]
  result = loop.train(config_lib.load("tiny", overrides))
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  for r in lines:
    assert r["tokens_web"] + r["tokens_code"] == r["tokens"]
  assert set(result.evals) == {"web", "code"}
  with pytest.raises(ConfigError, match="train.epochs has no meaning for a mixture"):
    config_lib.load("tiny", [_sources(tmp_path), "train.epochs=1"])
