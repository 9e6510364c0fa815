"""The RL core (``jaxstep.core.rl``): group advantages against hand-computed numbers, the
clipped policy loss with its KL against a numpy computation, every normalization exact over
K micro-batches with padding rows and uneven completion lengths (where TRL's per-micro-batch
means are not), and the loss, KL, clip ratios and gradient against TRL's ``GRPOTrainer``."""

import math
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_lm_apply, tiny_lm_params
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import assert_close, assert_far

from jaxstep.core import rl
from jaxstep.core.accumulate import split_micro_batches
from jaxstep.core.step import make_train_step
from jaxstep.errors import BatchError, ConfigError

VOCAB, SEQ = 11, 9


def test_advantages_equal_hand_computed_numbers():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]])
  std = np.array([math.sqrt(1 / 3), 0.0, math.sqrt(2 / 3)])  # Bessel: Σ(r − m)² / (G − 1)
  means = np.array([0.5, 0.5, 2.0])
  centred = rewards - means[:, None]
  np.testing.assert_allclose(rl.group_advantages(rewards, "dr_grpo"), centred, atol=1e-7)
  np.testing.assert_allclose(
    rl.group_advantages(rewards, "grpo"), centred / (std[:, None] + 1e-4), rtol=1e-6
  )
  # leave-one-out: r_i − (Σ_j r_j − r_i) / (G − 1); e.g. 3 − (1 + 2 + 2)/3
  want = np.array([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4, [3 - 5 / 3, 1 - 7 / 3, 0.0, 0.0]])
  np.testing.assert_allclose(rl.group_advantages(rewards, "rloo"), want, atol=1e-6)
  for kind in rl.ADVANTAGES:  # an all-equal group: 0, never NaN
    assert np.all(np.asarray(rl.group_advantages(rewards, kind))[1] == 0.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5, width=32), min_size=8, max_size=8), st.sampled_from([2, 4]))
def test_rloo_is_the_centred_reward_scaled_by_g_over_g_minus_1(values, g):
  rewards = np.asarray(values, np.float32).reshape(-1, g)
  rloo, centred = rl.group_advantages(rewards, "rloo"), rl.group_advantages(rewards, "dr_grpo")
  np.testing.assert_allclose(rloo, centred * g / (g - 1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.sum(np.asarray(centred), axis=1), 0.0, atol=1e-4)


def rl_batch(seed=0, rows=8, lengths=(1, 8, 3, 5, 2, 7), prompt=2, pad_rows=2):
  """Rows of completions of very different lengths after a ``prompt``-token prompt, the last
  ``pad_rows`` padding (no completion token), old and reference log-probs near a policy's."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
  mask = np.zeros((rows, SEQ), np.int32)
  for i, n in enumerate(lengths[: rows - pad_rows]):
    mask[i, prompt - 1 : prompt - 1 + n] = 1
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "completion_mask": mask,
    "advantages": rng.normal(size=rows).astype(np.float32),
    "old_logps": (np.log(1 / VOCAB) + rng.normal(0, 0.3, (rows, SEQ))).astype(np.float32),
    "ref_logps": (np.log(1 / VOCAB) + rng.normal(0, 0.3, (rows, SEQ))).astype(np.float32),
  }


def numpy_loss(logits, batch, *, loss_norm, eps_low, eps_high, beta, temperature, max_new):
  """The module docstring's objective in float64 numpy."""
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = np.take_along_axis(logp_all, batch["targets"][..., None], -1)[..., 0]
  ratio = np.exp(logp - batch["old_logps"])
  adv = batch["advantages"][:, None].astype(np.float64)
  loss = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
  r = batch["ref_logps"] - logp
  kl = np.exp(r) - r - 1
  loss = loss + beta * kl
  m = batch["completion_mask"].astype(np.float64)
  n = m.sum(-1)
  real = n > 0
  if loss_norm == "tokens":
    value = (loss * m).sum() / m.sum()
  elif loss_norm == "sequences":
    value = ((loss * m).sum(-1)[real] / n[real]).mean()
  else:
    value = (loss * m).sum() / (real.sum() * max_new)
  return value, (kl * m).sum() / m.sum()


NORMS = {"tokens": {}, "sequences": {}, "constant": {"max_new_tokens": 8}}


@pytest.mark.parametrize("loss_norm", list(NORMS))
def test_the_loss_and_its_kl_equal_a_numpy_computation(loss_norm):
  batch = rl_batch()
  params = tiny_lm_params(vocab=VOCAB)
  options = dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.04, temperature=0.7, **NORMS[loss_norm])
  loss_fn = rl.grpo_loss(tiny_lm_apply, loss_norm=loss_norm, **options)
  total, aux = jax.jit(loss_fn)(params, batch, None)
  units = jax.jit(rl.units_fn(loss_norm, options.get("max_new_tokens")))(batch)
  want, kl = numpy_loss(
    jax.jit(tiny_lm_apply)(params, batch["inputs"]),
    batch,
    loss_norm=loss_norm,
    eps_low=0.2,
    eps_high=0.28,
    beta=0.04,
    temperature=0.7,
    max_new=options.get("max_new_tokens"),
  )
  assert_close(float(total / units), want, terms=VOCAB * SEQ)
  assert_close(float(aux["kl"] / aux["completion_tokens"]), kl, terms=VOCAB * SEQ)
  assert int(aux["completions"]) == 6 and int(aux["completion_tokens"]) == 26


