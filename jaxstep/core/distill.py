"""Distillation from a frozen teacher with the student's vocabulary: the per-token divergences
and the step losses built on them, in the step's contract (sums over loss-masked tokens, the
step divides by their global count), so K micro-batches and any number of devices give one
big batch's update.

Modes (``DistillConfig.mode``), with ``p_S``, ``p_T`` the student's and teacher's next-token
distributions at a position:

- ``logits`` (offline KD, Hinton et al.; MaxText/Tunix): on supervised windows,
  ``l_t = α·τ²·KL(p_T^τ ‖ p_S^τ) + (1 − α)·NLL_t``, ``p^τ = softmax(logits / τ)``; τ² keeps
  the soft term's gradient on the scale of the hard one's as τ grows.
- ``gkd`` (Agarwal et al. 2024; TRL ``GKDTrainer.generalized_jsd_loss``): the generalized
  Jensen-Shannon divergence ``JSD_β = β·KL(p_T ‖ M) + (1 − β)·KL(p_S ‖ M)``,
  ``M = β·p_T + (1 − β)·p_S``; β = 0 is the forward ``KL(p_T ‖ p_S)``, β = 1 the reverse
  ``KL(p_S ‖ p_T)`` (TRL computes both ends exactly so; so does this). On supervised
  windows (TRL's ``lmbda`` 0) with logits ÷ τ; on the student's own samples (an RL run's
  rollouts, TRL's ``lmbda`` 1) at each completion position, under the sampler's temperature
  and allowed ids, where β = 1 is ``on_policy``'s full reverse KL.
- ``on_policy`` (Thinking Machines 2025, Qwen3's small models): on the student's own
  samples (an RL run's rollouts), the reverse KL ``KL(π ‖ π_T)`` at each completion
  position. ``estimator: full`` (the default) differentiates it whole, over the vocabulary,
  ``coef·Σ_v π(v)(log π(v) − log π_T(v))``: no sampling noise beyond the completions
  themselves. ``estimator: sampled`` is the policy gradient with the per-token advantage
  ``A_t = −coef·(log π_old(y_t) − log π_T(y_t))`` at the sampled token, through the RL
  loss's importance ratio and clip (``jaxstep.core.rl``; the Thinking Machines recipe): its
  expectation is the reverse KL's gradient, and its advantages are nearly all negative
  where the student is often wrong, a high-variance signal (docs/distill.md measures both).
  Both use the sampler's temperature and allowed ids for student and teacher alike (no
  top-k / top-p on the teacher, whose log-prob of a sampled token then stays finite).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxstep.core import chunked_loss, rl
from jaxstep.core.losses import argmax_hits, document_fields
from jaxstep.core.sampling import sampling_logits
from jaxstep.errors import ConfigError, DataError

MODES = ("auto", "logits", "gkd", "on_policy")
ESTIMATORS = ("sampled", "full")
TEACHER = "teacher"  # the teacher's params' key in the train state's model_state
# the sums the losses report, shown as means over the step's units (loss-masked tokens, or
# an RL run's completion tokens)
SFT_METRICS = ("distill/nll", "distill/divergence")
ON_POLICY_METRIC = "distill/reverse_kl"  # Σ mask·(log π_old − log π_T): the sampled estimate
NEG_FLOOR = -1e30  # a logit whose softmax probability is 0 in fp32, yet finite
GIVEN = "given"  # an RL batch's float32[B]: 1 where a row's completion is the data's (lmbda < 1)


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """Distillation from ``teacher`` (a model folder or a run directory with the student's
  vocabulary; empty: none). ``docs/distill.md`` says when each mode fits."""

  teacher: str = ""
  mode: str = "auto"  # auto (on_policy in an RL run, logits otherwise) | logits | gkd | on_policy
  alpha: float = 0.5  # logits: weight of the soft term (1 − alpha on the NLL)
  temperature: float = 1.0  # logits, gkd: τ of both distributions
  beta: float = 0.5  # gkd: β of the generalized JSD (0 forward KL, 1 reverse KL)
  estimator: str = "full"  # on_policy: full (the KL over the vocab) | sampled (per token)
  coef: float = 1.0  # on_policy, gkd on samples: weight of the divergence
  lmbda: float = 1.0  # gkd in an RL run: share of updates on the student's samples
  completion_column: str = "completion"  # gkd, lmbda < 1: the prompts file's completions
  teacher_dtype: str = "fp32"  # fp32 | bf16 (half the teacher's bytes)

  def __post_init__(self):
    if self.mode not in MODES:
      raise ConfigError(f"distill.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
    if self.estimator not in ESTIMATORS:
      raise ConfigError(
        f"distill.estimator must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}"
      )
    if self.mode == "gkd" and self.estimator == "sampled":
      raise ConfigError(
        "distill.estimator=sampled is on_policy's estimate of the reverse KL; gkd takes its "
        "divergence over the vocabulary: drop distill.estimator or use distill.mode=on_policy"
      )
    if self.teacher_dtype not in ("fp32", "bf16"):
      raise ConfigError(f"distill.teacher_dtype must be fp32 or bf16, got {self.teacher_dtype!r}")
    if not 0.0 <= self.alpha <= 1.0 or not 0.0 <= self.beta <= 1.0:
      raise ConfigError(
        f"distill.alpha and distill.beta are weights in [0, 1], got {self.alpha}, {self.beta}"
      )
    if not (math.isfinite(self.temperature) and self.temperature > 0):
      raise ConfigError(f"distill.temperature must be > 0, got {self.temperature}")
    if not (math.isfinite(self.coef) and self.coef > 0):
      raise ConfigError(f"distill.coef must be > 0, got {self.coef}")
    if not 0.0 <= self.lmbda <= 1.0:
      raise ConfigError(f"distill.lmbda is a share in [0, 1], got {self.lmbda}")
    if self.lmbda < 1 and self.mode != "gkd":
      raise ConfigError(
        f"distill.lmbda={self.lmbda} mixes the data's completions into the student's samples, "
        f"which distill.mode=gkd does; {self.mode} takes none: use distill.mode=gkd"
      )

  def check_sampler(self, top_k: int, top_p: float) -> None:
    """``ConfigError`` for a sampler's truncation with ``lmbda`` < 1: a data completion's
    token outside the student's top-k / top-p has log-prob −inf there."""
    if self.lmbda < 1 and (top_k or top_p < 1):
      raise ConfigError(
        f"distill.lmbda={self.lmbda} trains on the data's completions too, whose tokens may "
        f"lie outside rl.top_k / rl.top_p's truncation of the student: drop rl.top_k and rl.top_p"
      )

  def resolved_mode(self, rl_run: bool) -> str:
    """The mode a run uses: ``auto`` is ``on_policy`` in an RL run, ``logits`` otherwise."""
    if self.mode == "auto":
      return "on_policy" if rl_run else "logits"
    return self.mode


