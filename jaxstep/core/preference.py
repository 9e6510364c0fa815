"""Preference optimization losses (DPO, IPO, SimPO, ORPO) in the step's contract.

**The batch: one row per pair.** A preference batch holds B (prompt, chosen, rejected)
pairs, one row each, so the step's micro-batch split (rows k, k+K, …) never separates a
chosen sequence from its rejected one. Every field has leading dimension B:

- ``chosen_inputs``, ``rejected_inputs``: int32[B, S], prompt + completion tokens,
  right-padded;
- ``chosen_targets``, ``rejected_targets``: int32[B, S], the inputs shifted
  (``targets[t] = tokens[t + 1]``);
- ``chosen_mask``, ``rejected_mask``: {0,1}[B, S], 1 where ``targets[t]`` is a completion
  token;
- ``pair_mask``: {0,1}[B], 1 for a real pair, 0 for a row padding the last batch;
- optional ``ref_chosen_logps``, ``ref_rejected_logps``: float32[B], the reference model's
  log-probs summed over completion tokens (precomputed, e.g. once per dataset).

Prompt tokens are never in a loss: a mask is 1 on completion targets only. Chosen and
rejected may have different lengths S; the shorter is padded (mask 0) for the one forward. A real
pair needs at least one completion token on each side (the token-mean losses divide by it).

**Units.** ``loss_fn`` returns ``Σ_pairs pair_mask · loss_pair`` and ``pair_units`` counts
``Σ pair_mask``, so with ``make_train_step(..., units_fn=pair_units)`` every micro-gradient
is divided by the number of real pairs in the GLOBAL batch and the update is that of the
mean over all pairs, whatever K and however the padding rows fall (a mean of per-micro-batch
means would weight a micro-batch holding padding rows more). Each pair's loss needs its
chosen and rejected sequence together, which is why the unit is the pair and not the token.

**Log-probs.** ``π = Σ_t mask_t · log p(target_t)`` is a SUM over a completion's tokens
(``sequence_logps``, fp32), ``π̄ = π / n`` its MEAN over the ``n`` completion tokens. Which
one a loss uses follows TRL 1.16, whose trainers are the reference implementation:

- ``dpo`` (``DPOTrainer``, ``loss_type="sigmoid"``): sums. ``h = (π_c − ref_c) −
  (π_r − ref_r)``, loss ``−(1 − ε)·logσ(β·h) − ε·logσ(−β·h)`` (ε = ``label_smoothing``, the
  conservative DPO of TRL's ``CPOTrainer`` sigmoid; TRL 1.16's DPO sigmoid ignores ε).
- ``ipo`` (``DPOTrainer``, ``loss_type="ipo"``): MEANS. TRL divides each summed log-ratio by
  its completion length, ``h̄ = (π_c − ref_c)/n_c − (π_r − ref_r)/n_r``, loss
  ``(h̄ − 1/(2β))²``; summed ratios would make the squared target scale with length.
- dpo and ipo take ``rpo_alpha``·(−π̄_c) added (RPO; TRL 1.16: ``loss_type=["sigmoid",
  "sft"]``, ``loss_weights=[1, rpo_alpha]``): the chosen completion's NLL keeps its
  likelihood from falling while the margin grows; reported as ``nll_loss``.
- ``simpo`` (``CPOTrainer``, ``loss_type="simpo"``): reference-free, MEANS. ``z = β·(π̄_c −
  π̄_r) − γ``, loss ``−(1 − ε)·logσ(z) − ε·logσ(−z) + cpo_alpha·(−π̄_c)``. ``cpo_alpha``
  defaults to 0 (SimPO itself; TRL's ``CPOConfig`` defaults to 1, "CPO-SimPO").
- ``orpo`` (``ORPOTrainer``): reference-free, MEANS. ``log odds(π̄) = π̄ − log(1 − e^π̄)``
  (``log1mexp``, stable on both sides of −ln 2 as TRL's), loss ``−π̄_c + λ·(−logσ(log
  odds(π̄_c) − log odds(π̄_r)))``, λ = ``orpo_lambda`` (TRL's ``ORPOConfig.beta``).

The NLL terms of dpo and ipo (``rpo_alpha``), simpo (``cpo_alpha``) and orpo are the chosen
completion's token-mean NLL *per pair*. TRL averages them over every token of the batch
instead (and ORPO's over the prompt tokens too): a mean over a batch's tokens is not a sum
over pairs, so no K micro-batches could reproduce it exactly. They agree on a batch of one
pair (for ORPO, one whose prompt is a single token: then no prompt token is predicted).

**Rewards** (the metrics, TRL's names): dpo, ipo ``β·(π − ref)`` on sums; simpo ``β·π̄``;
orpo ``λ·π̄``. ``logps/*`` is ``π`` for dpo and ipo, ``π̄`` for simpo and orpo, as TRL logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from jaxstep.core import chunked_loss
from jaxstep.errors import BatchError, ConfigError

LOSSES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
SIDES = ("chosen", "rejected")
PAIR_FIELDS = tuple(f"{side}_{part}" for side in SIDES for part in ("inputs", "targets", "mask"))
REF_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")
# the metrics every loss reports, summed over real pairs (divided by N they are TRL's means)
METRICS = (
  "rewards/chosen",
  "rewards/rejected",
  "rewards/accuracies",
  "rewards/margins",
  "logps/chosen",
  "logps/rejected",
)
# ORPO's own extra metrics in TRL: the NLL term, mean logσ(log odds ratio), mean log odds ratio
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


# auto: for dpo and ipo the LoRA base (adapters) on a LoRA run, else a frozen copy (live);
# for simpo and orpo none. precompute: the starting weights' log-probs, computed once
PREFERENCE_REFERENCES = ("auto", "adapters", "live", "precompute", "none")
REFERENCE_DTYPES = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
  """Preference optimization on (prompt, chosen, rejected) pairs (``docs/preference.md``): with
  ``loss`` set, ``data.path`` holds pairs and the run minimizes that loss; "" is supervised."""

  loss: str = ""  # "" (supervised) | dpo | ipo | simpo | orpo
  beta: float = 0.1  # β of dpo, ipo and simpo (ipo's target margin is 1/(2β))
  label_smoothing: float = 0.0  # ε of dpo and simpo (conservative DPO), in [0, 0.5]
  gamma: float = 0.5  # simpo: the target reward margin γ
  cpo_alpha: float = 0.0  # simpo: weight of the chosen completion's NLL (1 = CPO-SimPO)
  orpo_lambda: float = 0.1  # orpo: weight λ of the odds-ratio term
  rpo_alpha: float = 0.0  # dpo, ipo: weight of the chosen completion's NLL (RPO)
  max_prompt_len: int = 0  # prompt tokens kept, its last ones (0 = half of train.seq_len)
  reference: str = "auto"  # auto | adapters (LoRA base) | live (frozen copy) | precompute | none
  reference_dtype: str = "fp32"  # live: the frozen copy's dtype (bf16 halves its bytes)
  reference_file: str = ""  # precompute: where the log-probs live ("" = RUN/reference_logps.npz)
  # a global batch of pairs is cut to the shortest of seq_len·i/B (i = 1…B) holding its
  # pairs: B compiled shapes at most; 1: every batch at train.seq_len
  length_buckets: int = 4

  def __post_init__(self):
    if self.loss and self.loss not in LOSSES:
      raise ConfigError(
        f"preference.loss must be one of {', '.join(LOSSES)} (or empty for a supervised "
        f"run), got {self.loss!r}"
      )
    if self.reference not in PREFERENCE_REFERENCES:
      raise ConfigError(
        f"preference.reference must be one of {', '.join(PREFERENCE_REFERENCES)}, got "
        f"{self.reference!r}"
      )
    if self.loss in REFERENCE_FREE and self.reference not in ("auto", "none"):
      raise ConfigError(
        f"preference.loss={self.loss} is reference-free; drop preference.reference={self.reference}"
      )
    if self.beta <= 0:
      raise ConfigError(f"preference.beta must be > 0, got {self.beta}")
    if not 0.0 <= self.label_smoothing <= 0.5:
      raise ConfigError(
        f"preference.label_smoothing must be in [0, 0.5], got {self.label_smoothing}"
      )
    if self.label_smoothing and self.loss in ("ipo", "orpo"):
      raise ConfigError(f"preference.label_smoothing has no meaning for {self.loss}; drop it")
    if self.rpo_alpha < 0 or (self.rpo_alpha and self.loss not in ("dpo", "ipo")):
      raise ConfigError(
        f"preference.rpo_alpha is a weight >= 0 of dpo and ipo, got {self.rpo_alpha} with "
        f"loss={self.loss or '(none)'}"
      )
    if self.max_prompt_len < 0:
      raise ConfigError(f"preference.max_prompt_len must be >= 0, got {self.max_prompt_len}")
    if self.length_buckets < 1:
      raise ConfigError(
        f"preference.length_buckets must be >= 1 (1: every batch at train.seq_len), got "
        f"{self.length_buckets}"
      )
    if self.reference_dtype not in REFERENCE_DTYPES:
      raise ConfigError(
        f"preference.reference_dtype must be one of {', '.join(REFERENCE_DTYPES)}, got "
        f"{self.reference_dtype!r}"
      )

  def prompt_len(self, seq_len: int) -> int:
    """The prompt tokens a pair keeps: ``max_prompt_len``, or half of ``seq_len`` for 0."""
    return self.max_prompt_len or max(seq_len // 2, 1)


def pair_units(batch: Mapping[str, jax.Array]) -> jax.Array:
  """The step's N for a preference batch: the number of real pairs, ``Σ pair_mask`` (int32)."""
  if "pair_mask" not in batch:
    raise BatchError(
      f"pair_units counts batch['pair_mask'] (1 per real pair, 0 per padding row), but the "
      f"batch has keys {sorted(batch)}"
    )
  return jnp.sum(batch["pair_mask"], dtype=jnp.int32)


