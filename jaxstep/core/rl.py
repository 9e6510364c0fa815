"""Reinforcement learning with verifiable rewards: group advantages and the clipped policy
loss of GRPO and its variants, in the step's contract (a sum, divided by a global count), so
K micro-batches and any number of devices give one big batch's update.

**Batch** (one row per completion; a micro-batch never splits a row):

- ``inputs``, ``targets``: int32[B, S], prompt + completion shifted as a supervised window
  (``targets[t] = inputs[t + 1]``); ``completion_mask``: 1 where the target is a completion
  token (never a prompt token, never padding);
- ``advantages``: float32[B], the completion's advantage (``group_advantages``);
- ``old_logps``: float32[B, S], each target's log-prob under the policy that sampled it
  (θ_old of the μ optimizer passes over one rollout), at the same temperature;
- optional ``ref_logps``: float32[B, S], the reference's (β > 0 without a ``reference=``).

**Objective** (per completion token t, TRL 1.16 ``GRPOTrainer._compute_loss``, token-level
importance sampling): ``ρ_t = exp(log π(t) − log π_old(t))``, ``l_t = −min(ρ_t·A,
clip(ρ_t, 1 − ε_low, 1 + ε_high)·A) + β·kl_t`` with the k3 estimator ``kl_t = exp(r_t) −
r_t − 1``, ``r_t = log π_ref(t) − log π(t)`` (≥ 0, unbiased for KL(π‖π_ref)). Log-probs
come from ``logits / temperature``, the sampler's scaling.

**Normalization** (``loss_norm``), each a sum the loss returns and a count ``units`` sums
over the global batch:

- ``tokens``: ``Σ m_t·l_t / Σ m_t`` over every completion token of the global batch (DAPO;
  TRL ``loss_type="dapo"``, and ``"bnpo"`` on one batch);
- ``sequences``: each completion's token mean, then the mean over completions (GRPO's
  paper; TRL ``"grpo"``);
- ``constant``: ``Σ m_t·l_t / (n_completions · max_new_tokens)`` (Dr. GRPO; TRL
  ``"dr_grpo"``).

TRL normalizes ``grpo``, ``bnpo`` and ``dr_grpo`` per micro-batch and averages the
micro-batches, which weighs a micro-batch of short completions like one of long ones; here
every count is the global batch's, so the split does not matter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from jaxstep.core.sampling import sampling_logits
from jaxstep.errors import BatchError, ConfigError

ADVANTAGES = ("grpo", "dr_grpo", "rloo")
LOSS_NORMS = ("tokens", "sequences", "constant")
FIELDS = ("inputs", "targets", "completion_mask", "advantages", "old_logps")
STD_EPS = 1e-4  # TRL's: (r − mean) / (std + 1e-4), so an all-equal group gives 0, not NaN
# the metrics the loss reports, each a sum; ``METRIC_UNITS`` names the count that makes each
# a mean: completion tokens or completions
METRIC_UNITS = {
  "kl": "completion_tokens",
  "entropy": "completion_tokens",
  "clip_ratio/low_mean": "completion_tokens",
  "clip_ratio/high_mean": "completion_tokens",
  "clip_ratio/region_mean": "completion_tokens",
  "logp_gap": "completion_tokens",  # |log π − log π_old|; first pass: sampler vs trainer
}


def group_advantages(rewards: jax.Array, kind: str = "grpo") -> jax.Array:
  """Advantages of ``rewards`` float32[P, G] (P prompts, G completions each), same shape.

  - ``grpo``: ``(r − mean_g) / (std_g + 1e-4)``, std with Bessel's correction (TRL's
    ``scale_rewards="group"``);
  - ``dr_grpo``: ``r − mean_g`` (Dr. GRPO: no division by the std, TRL's
    ``scale_rewards="none"``);
  - ``rloo``: ``r − mean of the other G − 1`` (leave-one-out baseline, TRL's RLOO).

  A group whose rewards are all equal gets advantage 0 under every kind.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 2:
    raise ConfigError(f"rewards must be [prompts, completions per prompt], got {rewards.shape}")
  g = rewards.shape[1]
  mean = jnp.mean(rewards, axis=1, keepdims=True)
  if kind == "dr_grpo":
    return rewards - mean
  if g < 2:
    raise ConfigError(f"advantage={kind!r} needs at least 2 completions per prompt, got {g}")
  if kind == "grpo":
    std = jnp.sqrt(jnp.sum((rewards - mean) ** 2, axis=1, keepdims=True) / (g - 1))
    return (rewards - mean) / (std + STD_EPS)
  if kind == "rloo":
    others = (jnp.sum(rewards, axis=1, keepdims=True) - rewards) / (g - 1)
    return rewards - others
  raise ConfigError(f"advantage must be one of {', '.join(ADVANTAGES)}, got {kind!r}")


def token_logps(logits, targets, temperature=1.0, *, top_k=0, top_p=1.0, allowed=None):
  """``(log p(target_t), entropy_t)`` per position, fp32, under the distribution the
  sampler draws from (``jaxstep.core.sampling.sampling_logits``: the ``allowed`` ids,
  ÷ ``temperature``, top-k / top-p), so the sampler's and the trainer's log-probs of a
  drawn token agree. A target outside the filter gets −inf. Shapes ``[B, S, V]``,
  ``[B, S]`` → ``[B, S]``, ``[B, S]``. With a filter on, every position sorts its
  vocabulary, as the sampler does at each step."""
  scaled = sampling_logits(logits, allowed, temperature, top_k, top_p)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  p = jnp.exp(logp)
  entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
  return picked, entropy


def units_fn(loss_norm: str, max_new_tokens: int | None = None) -> Callable:
  """The step's N for ``loss_norm``: completion tokens (``tokens``), completions with a
  token (``sequences``), or completions × ``max_new_tokens`` (``constant``)."""
  _check_norm(loss_norm, max_new_tokens)

  def units(batch: Mapping[str, jax.Array]) -> jax.Array:
    mask = batch["completion_mask"]
    if loss_norm == "tokens":
      return jnp.sum(mask, dtype=jnp.int32)
    sequences = jnp.sum(jnp.any(mask > 0, axis=-1), dtype=jnp.int32)
    return sequences if loss_norm == "sequences" else sequences * max_new_tokens

  return units


def _check_norm(loss_norm: str, max_new_tokens: int | None) -> None:
  if loss_norm not in LOSS_NORMS:
    raise ConfigError(f"loss_norm must be one of {', '.join(LOSS_NORMS)}, got {loss_norm!r}")
  if loss_norm == "constant" and not (max_new_tokens and max_new_tokens > 0):
    raise ConfigError("loss_norm='constant' divides by max_new_tokens: give it (> 0)")


def check_rl_batch(batch: Mapping[str, jax.Array], beta: float, has_reference: bool) -> bool:
  """Raises ``BatchError`` naming what an RL batch lacks; returns whether the reference
  log-probs come from the batch (``ref_logps``). Runs on static keys and shapes."""
  missing = [name for name in FIELDS if name not in batch]
  if missing:
    raise BatchError(
      f"an RL batch needs the fields {missing} (one row per completion; see jaxstep.core.rl), "
      f"but it has {sorted(batch)}"
    )
  shape = batch["inputs"].shape
  for name in ("targets", "completion_mask", "old_logps", "ref_logps"):
    if name in batch and batch[name].shape != shape:
      raise BatchError(f"{name} has shape {batch[name].shape}; inputs have {shape}")
  if batch["advantages"].shape != shape[:1]:
    raise BatchError(f"advantages must be float32[{shape[0]}], got {batch['advantages'].shape}")
  if beta and "ref_logps" not in batch and not has_reference:
    raise BatchError(
      f"beta={beta} weighs a KL to the reference: give the batch ref_logps or "
      f"grpo_loss(..., reference=apply_fn of the reference), or set beta=0"
    )
  return "ref_logps" in batch


def per_token_terms(logps, old_logps, advantages, ref_logps, *, epsilon_low, epsilon_high, beta):
  """``(l_t, kl_t, low_clipped_t, high_clipped_t)``, each [B, S] (unmasked): the module
  docstring's per-token loss and TRL's clip indicators."""
  ratio = jnp.exp(logps - old_logps)
  adv = advantages[:, None]
  clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
  loss = -jnp.minimum(ratio * adv, clipped * adv)
  kl = jnp.zeros_like(logps)
  if beta:
    r = ref_logps - logps
    kl = jnp.exp(r) - r - 1.0
    loss = loss + beta * kl
  low = (ratio < 1.0 - epsilon_low) & (adv < 0)
  high = (ratio > 1.0 + epsilon_high) & (adv > 0)
  return loss, kl, low, high


def grpo_loss(
  apply_fn: Callable,
  *,
  loss_norm: str = "tokens",
  epsilon_low: float = 0.2,
  epsilon_high: float = 0.2,
  beta: float = 0.0,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  allowed=None,
  max_new_tokens: int | None = None,
  reference: Callable | None = None,
) -> Callable:
  """A step ``loss_fn(params, micro_batch, rng) -> (loss_sum, aux)`` for GRPO-family
  objectives; use it with ``make_train_step(..., units_fn=units_fn(loss_norm, …))``.

  ``loss_sum`` is the module docstring's sum for ``loss_norm`` over the micro-batch; ``aux``
  holds ``completion_tokens`` and ``completions`` (counts), ``kl``, ``entropy`` and the
  ``clip_ratio/*`` indicators summed over completion tokens (÷ ``completion_tokens`` they
  are TRL's means), and ``logp_gap``, ``Σ |log π − log π_old|`` likewise (on the first pass
  over a rollout, the gap between the sampler's log-probs and the trainer's).

  Args:
    apply_fn: ``(params, inputs, *, rng, train) -> logits``.
    epsilon_low, epsilon_high: the clip range ``[1 − ε_low, 1 + ε_high]`` (DAPO's
      clip-higher: ε_high > ε_low).
    beta: weight of the k3 KL to the reference (0: none needed).
    temperature, top_k, top_p, allowed: the sampler's settings (``allowed``: bool[V], the
      ids a completion may hold, or None); the trainer's log-probs use the same
      distribution (``token_logps``), so they equal the sampler's for the same params.
    max_new_tokens: the sampler's limit; ``constant`` divides by it.
    reference: ``(params, inputs) -> logits`` of the reference (β > 0), called under
      ``stop_gradient`` when the batch holds no ``ref_logps``.
  """
  _check_norm(loss_norm, max_new_tokens)
  if not (0.0 <= epsilon_low < 1.0 and epsilon_high >= 0.0):
    raise ConfigError(
      f"need 0 <= epsilon_low < 1 and epsilon_high >= 0, got {epsilon_low}, {epsilon_high}"
    )
  if beta < 0 or temperature <= 0:
    raise ConfigError(f"need beta >= 0 and temperature > 0, got {beta}, {temperature}")
  options = dict(epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta)
  dist = dict(temperature=temperature, top_k=top_k, top_p=top_p, allowed=allowed)

  def loss_fn(params, batch, rng):
    ref_from_batch = check_rl_batch(batch, beta, reference is not None)
    logits = apply_fn(params, batch["inputs"], rng=rng, train=True)
    mask = batch["completion_mask"].astype(jnp.float32)
    logps, entropy = token_logps(logits, batch["targets"], **dist)
    logps = jnp.where(mask > 0, logps, 0.0)  # prompt and padding targets may lie outside
    ref = None
    if beta:
      if ref_from_batch:
        ref = batch["ref_logps"].astype(jnp.float32)
      else:
        ref_logits = jax.lax.stop_gradient(
          reference(jax.lax.stop_gradient(params), batch["inputs"])
        )
        ref = jnp.where(mask > 0, token_logps(ref_logits, batch["targets"], **dist)[0], 0.0)
    old = batch["old_logps"].astype(jnp.float32)
    adv = batch["advantages"].astype(jnp.float32)
    loss, kl, low, high = per_token_terms(logps, old, adv, ref, **options)
    lengths = jnp.sum(mask, axis=-1)
    if loss_norm == "sequences":
      total = jnp.sum(jnp.sum(loss * mask, axis=-1) / jnp.maximum(lengths, 1.0))
    else:
      total = jnp.sum(loss * mask)
    masked = lambda x: jnp.sum(x.astype(jnp.float32) * mask)  # noqa: E731
    aux = {
      "completion_tokens": jnp.sum(mask),
      "completions": jnp.sum(lengths > 0).astype(jnp.float32),
      "kl": masked(kl),
      "entropy": masked(jax.lax.stop_gradient(entropy)),
      "clip_ratio/low_mean": masked(low),
      "clip_ratio/high_mean": masked(high),
      "clip_ratio/region_mean": masked(low | high),
      "logp_gap": masked(jnp.abs(jax.lax.stop_gradient(logps) - old)),
    }
    return total, aux

  return loss_fn