def check_completion_column(lmbda: float, column: str, columns) -> None:
  """``DataError`` unless the prompts' ``columns`` hold ``column``, the given completions
  that ``lmbda`` < 1 trains on, each one ``completion_text`` reads."""
  if lmbda == 1:
    return
  if column not in columns:
    raise DataError(
      f"distill.lmbda={lmbda} trains a share of updates on the prompts' own completions, but "
      f"the prompts have no {column!r} column (they have {sorted(columns)}): name it with "
      f"distill.completion_column"
    )
  for value in columns[column]:
    completion_text(value, column)


def completion_text(value, column: str) -> str:
  """A prompts file's given completion: a string, or TRL's conversational form, a list
  holding one assistant message (its ``content``)."""
  if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
    if value[0].get("role") == "assistant":
      value = value[0].get("content")
  if not isinstance(value, str) or not value:
    raise DataError(
      f"a prompt's {column!r} must be a non-empty string or [{{'role': 'assistant', "
      f"'content': …}}], got {value!r:.60}"
    )
  return value


def kl(p_logp, q_logp):
  """``KL(p ‖ q) = Σ_v p(v)·(log p(v) − log q(v))`` over the last axis (0 where p is, even
  where both are −inf: ids outside the sampler's allowed ones; the difference is masked
  before the product, so its gradient there is 0, not 0·inf = NaN)."""
  p = jnp.exp(p_logp)
  return jnp.sum(p * jnp.where(p > 0, p_logp - q_logp, 0.0), axis=-1)


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float = 1.0):
  """TRL's generalized JSD per position (module docstring), fp32; ``[..., V]`` → ``[...]``."""
  s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  if beta == 0:
    return kl(t, s)
  if beta == 1:
    return kl(s, t)
  mixture = jnp.logaddexp(s + math.log1p(-beta), t + math.log(beta))
  return beta * kl(t, mixture) + (1 - beta) * kl(s, mixture)


def soft_kl(student_logits, teacher_logits, temperature: float = 1.0):
  """``τ²·KL(p_T^τ ‖ p_S^τ)`` per position, fp32: offline KD's soft term."""
  s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  return temperature**2 * kl(t, s)