def sequence_logps(logits: jax.Array, targets: jax.Array, mask: jax.Array):
  """``(Σ_t mask·log p(targets_t), Σ_t mask)`` per row, fp32: a completion's summed
  log-prob and its token count. Logits are upcast before the log-softmax, whatever the
  compute dtype. Shapes ``[B, S, V]``, ``[B, S]``, ``[B, S]`` → ``[B]``, ``[B]``."""
  logp = -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  mask = mask.astype(jnp.float32)
  return jnp.sum(logp * mask, axis=-1), jnp.sum(mask, axis=-1)


def log1mexp(x: jax.Array) -> jax.Array:
  """``log(1 − eˣ)`` for ``x < 0``, accurate on both sides of −ln 2 (TRL's ORPO form):
  ``log1p(−eˣ)`` where eˣ is small, ``log(−expm1(x))`` where it is close to 1."""
  return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def _smoothed_sigmoid_loss(z, label_smoothing):
  return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def pair_losses(
  loss: str,
  logps: tuple[jax.Array, jax.Array],
  tokens: tuple[jax.Array, jax.Array],
  ref_logps: tuple[jax.Array, jax.Array] | None = None,
  *,
  beta: float = 0.1,
  label_smoothing: float = 0.0,
  gamma: float = 0.5,
  cpo_alpha: float = 0.0,
  orpo_lambda: float = 0.1,
  rpo_alpha: float = 0.0,
) -> dict[str, jax.Array]:
  """Per-pair losses and metrics from log-probs, the math of the module docstring.

  Args:
    logps: ``(π_c, π_r)``, float32[B]: log-probs SUMMED over each completion.
    tokens: ``(n_c, n_r)``: each completion's token count (clamped to ≥ 1 for the means).
    ref_logps: ``(ref_c, ref_r)``, summed likewise; dpo and ipo only.

  Returns:
    ``{"loss": [B], "rewards/chosen": [B], "rewards/rejected": [B], "logps/chosen": [B],
    "logps/rejected": [B]}``, plus ``ORPO_METRICS`` for orpo; no reduction over pairs.
  """
  (chosen, rejected), (n_c, n_r) = logps, tokens
  mean_c = chosen / jnp.maximum(n_c, 1.0)
  mean_r = rejected / jnp.maximum(n_r, 1.0)
  out = {}
  if loss in ("dpo", "ipo"):
    ratio_c, ratio_r = chosen - ref_logps[0], rejected - ref_logps[1]
    if loss == "dpo":
      out["loss"] = _smoothed_sigmoid_loss(beta * (ratio_c - ratio_r), label_smoothing)
    else:
      h = ratio_c / jnp.maximum(n_c, 1.0) - ratio_r / jnp.maximum(n_r, 1.0)
      out["loss"] = (h - 1.0 / (2.0 * beta)) ** 2
    if rpo_alpha:
      out["nll_loss"] = -mean_c
      out["loss"] = out["loss"] + rpo_alpha * out["nll_loss"]
    rewards, logged = (beta * ratio_c, beta * ratio_r), (chosen, rejected)
  elif loss == "simpo":
    z = beta * (mean_c - mean_r) - gamma
    out["loss"] = _smoothed_sigmoid_loss(z, label_smoothing) - cpo_alpha * mean_c
    rewards, logged = (beta * mean_c, beta * mean_r), (mean_c, mean_r)
  elif loss == "orpo":
    log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))
    ratio = jax.nn.log_sigmoid(log_odds)
    out["loss"] = -mean_c - orpo_lambda * ratio
    out.update({"nll_loss": -mean_c, "log_odds_ratio": ratio, "log_odds_chosen": log_odds})
    rewards, logged = (orpo_lambda * mean_c, orpo_lambda * mean_r), (mean_c, mean_r)
  else:
    raise ConfigError(f"loss={loss!r} is not a preference loss; choose one of {LOSSES}")
  out["rewards/chosen"], out["rewards/rejected"] = rewards
  out["logps/chosen"], out["logps/rejected"] = logged
  return out