@pytest.mark.parametrize("loss_norm", list(NORMS))
def test_k_micro_batches_equal_one_big_batch_for_every_normalization(loss_norm):
  """K = 4 against K = 1, one AdamW update, on 6 completions of 1 to 8 tokens and 2 padding
  rows: the same loss, metrics and new params."""
  batch = rl_batch()
  options = dict(beta=0.04, temperature=0.7, **NORMS[loss_norm])
  loss_fn = rl.grpo_loss(tiny_lm_apply, loss_norm=loss_norm, **options)
  units = rl.units_fn(loss_norm, options.get("max_new_tokens"))
  params, out = tiny_lm_params(vocab=VOCAB), {}
  for k in (1, 4):
    step = make_train_step(loss_fn, optax.adamw(1e-2), grad_accum_steps=k, units_fn=units)
    state, metrics = jax.jit(step)(step.init(params, 0), batch)
    out[k] = (state.params, {n: metrics[n] for n in ("loss", "kl", "clip_ratio/region_mean")})
  assert_close(out[4], out[1], terms=8 * SEQ * VOCAB)


@pytest.mark.parametrize("loss_norm", ["tokens", "sequences"])
def test_a_mean_of_micro_batch_means_misses_the_global_normalization(loss_norm):
  """TRL's ``bnpo`` and ``grpo`` divide each micro-batch by its own count: with micro-batches
  of uneven lengths the loss and gradient miss the global batch's, which the step's sum of
  ``loss_sum_k / N`` hits."""
  batch = jax.tree.map(jnp.asarray, rl_batch())
  loss_fn = rl.grpo_loss(tiny_lm_apply, loss_norm=loss_norm)
  units = jax.jit(rl.units_fn(loss_norm))
  params = tiny_lm_params(vocab=VOCAB)
  value_and_grad = jax.jit(jax.value_and_grad(lambda p, b, n: loss_fn(p, b, None)[0] / n))
  exact = value_and_grad(params, batch, units(batch))
  split = jax.tree.map(np.asarray, split_micro_batches(batch, 4))
  micro = [jax.tree.map(lambda x, k=k: x[k], split) for k in range(4)]
  summed = jax.tree.map(
    lambda *x: sum(x), *(value_and_grad(params, m, units(batch)) for m in micro)
  )
  means = [value_and_grad(params, m, jnp.maximum(units(m), 1)) for m in micro]
  mean_of_means = jax.tree.map(lambda *x: sum(x) / 4, *means)
  assert_close(summed, exact, terms=8 * SEQ * VOCAB)
  assert_far(mean_of_means[0], exact[0], terms=8 * SEQ * VOCAB)


