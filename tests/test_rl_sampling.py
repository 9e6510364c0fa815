"""The sampler's log-probs: each drawn token's log-prob under the distribution it was drawn
from (allowed ids, temperature, top-k, top-p) equals the training pass's for the same
params and settings, and differs where a setting differs — the gap the RL check reports."""

import jax
import numpy as np
import pytest

from jaxstep import models
from jaxstep.core import rl
from jaxstep.data import ByteTokenizer
from jaxstep.generation import Generator
from jaxstep.generation.sampling import allowed_ids

CFG = models.GPTConfig(vocab_size=264, max_seq_len=48, d_model=32, n_layers=2, n_heads=4)
TOK = ByteTokenizer()
PROMPTS = ["the ", "12 + 3", "a longer prompt of text", "x"]


@pytest.fixture(scope="module")
def params():
  return models.build(CFG, 0)[1]


@pytest.fixture(scope="module")
def sampled(params):
  """Params, and 4 prompts × 2 samples at temperature 0.7 and top-p 0.9 (with the log-probs
  the sampler saw), laid out as RL rows."""
  gen = Generator(CFG, params, TOK)
  prompts = [gen.encode_prompt(p) for p in PROMPTS for _ in range(2)]
  ids, _, logps = gen.sample_ids(prompts, max_new_tokens=12, temperature=0.7, top_p=0.9, seed=3)
  return params, rows(prompts, ids, logps)


def rows(prompts, ids, logps, width=40):
  """Prompt + completion shifted into inputs/targets, the completion's targets masked, the
  sampler's log-probs at those targets."""
  n = len(prompts)
  tokens = np.zeros((n, width + 1), np.int32)
  mask = np.zeros((n, width), np.int32)
  old = np.zeros((n, width), np.float32)
  for r, (p, c, lp) in enumerate(zip(prompts, ids, logps, strict=True)):
    tokens[r, : len(p) + len(c)] = [*p, *c]
    mask[r, len(p) - 1 : len(p) - 1 + len(c)] = 1
    old[r, len(p) - 1 : len(p) - 1 + len(c)] = lp
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "completion_mask": mask, "old": old}


def trainer_logps(params, batch, temperature=1.0, top_p=1.0):
  return np.asarray(_trainer_logps(params, batch["inputs"], batch["targets"], temperature, top_p))


@jax.jit  # one program for every setting: the temperature and top-p are traced
def _trainer_logps(params, inputs, targets, temperature, top_p):
  logits = models.decoder(CFG).apply_fn(params, inputs)
  allowed = allowed_ids(CFG.vocab_size, TOK)
  return rl.token_logps(logits, targets, temperature, top_p=top_p, allowed=allowed)[0]


def test_sampler_and_trainer_log_probs_agree_at_temperature_and_top_p(sampled):
  params, batch = sampled
  m = batch["completion_mask"] > 0
  assert m.sum() > 40
  got = trainer_logps(params, batch, temperature=0.7, top_p=0.9)
  # the cached decode against the full forward: fp32 rounding of the logits (test_generation)
  np.testing.assert_allclose(got[m], batch["old"][m], atol=2e-4)
  assert np.all(batch["old"][m] <= 0) and np.all(np.isfinite(batch["old"][m]))


@pytest.mark.parametrize(
  "settings",
  [{"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.7}],
  ids=["other-temperature", "no-top-p"],
)
def test_a_different_setting_opens_a_gap(sampled, settings):
  """The trainer at temperature 1 (TRL's bug when the trainer forgets the sampler's
  temperature) or without the nucleus (vLLM-style truncation ignored) sees other numbers."""
  params, batch = sampled
  m = batch["completion_mask"] > 0
  gap = np.abs(trainer_logps(params, batch, **settings)[m] - batch["old"][m]).max()
  assert gap > 0.05


def test_greedy_samples_report_the_argmax_log_prob_at_temperature_one(params):
  gen = Generator(CFG, params, TOK)
  prompts = [gen.encode_prompt(p) for p in PROMPTS]
  ids, _, logps = gen.sample_ids(prompts, max_new_tokens=6, temperature=0.0)
  batch = rows(prompts, ids, logps)
  m = batch["completion_mask"] > 0
  np.testing.assert_allclose(trainer_logps(params, batch)[m], batch["old"][m], atol=2e-4)
  plain, _ = gen.generate_ids(prompts, max_new_tokens=6, temperature=0.0)
  assert plain == ids  # the same continuations as before the log-probs were kept


def test_a_longer_prefill_samples_the_same_and_compiles_once_for_any_prompt_lengths(
  params,
  monkeypatch,
):
  traces = []
  loop = Generator._loop
  monkeypatch.setattr(
    Generator, "_loop", lambda self, *a, **k: traces.append(1) or loop(self, *a, **k)
  )
  gen = Generator(CFG, params, TOK)
  prompts = [gen.encode_prompt(p) for p in PROMPTS]
  settings = dict(max_new_tokens=6, temperature=0.8, seed=5)
  ids, reasons, logps = gen.sample_ids(prompts, **settings)
  padded = gen.sample_ids(prompts, prefill_to=30, **settings)
  assert padded[0] == ids and padded[1] == reasons
  np.testing.assert_allclose(np.concatenate(padded[2]), np.concatenate(logps), atol=1e-5)
  others = [gen.encode_prompt(p) for p in ["1", "22", "a third one", "four 4"]]
  gen.sample_ids(others, prefill_to=30, **settings)  # other lengths: the same program
  assert len(traces) == 2  # the unpadded call, and every padded one