def check_pair_batch(batch: Mapping[str, jax.Array], loss: str, has_reference: bool) -> bool:
  """Raises ``BatchError`` naming what a preference batch lacks; returns whether the
  reference log-probs come from the batch (``ref_*_logps``) rather than ``reference=``.
  Runs on static keys and shapes, so it fails at trace time."""
  missing = [name for name in (*PAIR_FIELDS, "pair_mask") if name not in batch]
  if missing:
    raise BatchError(
      f"a preference batch needs the fields {missing} (one row per pair; see "
      f"jaxstep.core.preference), but it has {sorted(batch)}"
    )
  for side in SIDES:
    shapes = {batch[f"{side}_{part}"].shape for part in ("inputs", "targets", "mask")}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
      raise BatchError(
        f"{side}_inputs, _targets and _mask must share one [B, S] shape; got {shapes}"
      )
  refs = [name for name in REF_FIELDS if name in batch]
  if len(refs) == 1:
    raise BatchError(f"the batch holds {refs[0]} without its partner: give both of {REF_FIELDS}")
  if loss in REFERENCE_FREE or refs or has_reference:
    return bool(refs)
  raise BatchError(
    f"loss={loss!r} needs reference log-probs: the batch fields {list(REF_FIELDS)} (summed "
    f"over completion tokens) or preference_loss(..., reference=apply_fn of the reference)"
  )