def teacher_loss(build: Callable, teacher_apply: Callable) -> Callable:
  """The step's 4-argument ``loss_fn(params, batch, rng, model_state)`` from
  ``build(teacher) -> loss_fn(params, batch, rng)``, where ``teacher(inputs, **fields) ->
  logits`` runs ``teacher_apply`` without dropout on the frozen params the train state's
  ``model_state`` carries under ``TEACHER`` (the state comes back unchanged): the form a
  ``jaxstep.Trainer`` of your own takes, with ``model_state={TEACHER: teacher_params}``;
  its checkpoints leave the teacher out, so give it again to resume."""

  def loss_fn(params, batch, rng, model_state):
    frozen = model_state[TEACHER]

    def teacher(inputs, **fields):
      return teacher_apply(frozen, inputs, rng=None, train=False, **fields)

    teacher.emits_hidden = getattr(teacher_apply, "emits_hidden", False)
    return (*build(teacher)(params, batch, rng), model_state)

  return loss_fn


def supervised_loss(
  apply_fn: Callable, teacher: Callable, d: DistillConfig, mode: str, chunk: int | str = 0
):
  """The step ``loss_fn(params, batch, rng) -> (Σ mask·l_t, aux)`` of ``logits`` or ``gkd``
  on a supervised batch (``inputs``, ``targets``, ``loss_mask``; document fields go to both
  models). ``teacher(inputs, **fields) -> logits``, frozen. ``aux``: ``correct``, and the
  sums ``distill/nll`` and ``distill/divergence`` (the soft term before its weights).

  ``chunk`` (``model.loss_chunk``): where it asks for chunks and both models give their
  final hidden states and head (``emits_hidden``), the per-token terms are computed a chunk
  of tokens at a time from them (``chunked_loss.chunked_pair_map``), so neither model's
  ``[B, S, V]`` logits exist whole; the same sums to float rounding."""

  def per_token(logits, target, targets):
    """``(NLL, divergence, argmax hits)`` at each position."""
    logits = logits.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if mode == "logits":
      div = soft_kl(logits, target, d.temperature)
    else:
      div = generalized_jsd(logits, target, d.beta, d.temperature)
    return nll, div, jax.lax.stop_gradient(argmax_hits(logits, targets).astype(jnp.float32))

  def loss_fn(params, batch, rng):
    fields = document_fields(batch)
    inputs, targets = batch["inputs"], batch["targets"]
    mask = batch["loss_mask"].astype(jnp.float32)
    size = _chunk_size(apply_fn, teacher, chunk, inputs.size)
    if size:
      student = apply_fn(params, inputs, rng=rng, train=True, as_hidden=True, **fields)
      frozen = teacher(inputs, as_hidden=True, **fields)
      terms = chunked_loss.chunked_pair_map(per_token, student, frozen, targets, size)
    else:
      logits = apply_fn(params, inputs, rng=rng, train=True, **fields)
      terms = per_token(logits, jax.lax.stop_gradient(teacher(inputs, **fields)), targets)
    nll, div, hits = (jnp.sum(mask * x) for x in terms)
    total = d.alpha * div + (1 - d.alpha) * nll if mode == "logits" else div
    return total, {"correct": hits, "distill/nll": nll, "distill/divergence": div}

  return loss_fn


def _chunk_size(apply_fn, teacher, chunk, tokens: int) -> int:
  """Tokens per chunk of a distillation loss (0: the whole logits of both models)."""
  both = getattr(apply_fn, "emits_hidden", False) and getattr(teacher, "emits_hidden", False)
  if chunk == 0 or not both:
    return 0
  return chunked_loss.chunk_size(chunk, tokens, apply_fn.vocab_size)