def test_a_live_reference_is_scored_without_the_samplers_truncation():
  """With top-k on, a drawn token may lie outside the *reference's* top-k once the policy
  has drifted: scored under the sampler's filters its log-prob is −inf and the k3 term
  infinite. The reference is scored under the temperature only (as TRL does), so the KL
  is finite and equals numpy's with the policy under its top-k and the reference unfiltered."""
  batch = rl_batch()
  del batch["ref_logps"]
  params = tiny_lm_params(vocab=VOCAB)
  logits = np.asarray(jax.jit(tiny_lm_apply)(params, batch["inputs"]), np.float64)
  batch["targets"] = np.argmax(logits, -1).astype(np.int32)  # in the policy's top 2 …
  reference = lambda p, x, **kw: -tiny_lm_apply(p, x)  # noqa: E731  … its reference's last
  options = dict(beta=0.04, temperature=0.7, top_k=2)
  total, aux = jax.jit(rl.grpo_loss(tiny_lm_apply, reference=reference, **options))(
    params, batch, None
  )
  assert np.isfinite(float(total)) and np.isfinite(float(aux["kl"]))

  def logp(z, k):
    z = z / 0.7
    if k:
      z = np.where(z < np.sort(z, -1)[..., -k, None], -np.inf, z)
    z = z - z.max(-1, keepdims=True)
    z = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(z, batch["targets"][..., None], -1)[..., 0]

  r = logp(-logits, 0) - logp(logits, 2)
  m = batch["completion_mask"]
  assert_close(float(aux["kl"]), float(np.sum((np.exp(r) - r - 1) * m)), terms=VOCAB * SEQ)


def test_bad_batches_and_options_are_one_line():
  batch = rl_batch()
  loss_fn = rl.grpo_loss(tiny_lm_apply, beta=0.1)
  del batch["ref_logps"]
  with pytest.raises(BatchError, match="ref_logps"):
    loss_fn(tiny_lm_params(vocab=VOCAB), batch, None)
  with pytest.raises(BatchError, match="advantages"):
    rl.grpo_loss(tiny_lm_apply)(None, {"inputs": batch["inputs"]}, None)
  with pytest.raises(ConfigError, match="max_new_tokens"):
    rl.grpo_loss(tiny_lm_apply, loss_norm="constant")
  with pytest.raises(ConfigError, match="loss_norm"):
    rl.units_fn("per_group")
  with pytest.raises(ConfigError, match="advantage"):
    rl.group_advantages(np.zeros((2, 4)), "ppo")


# --------------------------------------------------------------------------- TRL parity

# jaxstep's normalization for each TRL loss type on one batch, one process, no accumulation
TRL_TYPES = {"grpo": "sequences", "bnpo": "tokens", "dapo": "tokens", "dr_grpo": "constant"}


class Accelerator:
  """What ``GRPOTrainer._compute_loss`` reads of ``accelerate.Accelerator`` on one process."""

  num_processes = 1

  def gather(self, x):
    return x

  gather_for_metrics = gather

  def reduce(self, x, reduction="sum"):
    return x


