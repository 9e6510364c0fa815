"""What an RL run (``rl.rewards`` named) builds in place of a supervised run's parts: its
loss with the reference it names, its normalization count, its abstract batch, and the
per-token means its metrics report.

The reference of the KL term (``rl.beta`` > 0) is the model with its LoRA adapters switched
off on a LoRA run (no second copy in memory), else a frozen fp32 copy of the starting
weights carried in the state's ``model_state`` (``live``); with ``rl.beta`` 0 there is none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxstep import parallel
from jaxstep.core import distill, rl
from jaxstep.core.step import with_means
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan.reference_model import frozen_copy, loss_with_reference


def reference_kind(cfg: config_lib.Config) -> str:
  """``"none"`` (β = 0), ``"adapters"`` (the LoRA base) or ``"live"`` (a frozen copy)."""
  r = cfg.rl
  if not r.beta or r.reference == "none":
    return "none"
  if r.reference != "auto":
    return r.reference
  return "adapters" if cfg.model.lora.rank else "live"


def reference_state(cfg: config_lib.Config, params):
  """``{"reference": a copy of params}`` in ``rl.reference_dtype`` (floating leaves) for a
  live reference; None otherwise."""
  if not cfg.rl.rewards or reference_kind(cfg) != "live":
    return None
  return frozen_copy(params, cfg.rl.reference_dtype)


def sampler_allowed(cfg: config_lib.Config):
  """The ids the sampler may draw (``generation.sampling.allowed_ids`` of the run's
  tokenizer), for the trainer's log-probs to use the same distribution."""
  return jnp.asarray(_allowed(cfg.model.vocab_size, cfg.data.tokenizer))


@functools.lru_cache(maxsize=8)
def _allowed(vocab_size: int, tokenizer: str):
  from jaxstep.data.tokenizer_loading import load_tokenizer
  from jaxstep.generation.sampling import allowed_ids

  return allowed_ids(vocab_size, load_tokenizer(tokenizer))


def grpo_options(r: rl.RLConfig, allowed) -> dict:
  """``rl.grpo_loss``'s settings from ``r``: the objective's and the sampler's (``allowed``:
  the ids it may draw), and the log-prob check's tolerance."""
  return dict(
    loss_norm=r.loss_norm,
    epsilon_low=r.epsilon_low,
    epsilon_high=r.epsilon_high,
    beta=r.beta,
    temperature=r.temperature,
    top_k=r.top_k,
    top_p=r.top_p,
    allowed=allowed,
    max_new_tokens=r.max_new_tokens,
    gap_tolerance=r.logp_tolerance,
  )


def loss_fn(cfg: config_lib.Config, apply_fn: Callable, allowed) -> Callable:
  """The step's ``loss_fn`` for ``cfg.rl`` (``rl.grpo_loss``), 4-argument with a live
  reference (the copy rides in the state's ``model_state``)."""
  options = {**grpo_options(cfg.rl, allowed), "chunk": cfg.model.loss_chunk}
  build = lambda reference: rl.grpo_loss(apply_fn, reference=reference, **options)  # noqa: E731
  return loss_with_reference(reference_kind(cfg), apply_fn, build)


def units_fn(cfg: config_lib.Config) -> Callable:
  return rl.units_fn(cfg.rl.loss_norm, cfg.rl.max_new_tokens)


def with_token_means(step):
  """``step`` whose metrics hold ``rl.METRIC_UNITS``' sums (and on-policy distillation's
  reverse KL) as means over the global batch's completion tokens, as TRL logs them."""
  return with_means(step, (*rl.METRIC_UNITS, distill.ON_POLICY_METRIC), "completion_tokens")


def abstract_batch(cfg: config_lib.Config, mesh: Mesh) -> dict:
  """A global batch of completions' shapes, dtypes and sharding."""
  sharding = parallel.batch_sharding(mesh)
  shape = (cfg.train.global_batch_size, cfg.train.seq_len)
  batch = {
    k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    for k in ("inputs", "targets", "completion_mask")
  }
  batch["old_logps"] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
  batch["advantages"] = jax.ShapeDtypeStruct(shape[:1], jnp.float32, sharding=sharding)
  if cfg.distill.teacher and cfg.distill.lmbda < 1:  # which rows are the data's completions
    batch[distill.GIVEN] = jax.ShapeDtypeStruct(shape[:1], jnp.float32, sharding=sharding)
  return batch
