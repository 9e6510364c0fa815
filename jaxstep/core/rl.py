"""Reinforcement learning with verifiable rewards: group advantages and the clipped policy
loss of GRPO and its variants, in the step's contract (a sum, divided by a global count), so
K micro-batches and any number of devices give one big batch's update.

**Batch** (one row per completion; a micro-batch never splits a row):

- ``inputs``, ``targets``: int32[B, S], prompt + completion shifted as a supervised window
  (``targets[t] = inputs[t + 1]``); ``completion_mask``: 1 where the target is a completion
  token (never a prompt token, never padding);
- ``advantages``: float32[B], the completion's advantage (``group_advantages``), or
  float32[B, S], one per target (on-policy distillation's per-token advantages);
- ``old_logps``: float32[B, S], each target's log-prob under the policy that sampled it
  (θ_old of the μ optimizer passes over one rollout), at the same temperature;
- optional ``ref_logps``: float32[B, S], the reference's (β > 0 without a ``reference=``).

**Objective** (per completion token t, TRL 1.16 ``GRPOTrainer._compute_loss``, token-level
importance sampling): ``ρ_t = exp(log π(t) − log π_old(t))``, ``l_t = −min(ρ_t·A,
clip(ρ_t, 1 − ε_low, 1 + ε_high)·A) + β·kl_t`` with the k3 estimator ``kl_t = exp(r_t) −
r_t − 1``, ``r_t = log π_ref(t) − log π(t)`` (≥ 0, unbiased for KL(π‖π_ref)). Log-probs
come from ``logits / temperature``, the sampler's scaling; the policy's also under its top-k
/ top-p truncation (the distribution the token was drawn from), the reference's without.

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

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.core import chunked_loss
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
# with ``gap_tolerance``: Σ mask·[|log π − log π_old| > tolerance], a count (not a mean)
GAP_EXCESS = "logp_gap_excess"


def group_advantages(rewards, kind: str = "grpo") -> np.ndarray:
  """Advantages of ``rewards`` [P, G] (P prompts, G completions each), float32, same shape;
  computed on the host in float64 (rewards come from Python functions).

  - ``grpo``: ``(r − mean_g) / (std_g + 1e-4)``, std with Bessel's correction (TRL's
    ``scale_rewards="group"``);
  - ``dr_grpo``: ``r − mean_g`` (Dr. GRPO: no division by the std, TRL's
    ``scale_rewards="none"``);
  - ``rloo``: ``r − mean of the other G − 1`` (leave-one-out baseline, TRL's RLOO).

  A group whose rewards are all equal gets advantage exactly 0 under every kind: the
  deviations are taken from the group's first reward, which they share; so does a group of
  one completion (a run that needs groups refuses G < 2 when it starts).
  """
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 2:
    raise ConfigError(f"rewards must be [prompts, completions per prompt], got {rewards.shape}")
  if kind not in ADVANTAGES:
    raise ConfigError(f"advantage must be one of {', '.join(ADVANTAGES)}, got {kind!r}")
  g = rewards.shape[1]
  if g < 2:  # a group of one has nothing to compare with (on-policy distillation's rollouts)
    return np.zeros(rewards.shape, np.float32)
  shifted = rewards - rewards[:, :1]  # all-equal groups: exact zeros from here on
  centred = shifted - shifted.mean(axis=1, keepdims=True)
  if kind == "dr_grpo":
    out = centred
  elif kind == "grpo":
    std = np.sqrt(np.sum(centred**2, axis=1, keepdims=True) / (g - 1))
    out = centred / (std + STD_EPS)
  else:  # rloo: r_i − (Σ_j r_j − r_i) / (G − 1) = G / (G − 1) · (r_i − mean)
    out = centred * g / (g - 1)
  return out.astype(np.float32)


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


def given_terms(logps: jax.Array, entropy: jax.Array) -> Callable:
  """A policy for ``grpo_loss`` whose per-token ``(log-probs, entropy)`` of the batch's
  targets are already computed (traced from the params being differentiated, so their
  gradient flows): a loss that needs more terms of the same logits computes them in one
  pass (``distill.on_policy_loss``)."""

  def model(*_, **__):
    raise TypeError("given_terms stands for terms already computed; it has no logits")

  model.token_terms = (logps, entropy)
  return model


def _token_terms(model: Callable, params, batch, chunk, dist: dict, **call):
  """``token_logps`` of ``batch``'s targets under ``model(params, inputs, **call)``: from
  its logits, or from its hidden states in chunks (``chunk``, a model that
  ``emits_hidden``); a ``given_terms`` model's own."""
  if hasattr(model, "token_terms"):
    return model.token_terms
  inputs, targets = batch["inputs"], batch["targets"]
  if chunk != 0 and getattr(model, "emits_hidden", False):
    size = chunked_loss.chunk_size(chunk, inputs.size, model.vocab_size)
    if size:
      h, w = model(params, inputs, as_hidden=True, **call)
      terms = lambda logits, t: token_logps(logits, t, **dist)  # noqa: E731
      return chunked_loss.chunked_map(terms, h, w, targets, size)
  return token_logps(model(params, inputs, **call), targets, **dist)


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
  if batch["advantages"].shape not in (shape[:1], shape):
    raise BatchError(
      f"advantages must be float32[{shape[0]}] (one per row) or {list(shape)} (one per "
      f"target), got {batch['advantages'].shape}"
    )
  if beta and "ref_logps" not in batch and not has_reference:
    raise BatchError(
      f"beta={beta} weighs a KL to the reference: give the batch ref_logps or "
      f"grpo_loss(..., reference=apply_fn of the reference), or set beta=0"
    )
  return "ref_logps" in batch


def per_token_terms(logps, old_logps, advantages, ref_logps, *, epsilon_low, epsilon_high, beta):
  """``(l_t, kl_t, low_clipped_t, high_clipped_t)``, each [B, S] (unmasked): the module
  docstring's per-token loss and TRL's clip indicators; ``advantages`` one per row [B] or
  one per target [B, S]."""
  ratio = jnp.exp(logps - old_logps)
  adv = advantages[:, None] if advantages.ndim == 1 else advantages
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
  gap_tolerance: float | None = None,
  chunk: int | str = 0,
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
      ``stop_gradient`` when the batch holds no ``ref_logps``, and scored under the
      temperature and ``allowed`` ids only (as TRL scores it): once the policy drifts, its
      draw may fall outside the reference's top-k or top-p, where a truncated reference
      would give log π_ref = −inf and an infinite KL term.
    gap_tolerance: also count (``aux["logp_gap_excess"]``) the completion tokens whose
      ``|log π − log π_old|`` exceeds it: on a rollout's first pass, where π is the policy
      that sampled, any such token means the training pass sees another distribution than
      the sampler did (a sum, so exact over micro-batches and devices, unlike a max).
    chunk: ``model.loss_chunk``: the policy's and reference's per-token log-probs and
      entropy from the hidden states of a model that ``emits_hidden``, a chunk of tokens
      at a time (``chunked_loss.chunked_map``); 0: from the whole logits.
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
  # the reference without the sampler's truncation: a drawn token outside the reference's
  # top-k / top-p would get −inf and the k3 term an infinite value
  ref_dist = dict(dist, top_k=0, top_p=1.0)

  def loss_fn(params, batch, rng):
    ref_from_batch = check_rl_batch(batch, beta, reference is not None)
    mask = batch["completion_mask"].astype(jnp.float32)
    logps, entropy = _token_terms(apply_fn, params, batch, chunk, dist, rng=rng, train=True)
    logps = jnp.where(mask > 0, logps, 0.0)  # prompt and padding targets may lie outside
    ref = None
    if beta:
      if ref_from_batch:
        ref = batch["ref_logps"].astype(jnp.float32)
      else:
        frozen = jax.lax.stop_gradient(params)
        ref = _token_terms(reference, frozen, batch, chunk, ref_dist)[0]
        ref = jax.lax.stop_gradient(ref)
        ref = jnp.where(mask > 0, ref, 0.0)
    old = batch["old_logps"].astype(jnp.float32)
    adv = batch["advantages"].astype(jnp.float32)
    loss, kl, low, high = per_token_terms(logps, old, adv, ref, **options)
    lengths = jnp.sum(mask, axis=-1)
    if loss_norm == "sequences":
      total = jnp.sum(jnp.sum(loss * mask, axis=-1) / jnp.maximum(lengths, 1.0))
    else:
      total = jnp.sum(loss * mask)
    masked = lambda x: jnp.sum(x.astype(jnp.float32) * mask)  # noqa: E731
    gap = jnp.abs(jax.lax.stop_gradient(logps) - old)
    aux = {
      "completion_tokens": jnp.sum(mask),
      "completions": jnp.sum(lengths > 0).astype(jnp.float32),
      "kl": masked(kl),
      "entropy": masked(jax.lax.stop_gradient(entropy)),
      "clip_ratio/low_mean": masked(low),
      "clip_ratio/high_mean": masked(high),
      "clip_ratio/region_mean": masked(low | high),
      "logp_gap": masked(gap),
    }
    if gap_tolerance is not None:
      aux[GAP_EXCESS] = masked(gap > gap_tolerance)
    return total, aux

  return loss_fn


REFERENCES = ("auto", "adapters", "live", "none")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """RL with verifiable rewards (``docs/rl.md``): with ``rewards`` named, ``data.path`` holds
  prompts (with the columns the rewards read), each update samples ``train.global_batch_size``
  completions — ``num_generations`` per prompt — scores them and trains on them."""

  rewards: tuple[str, ...] = ()  # bundled names or module:function; empty: not an RL run
  reward_weights: tuple[float, ...] = ()  # one per reward (default 1 each)
  num_generations: int = 8  # G: completions per prompt, one group
  iterations: int = 1  # μ: optimizer updates on each rollout
  max_new_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  advantage: str = "grpo"  # grpo | dr_grpo | rloo
  loss_norm: str = "tokens"  # tokens | sequences | constant
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  beta: float = 0.0  # weight of the k3 KL to the reference (0: no reference)
  reference: str = "auto"  # auto (adapters on a LoRA run, else live) | adapters | live | none
  reference_dtype: str = "fp32"  # live: the frozen copy's dtype (bf16 halves its bytes)
  logp_tolerance: float = 0.02  # max |sampler − trainer| log-prob gap (nats) before a stop
  reward_timeout: float = 300.0  # seconds each call of a reward function may take (0: none)
  filter_groups: bool = False  # dynamic sampling: train only on groups whose rewards differ
  max_draws: int = 4  # with filter_groups: at most this many rollouts sampled per update

  def check_groups(self, distilling: bool) -> None:
    """``ConfigError`` for groups of one completion where the advantage compares a group's
    completions (a distillation run learns from its teacher and takes G = 1), and for
    dynamic sampling, which keeps groups by their rewards, in a distillation run."""
    if self.num_generations < 2 and self.advantage != "dr_grpo" and not distilling:
      raise ConfigError(
        f"rl.num_generations must be >= 2 for advantage={self.advantage} (a group's baseline), "
        f"got {self.num_generations}"
      )
    if distilling and self.filter_groups:
      raise ConfigError(
        "rl.filter_groups keeps groups whose rewards differ, but on-policy distillation learns "
        "from the teacher, not the rewards: drop rl.filter_groups"
      )

  def __post_init__(self):
    object.__setattr__(self, "rewards", tuple(self.rewards))
    object.__setattr__(self, "reward_weights", tuple(float(w) for w in self.reward_weights))
    if self.advantage not in ADVANTAGES:
      raise ConfigError(
        f"rl.advantage must be one of {', '.join(ADVANTAGES)}, got {self.advantage!r}"
      )
    if self.loss_norm not in LOSS_NORMS:
      raise ConfigError(
        f"rl.loss_norm must be one of {', '.join(LOSS_NORMS)}, got {self.loss_norm!r}"
      )
    if self.reference not in REFERENCES:
      raise ConfigError(
        f"rl.reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}"
      )
    if self.reference_dtype not in ("fp32", "bf16"):
      raise ConfigError(f"rl.reference_dtype must be fp32 or bf16, got {self.reference_dtype!r}")
    if self.filter_groups and self.num_generations < 2:
      raise ConfigError(
        "rl.filter_groups needs rl.num_generations >= 2: a group of one completion never "
        "holds rewards that differ"
      )
    for name in ("iterations", "max_new_tokens", "num_generations", "max_draws"):
      if getattr(self, name) < 1:
        raise ConfigError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
    if self.temperature <= 0:
      raise ConfigError(
        f"rl.temperature must be > 0 (the trainer's log-probs divide by it), got {self.temperature}"
      )
    if not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ConfigError(f"need 0 < rl.top_p <= 1 and rl.top_k >= 0, got {self.top_p}, {self.top_k}")
    if not (0.0 <= self.epsilon_low < 1.0 and self.epsilon_high >= 0.0):
      raise ConfigError("need 0 <= rl.epsilon_low < 1 and rl.epsilon_high >= 0")
    if self.beta < 0 or self.logp_tolerance <= 0:
      raise ConfigError("need rl.beta >= 0 and rl.logp_tolerance > 0")
    t = self.reward_timeout
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
      raise ConfigError(
        f"rl.reward_timeout must be a finite number of seconds >= 0 (0: no limit), "
        f"got {self.reward_timeout!r}"
      )
