"""What a preference run (``preference.loss`` set) builds in place of a supervised run's parts:
its loss with the reference it names, its abstract batch, its evaluation step, and the
per-pair means its metrics report.

The reference of dpo and ipo is the model with its LoRA adapters switched off
(``lora.adapters_off``: the same weights, no second copy in memory) on a LoRA run, else a
frozen copy of the starting weights (``live``, fp32 or bf16) that the train state carries as
its ``model_state``: sharded like the params, checkpointed with the state, never updated;
or, with ``precompute``, log-probs computed once before training that the batches carry
(``reference_logps``).
simpo and orpo have none. Every sum is over real pairs and divided by the global number of
pairs, the step's unit (``pair_units``), so K micro-batches and any number of devices give
one big batch's update and metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxstep import parallel
from jaxstep.core import chunked_loss, preference
from jaxstep.core.step import with_means
from jaxstep.data.pair_dataset import PairDataset, PairSplit, load_pair_eval_set
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.config.schema import check_eval_sets
from jaxstep.trainer.plan import reference_logps
from jaxstep.trainer.plan.reference_model import frozen_copy, loss_with_reference

# the metrics a step reports as sums over pairs and a record shows as means over them
MEAN_METRICS = (*preference.METRICS, *preference.ORPO_METRICS)

log = logging.getLogger("jaxstep")


def reference_kind(cfg: config_lib.Config) -> str:
  """``"none"`` (simpo, orpo), ``"adapters"`` (the LoRA base), ``"live"`` (a frozen copy)
  or ``"precompute"`` (log-probs in the batch, ``reference_logps``):
  ``preference.reference``, where ``auto`` picks the adapters on a LoRA run."""
  p = cfg.preference
  if p.loss in preference.REFERENCE_FREE:
    return "none"
  if p.reference != "auto":
    return p.reference
  return "adapters" if cfg.model.lora.rank else "live"


def reference_state(cfg: config_lib.Config, params):
  """The ``model_state`` a run with a live reference starts with: ``{"reference": a copy of
  params}`` in ``preference.reference_dtype`` (floating leaves); None for other runs."""
  if not cfg.preference.loss or reference_kind(cfg) != "live":
    return None
  return frozen_copy(params, cfg.preference.reference_dtype)


def loss_fn(cfg: config_lib.Config, apply_fn: Callable, *, train: bool = True) -> Callable:
  """The step's ``loss_fn`` for ``cfg.preference``: summed over the micro-batch's pairs;
  ``train=False`` runs the model without dropout (an evaluation)."""
  p = cfg.preference
  if not train:
    model = apply_fn

    def evaluated(params, inputs, *, rng=None, train=False, **kw):
      return model(params, inputs, train=False, **kw)

    apply_fn = chunked_loss.like(evaluated, model)
  options = {"simpo": {"gamma": p.gamma, "cpo_alpha": p.cpo_alpha}}
  options["orpo"] = {"orpo_lambda": p.orpo_lambda}
  options["dpo"] = options["ipo"] = {"rpo_alpha": p.rpo_alpha}
  options = dict(
    loss=p.loss, beta=p.beta, label_smoothing=p.label_smoothing, **options.get(p.loss, {})
  )
  options["chunk"] = cfg.model.loss_chunk
  build = lambda reference: preference.preference_loss(apply_fn, reference=reference, **options)  # noqa: E731
  return loss_with_reference(reference_kind(cfg), apply_fn, build)


def with_pair_means(step):
  """``step`` (a ``make_train_step`` result) whose metrics hold ``MEAN_METRICS`` as means
  over the global batch's real pairs (the step's N, ``metrics["tokens"]``), as TRL logs
  them; the loss is such a mean already."""
  return with_means(step, MEAN_METRICS, "tokens")


def abstract_batch(cfg: config_lib.Config, mesh: Mesh) -> dict:
  """A global batch of pairs' shapes, dtypes and sharding (what the loop feeds the step):
  with precomputed reference log-probs, their two float32 columns too."""
  sharding = parallel.batch_sharding(mesh)
  shape = (cfg.train.global_batch_size, cfg.train.seq_len)
  batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in _FIELDS}
  batch["pair_mask"] = jax.ShapeDtypeStruct(shape[:1], jnp.int32, sharding=sharding)
  if reference_kind(cfg) == "precompute":
    for name in preference.REF_FIELDS:
      batch[name] = jax.ShapeDtypeStruct(shape[:1], jnp.float32, sharding=sharding)
  return batch


_FIELDS = preference.PAIR_FIELDS


def make_eval_step(cfg: config_lib.Config, apply_fn: Callable) -> Callable:
  """``(params, batch, model_state) -> {"loss": Σ, "pairs": Σ pair_mask, **metric sums}``
  over a batch of pairs, the model without dropout (``model_state``: the state's, which
  holds a live reference; None otherwise)."""
  pair_loss = loss_fn(cfg, apply_fn, train=False)

  def eval_step(params, batch, model_state=None):
    rng = jax.random.PRNGKey(0)
    extra = () if model_state is None else (model_state,)
    loss_sum, aux = pair_loss(params, batch, rng, *extra)[:2]
    return {"loss": loss_sum, "pairs": preference.pair_units(batch), **aux}

  return eval_step


def eval_record(sums: dict, prefix: str = "eval_") -> dict:
  """An evaluation's record from the sums of ``make_eval_step`` over its batches: the mean
  loss and metrics per real pair, and the number of pairs."""
  pairs = max(float(sums["pairs"]), 1.0)
  record = {f"{prefix}loss": float(sums["loss"]) / pairs, f"{prefix}pairs": int(sums["pairs"])}
  record |= {f"{prefix}{k}": float(v) / pairs for k, v in sums.items() if k in MEAN_METRICS}
  return record


def load_eval_sets(cfg: config_lib.Config, dataset: PairDataset) -> dict[str, PairSplit]:
  """``eval.sets`` of a preference run: each a JSONL file of pairs, encoded and cut as the
  training pairs are, evaluated whole with the same loss and metrics."""
  t = cfg.train
  return {
    name: load_pair_eval_set(
      name, path, dataset, seq_len=t.seq_len, max_prompt_len=cfg.preference.prompt_len(t.seq_len)
    )
    for name, path in check_eval_sets(cfg.eval.sets).items()
  }


def split_with_reference(split: PairSplit, run, weights) -> PairSplit:
  """``split`` (all of an eval set's pairs) with its reference log-probs computed now under
  ``weights`` by the run's ``reference_fn``, batched as the training pairs are."""
  g, pairs = run.cfg.train.global_batch_size, split.pairs
  batches = range(-(-len(pairs) // g))
  logps = reference_logps.batch_logps(
    run.reference_fn, weights, pairs, g, run.batch_sharding, batches
  )
  pairs = dataclasses.replace(pairs, ref_logps=logps[: len(pairs)])
  return dataclasses.replace(split, pairs=pairs)


def cut_settings(cfg: config_lib.Config) -> dict:
  """``load_pair_dataset``'s batch-length settings: ``preference.length_buckets``, each
  length a multiple of 8 (and of the tensor size under sequence parallelism, which splits
  the positions); one bucket for an MoE model with an expert capacity, whose capacity
  counts the positions a batch holds, so a shorter batch would drop other tokens."""
  buckets = cfg.preference.length_buckets
  if getattr(cfg.model, "capacity_factor", 0) and buckets > 1:
    log.info(
      "preference.length_buckets %d → 1: model.capacity_factor %g sizes each expert by the "
      "batch's positions, so every batch keeps train.seq_len",
      buckets,
      cfg.model.capacity_factor,
    )
    buckets = 1
  m = cfg.mesh
  multiple = math.lcm(8, m.tensor if m.sequence_parallel and m.tensor > 1 else 1)
  return {"length_buckets": buckets, "length_multiple": multiple}