def _pad_to(x: jax.Array, length: int) -> jax.Array:
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1])))


def concatenated(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """``inputs``, ``targets`` and ``mask`` of ``[chosen; rejected]``: 2B rows of one length
  (the longer side's), so both sides of every pair go through ONE forward, as TRL's
  ``concatenated_forward`` does."""
  length = max(batch[f"{side}_inputs"].shape[1] for side in SIDES)
  return {
    part: jnp.concatenate([_pad_to(batch[f"{side}_{part}"], length) for side in SIDES])
    for part in ("inputs", "targets", "mask")
  }


def _halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  half = x.shape[0] // 2
  return x[:half], x[half:]


def row_logps(model: Callable, params, rows: Mapping[str, jax.Array], chunk=0, **call):
  """``sequence_logps`` of ``rows`` under ``model(params, inputs, **call)``: from its
  logits, or, when ``chunk`` (``model.loss_chunk``) asks and ``model`` ``emits_hidden``,
  from its hidden states and head a chunk of tokens at a time (``chunked_loss``)."""
  inputs, targets, mask = rows["inputs"], rows["targets"], rows["mask"]
  if chunk != 0 and getattr(model, "emits_hidden", False):
    size = chunked_loss.chunk_size(chunk, inputs.size, model.vocab_size)
    if size:
      h, w = model(params, inputs, as_hidden=True, **call)
      logp = chunked_loss.chunked_logps(h, w, targets, size)
      mask = mask.astype(jnp.float32)
      return jnp.sum(logp * mask, axis=-1), jnp.sum(mask, axis=-1)
  return sequence_logps(model(params, inputs, **call), targets, mask)


def reference_logps(reference: Callable, params, rows: Mapping[str, jax.Array], chunk=0):
  """``(ref_c, ref_r)``: the summed log-probs of the chosen and rejected completions of
  ``rows`` (``concatenated``'s 2B rows) under ``reference(params, inputs) -> logits``, without
  gradient (``row_logps``: in chunks when ``chunk`` asks). The loss's reference and the
  precomputed ones (``preference.reference: precompute``) both come from here."""
  params = jax.lax.stop_gradient(params)
  return _halves(jax.lax.stop_gradient(row_logps(reference, params, rows, chunk)[0]))


def preference_loss(
  apply_fn: Callable,
  *,
  loss: str = "dpo",
  beta: float = 0.1,
  label_smoothing: float = 0.0,
  gamma: float | None = None,
  cpo_alpha: float | None = None,
  orpo_lambda: float | None = None,
  rpo_alpha: float | None = None,
  reference: Callable | None = None,
  chunk: int | str = 0,
) -> Callable:
  """A step ``loss_fn(params, micro_batch, rng) -> (loss_sum, aux)`` for preference pairs.

  Use it with ``make_train_step(..., units_fn=pair_units)``: ``loss_sum`` is the per-pair
  loss summed over real pairs (``pair_mask``) and ``aux`` holds ``METRICS`` (plus
  ``ORPO_METRICS`` for orpo) summed likewise (``rewards/accuracies`` counts pairs whose
  chosen reward beats the rejected one), so each divided by the step's N is TRL's logged
  mean over the global batch.

  Args:
    apply_fn: ``(params, inputs, *, rng, train) -> logits``, called once on the 2B rows of
      ``[chosen; rejected]``. TRL turns dropout off for preference training
      (``disable_dropout=True``); build the model without dropout to match it.
    loss: ``"dpo"``, ``"ipo"``, ``"simpo"`` or ``"orpo"`` (the module docstring).
    beta: β of dpo, ipo (1/(2β) is IPO's target) and simpo; orpo does not read it.
    label_smoothing: ε of dpo and simpo, in [0, 0.5].
    gamma: SimPO's target margin γ (default 0.5, TRL's ``simpo_gamma``).
    cpo_alpha: weight of SimPO's chosen NLL (default 0: SimPO; TRL's CPO defaults to 1).
    orpo_lambda: ORPO's odds-ratio weight λ (default 0.1, TRL's ``ORPOConfig.beta``).
    rpo_alpha: weight of dpo's and ipo's chosen NLL (default 0: none).
    reference: ``(params, inputs) -> logits`` of the reference model (dpo, ipo), called
      on the same 2B rows under ``stop_gradient``; used when the batch holds no
      ``ref_*_logps`` (precomputed ones win).
    chunk: ``model.loss_chunk``: the log-probs of a model that ``emits_hidden`` (policy and
      reference) from its hidden states in chunks of tokens (``row_logps``); 0: whole logits.

  Raises:
    ConfigError (a ``ValueError``): an unknown loss, an option the loss does not take
    (``reference=`` for the reference-free simpo and orpo), or a value out of range.
  """
  if loss not in LOSSES:
    raise ConfigError(f"loss={loss!r} is not a preference loss; choose one of {LOSSES}")
  given = {"gamma": gamma, "cpo_alpha": cpo_alpha, "orpo_lambda": orpo_lambda}
  given["rpo_alpha"] = rpo_alpha
  takes = {"simpo": ("gamma", "cpo_alpha"), "orpo": ("orpo_lambda",)}.get(loss, ("rpo_alpha",))
  extra = [f"{name}=" for name, value in given.items() if value is not None and name not in takes]
  if reference is not None and loss in REFERENCE_FREE:
    extra.append("reference=")
  if label_smoothing and loss in ("ipo", "orpo"):
    extra.append("label_smoothing=")
  if extra:
    raise ConfigError(
      f"loss={loss!r} does not take {', '.join(extra)}"
      + (" (it is reference-free)" if "reference=" in extra else "")
    )
  if not 0.0 <= label_smoothing <= 0.5:
    raise ConfigError(f"label_smoothing={label_smoothing} must lie in [0, 0.5]")
  if beta <= 0:
    raise ConfigError(f"beta={beta} must be positive")
  options = dict(
    beta=beta,
    label_smoothing=label_smoothing,
    gamma=0.5 if gamma is None else gamma,
    cpo_alpha=0.0 if cpo_alpha is None else cpo_alpha,
    orpo_lambda=0.1 if orpo_lambda is None else orpo_lambda,
    rpo_alpha=rpo_alpha or 0.0,
  )

  def loss_fn(params, batch, rng):
    ref_from_batch = check_pair_batch(batch, loss, reference is not None)
    rows = concatenated(batch)
    sums, counts = row_logps(apply_fn, params, rows, chunk, rng=rng, train=True)
    real = batch["pair_mask"] > 0
    # padding rows get harmless log-probs before any nonlinearity (no NaN, even in a gradient)
    safe = lambda x, fill: jnp.where(real, x, fill)  # noqa: E731
    logps = tuple(safe(x, -1.0) for x in _halves(sums))
    tokens = tuple(safe(x, 1.0) for x in _halves(counts))
    ref = None
    if loss not in REFERENCE_FREE:
      if ref_from_batch:
        ref = tuple(batch[name].astype(jnp.float32) for name in REF_FIELDS)
      else:
        ref = reference_logps(reference, params, rows, chunk)
      ref = tuple(safe(x, -1.0) for x in ref)
    per_pair = pair_losses(loss, logps, tokens, ref, **options)
    weight = real.astype(jnp.float32)
    total = lambda x: jnp.sum(weight * x)  # noqa: E731
    chosen, rejected = per_pair["rewards/chosen"], per_pair["rewards/rejected"]
    aux = {name: total(value) for name, value in per_pair.items() if name != "loss"}
    aux["rewards/accuracies"] = total((chosen > rejected).astype(jnp.float32))
    aux["rewards/margins"] = total(chosen - rejected)
    return total(per_pair["loss"]), aux

  return loss_fn