def on_policy_loss(
  apply_fn: Callable, teacher: Callable, d: DistillConfig, mode: str = "on_policy", **options
) -> Callable:
  """The step ``loss_fn(params, batch, rng)`` of distillation on an RL batch, the student's
  own samples (``jaxstep.core.rl``'s fields; its ``advantages`` are not read): ``options``
  are ``rl.grpo_loss``'s (the clip, β, the sampler's settings, ``loss_norm``, ``chunk``).
  ``mode`` ``on_policy``: the reverse KL (``d.estimator``); ``gkd``: the generalized JSD
  with ``d.beta`` over the vocabulary at each completion position, on the sampler's
  distributions (its temperature and allowed ids; β = 1 is on-policy's full reverse KL).
  ``aux`` adds ``distill/reverse_kl``, ``Σ mask·(log π_old − log π_T)`` at the sampled
  tokens.

  A batch may hold ``given`` (float32[B], GKD with ``lmbda`` < 1): 1 marks a row whose
  completion is the data's, not a sample; no sampler drew it, so the policy's own log-probs
  (without gradient) stand in for ``old_logps`` there (the importance ratio 1, the sampler
  check passed by construction); the JSD is the loss on every row alike.

  The per-token terms (the student's log-probs and entropy as the RL loss reads them, the
  teacher's log-prob of each sampled token, the full estimator's reverse KL) come from both
  models' logits, or, where ``chunk`` asks for chunks and both models ``emits_hidden``,
  from their final hidden states a chunk of tokens at a time (``supervised_loss``)."""
  dist = dict(temperature=options.get("temperature", 1.0), allowed=options.get("allowed"))
  policy_dist = {**dist, "top_k": options.get("top_k", 0), "top_p": options.get("top_p", 1.0)}
  if mode not in ("on_policy", "gkd"):
    raise ConfigError(f"distillation on samples is on_policy or gkd, got {mode!r}")
  full = mode == "gkd" or d.estimator == "full"

  def per_token(logits, target, targets):
    """``(log π, entropy, log π_T, divergence)`` at each position (0 if unused)."""
    logp, entropy = rl.token_logps(logits, targets, **policy_dist)
    teacher_all = jax.nn.log_softmax(_scaled(target, dist), axis=-1)  # what token_logps takes
    teacher_logp = jnp.take_along_axis(teacher_all, targets[..., None], axis=-1)[..., 0]
    if not full:
      return logp, entropy, teacher_logp, jnp.zeros_like(logp)
    if mode == "gkd":
      return logp, entropy, teacher_logp, _allowed_jsd(logits, target, dist, d.beta)
    student = jax.nn.log_softmax(_scaled(logits, dist), axis=-1)
    return logp, entropy, teacher_logp, kl(student, teacher_all)

  def loss_fn(params, batch, rng):
    mask = batch["completion_mask"].astype(jnp.float32)
    inputs, targets = batch["inputs"], batch["targets"]
    size = _chunk_size(apply_fn, teacher, options.get("chunk", 0), inputs.size)
    if size:
      student = apply_fn(params, inputs, rng=rng, train=True, as_hidden=True)
      terms = chunked_loss.chunked_pair_map(
        per_token, student, teacher(inputs, as_hidden=True), targets, size
      )
    else:
      logits = apply_fn(params, inputs, rng=rng, train=True)
      terms = per_token(logits, jax.lax.stop_gradient(teacher(inputs)), targets)
    logp, entropy, teacher_logps, reverse_kl = terms
    if GIVEN in batch:  # the data's completions: the policy being trained stands in for the
      given = (batch[GIVEN][:, None] > 0) & (mask > 0)  # sampler it never had
      batch = {
        **batch,
        "old_logps": jnp.where(given, jax.lax.stop_gradient(logp), batch["old_logps"]),
      }
    gap = jnp.where(mask > 0, batch["old_logps"] - teacher_logps, 0.0)
    policy = rl.grpo_loss(rl.given_terms(logp, entropy), **options)
    if d.estimator == "sampled":
      total, aux = policy(params, {**batch, "advantages": -d.coef * gap}, rng)
    else:  # the policy term is 0 (no advantage); β's KL to the reference stays; gkd too
      zero = jnp.zeros(mask.shape[:1], jnp.float32)
      total, aux = policy(params, {**batch, "advantages": zero}, rng)
      total = total + d.coef * _normed(reverse_kl, mask, options)
    return total, {**aux, ON_POLICY_METRIC: jnp.sum(gap)}

  return loss_fn


def _scaled(logits, dist: dict):
  return sampling_logits(logits, dist["allowed"], dist["temperature"], 0, 1.0)


def _allowed_jsd(student_logits, teacher_logits, dist: dict, beta: float):
  """``generalized_jsd`` over the ids the sampler may draw, at its temperature. The others
  are −inf in ``_scaled``; they enter the JSD as a finite floor instead, whose probability
  is exactly 0, because the mixture's ``logaddexp`` of two −inf has a NaN gradient."""
  floor = lambda x: jnp.maximum(_scaled(x, dist), NEG_FLOOR)  # noqa: E731
  return generalized_jsd(floor(student_logits), floor(teacher_logits), beta)


def _normed(per_token, mask, options: dict):
  """``Σ mask·per_token`` as the RL loss sums for its ``loss_norm`` (``sequences``: each
  row's token mean)."""
  if options.get("loss_norm", "tokens") == "sequences":
    lengths = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    return jnp.sum(jnp.sum(per_token * mask, axis=-1) / lengths)
  return jnp.sum(per_token * mask)