def trl_grpo(torch, loss_type, logits, batch, prompt, *, beta, eps_low, eps_high, temperature):
  """TRL 1.16's ``GRPOTrainer._compute_loss`` on a stub trainer whose model returns
  ``logits`` (the completion positions, divided by ``temperature`` as TRL does): (loss,
  {metric: value}, d loss / d logits)."""
  from trl.trainer.grpo_trainer import GRPOTrainer
  from trl.trainer.utils import selective_log_softmax

  t = batch["targets"].shape[1] - (prompt - 1)
  completion_ids = torch.tensor(batch["targets"][:, prompt - 1 :])
  leaf = torch.tensor(np.asarray(logits)[:, prompt - 1 :], requires_grad=True)

  def per_token(model, input_ids, attention_mask, logits_to_keep, compute_entropy, **kw):
    assert logits_to_keep == t
    logps = selective_log_softmax(leaf / temperature, completion_ids)
    return logps, torch.zeros_like(logps), None

  mask = torch.tensor(batch["completion_mask"][:, prompt - 1 :])
  stub = SimpleNamespace(
    _get_per_token_logps_and_entropies=per_token,
    top_entropy_quantile=1.0,
    off_policy_mask_threshold=None,
    importance_sampling_level="token",
    beta=beta,
    loss_type=loss_type,
    epsilon_low=eps_low,
    epsilon_high=eps_high,
    use_vllm=False,
    model=SimpleNamespace(training=True),
    current_gradient_accumulation_steps=1,
    max_completion_length=t,
    accelerator=Accelerator(),
    aux_loss_enabled=False,
    _entropy_bonus_enabled=False,
    _metrics={"train": defaultdict(list)},
    args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
  )
  b = len(mask)
  inputs = {
    "prompt_ids": torch.tensor(batch["inputs"][:, :prompt]),
    "prompt_mask": torch.ones(b, prompt, dtype=torch.long),
    "completion_ids": completion_ids,
    "completion_mask": mask,
    "advantages": torch.tensor(batch["advantages"]),
    "old_per_token_logps": torch.tensor(batch["old_logps"][:, prompt - 1 :]),
    "ref_per_token_logps": torch.tensor(batch["ref_logps"][:, prompt - 1 :]),
    "num_items_in_batch": mask.sum(),
  }
  loss = GRPOTrainer._compute_loss(stub, None, inputs)
  loss.backward()
  metrics = {k: v[0] for k, v in stub._metrics["train"].items()}
  return float(loss.detach()), metrics, leaf.grad.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", list(TRL_TYPES))
def test_the_loss_kl_clip_ratios_and_gradient_equal_trls_grpo_trainer(loss_type, beta):
  """Same prompts (2 tokens), completions of 1 to 8 tokens, advantages, old and reference
  log-probs, and logits: TRL's loss type against its jaxstep normalization."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("trl")
  prompt = 2
  batch = rl_batch(seed=3, rows=6, lengths=(1, 8, 3, 5, 2, 7), prompt=prompt, pad_rows=0)
  batch["old_logps"] = batch["old_logps"] - 0.3  # ratios well outside [0.8, 1.28]: clipping
  logits = np.random.default_rng(4).normal(0, 2, (6, SEQ, VOCAB)).astype(np.float32)
  options = dict(beta=beta, eps_low=0.2, eps_high=0.28, temperature=0.7)
  want_loss, want, want_grad = trl_grpo(torch, loss_type, logits, batch, prompt, **options)
  norm = TRL_TYPES[loss_type]
  t = SEQ - (prompt - 1)
  loss_fn = rl.grpo_loss(
    lambda p, x, **kw: p,  # the "model" returns its params: the logits themselves
    loss_norm=norm,
    epsilon_low=0.2,
    epsilon_high=0.28,
    beta=beta,
    temperature=0.7,
    max_new_tokens=t if norm == "constant" else None,
  )
  units = float(rl.units_fn(norm, t if norm == "constant" else None)(batch))
  (total, aux), grad = jax.value_and_grad(lambda z: loss_fn(z, batch, None), has_aux=True)(
    jnp.asarray(logits)
  )
  terms = SEQ * VOCAB
  assert_close(float(total) / units, want_loss, terms=terms)
  assert_close(np.asarray(grad)[:, prompt - 1 :] / units, want_grad, terms=terms)
  assert not np.any(np.asarray(grad)[:, : prompt - 1])  # prompt positions: no gradient
  tokens = float(aux["completion_tokens"])
  names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
  assert want["clip_ratio/region_mean"] > 0.1  # the case clips
  for name in names + (["kl"] if beta else []):
    assert_close(float(aux[name]) / tokens, want[name], terms=terms)
