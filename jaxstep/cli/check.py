"""``jaxstep check [--config FILE] [key=value …]``: is accumulation exact here?
``jaxstep check --against-hf DIR``: does a Hugging Face folder run the same here as in
transformers?

Runs one update of the config's model, optimizer and first global batch twice — with the
config's K micro-steps (``auto`` resolved as ``train`` resolves it; 2 if K is 1) and with K
= 1 — and compares stage by stage: logits → loss → gradients → clipped update → new params.
Prints max abs / rel error per stage with PASS/FAIL against the precision's tolerance and
names the first stage that diverges. Exit 0 only if all pass. Dropout is switched off for
the comparison (its masks depend on the micro-batch split).

With ``--against-hf DIR`` (no config): the model of the local folder DIR (Llama, Mistral,
Qwen2, Qwen3) runs a fixed batch of 2 × 16 token ids in jaxstep and in transformers (fp32,
eager attention), compared stage by stage: embeddings → each block's output → final norm
→ logits, PASS/FAIL at 1e-4 relative, naming the first stage that diverges. Exit 0 if all
pass, 1 if one diverges, 2 if the folder is refused or torch/transformers are missing
(``pip install 'jaxstep[test]'``).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jaxstep.cli._common import Parser, add_config_args, report
from jaxstep.core.check import CheckReport, check_accumulation
from jaxstep.errors import JaxstepError


def _compared_k(k: int, global_batch_size: int) -> int:
  """The K checked against K = 1: the plan's, or when that is 1 the smallest K > 1 that
  divides G (K = 1 against itself would say nothing)."""
  if k > 1:
    return k
  return next((c for c in range(2, global_batch_size + 1) if global_batch_size % c == 0), 2)


def check_config(cfg, loss_fn=None) -> CheckReport:
  """``check_accumulation`` on ``cfg``'s model, optimizer and first global batch (dropout
  off), resolved by the same plan ``train`` uses."""
  from jaxstep import data, models
  from jaxstep.core import preference
  from jaxstep.core.optim import make_optimizer
  from jaxstep.trainer.plan import preference_plan, steps, teacher
  from jaxstep.trainer.plan.numbers import make_plan
  from jaxstep.trainer.saved_run import teacher as saved_teacher

  # one device compares K micro-batches with one batch: a tensor split does not apply here
  # (tests/test_tensor_parallel.py compares tensor meshes with one device)
  cfg = dataclasses.replace(
    cfg, mesh=dataclasses.replace(cfg.mesh, tensor=1, sequence_parallel=False)
  )
  plan = make_plan(cfg, read_data=True)
  cfg, dataset, t = plan.cfg, plan.dataset, plan.cfg.train
  model_cfg = dataclasses.replace(cfg.model, dropout=0.0)
  apply_fn, params = models.build(model_cfg, jax.random.PRNGKey(t.seed))
  if cfg.model.lora.base_quant != "none":
    apply_fn, params = _on_quantized_base(cfg, apply_fn, params)
  optimizer = _frozen_left_alone(make_optimizer(cfg.optim, plan.schedule_steps), cfg, params)
  if cfg.rl.rewards:  # an RL run: its first rollout, sampled from the starting weights
    return _check_rl(cfg, dataset, apply_fn, params, optimizer)
  batch = data.global_batch(dataset.train, t.seed, 0, 0, t.global_batch_size, dataset.pad_id)
  pairs = bool(cfg.preference.loss)  # a preference run: its loss over pairs, N = the pairs
  batch = jax.tree.map(jnp.asarray, batch)
  if pairs and preference_plan.reference_kind(cfg) == "precompute":  # as the run reads them
    batch |= _reference_columns(cfg, apply_fn, params, batch)
  if loss_fn is None:  # as train builds it: router losses of an MoE model, a teacher's
    loss_fn = steps.training_loss(cfg, apply_fn)[0]
  reference = preference_plan.reference_state(cfg, params) if pairs else None
  return check_accumulation(
    loss_fn,
    params,
    batch,
    optimizer,
    _compared_k(t.grad_accum_steps, t.global_batch_size),
    apply_fn=None if pairs else apply_fn,  # the logits stage reads single sequences
    units_fn=preference.pair_units if pairs else None,
    precision=t.precision,
    model_state=teacher.model_state(cfg, reference, saved_teacher.load(cfg, dataset.tokenizer)[0]),
  )


def _check_rl(cfg, dataset, apply_fn, params, optimizer) -> CheckReport:
  """K micro-batches against one on the RL run's first rollout (its first prompts, its
  rewards and advantages), with its loss and normalization count."""
  from jaxstep.core import distill
  from jaxstep.generation import Generator
  from jaxstep.trainer.plan import rl_plan, steps, teacher
  from jaxstep.trainer.rl import rewards, rollout
  from jaxstep.trainer.rl.source import rollout_seed
  from jaxstep.trainer.saved_run import teacher as saved_teacher

  t, r = cfg.train, cfg.rl
  prompts = rollout.prompt_batch(
    dataset.train, t.seed, 0, 0, t.global_batch_size // r.num_generations
  )
  generator = Generator(cfg.model, None, dataset.tokenizer)
  loaded = rewards.load_rewards(r.rewards, r.reward_weights)
  d = cfg.distill
  lmbda = d.lmbda if d.teacher else 1.0
  distill.check_completion_column(lmbda, d.completion_column, dataset.train.columns)
  first = rollout.sampled_or_given(  # the run's first rollout, sampled or given
    t.seed, 0, lmbda,
    lambda: rollout.sample(generator, params, prompts, r, loaded, seq_len=t.seq_len,
                           seed=rollout_seed(t.seed, 0)),
    lambda: rollout.given_rollout(dataset.tokenizer, prompts, r, loaded, d.completion_column,
                                  seq_len=t.seq_len),
  )  # fmt: skip
  loss_fn = steps.training_loss(cfg, apply_fn)[0]  # a teacher's, router losses: as train's
  reference = rl_plan.reference_state(cfg, params)
  return check_accumulation(
    loss_fn,
    params,
    jax.tree.map(jnp.asarray, first.batch),
    optimizer,
    _compared_k(t.grad_accum_steps, t.global_batch_size),
    units_fn=rl_plan.units_fn(cfg),
    precision=t.precision,
    model_state=teacher.model_state(cfg, reference, saved_teacher.load(cfg, dataset.tokenizer)[0]),
  )


def _reference_columns(cfg, apply_fn, params, batch) -> dict:
  """The precomputed reference log-probs of ``batch``'s pairs under the starting weights."""
  from jaxstep.core import preference
  from jaxstep.trainer.plan import reference_logps

  weights = reference_logps.reference_params(cfg, params)
  logps = reference_logps.pair_logps(apply_fn, weights, batch)
  return dict(zip(preference.REF_FIELDS, logps, strict=True))


def _frozen_left_alone(optimizer, cfg, params):
  """``optimizer`` on the leaves the run trains (``train``'s choice: LoRA adapters,
  ``optim.trainable``), the others' updates zero, as the step leaves them: clipping reads
  the trainable leaves only, and a frozen leaf whose gradient is rounding noise around zero
  (a key bias) is not blown up to ±lr by Adam's normalization and reported as a divergence."""
  import optax

  from jaxstep.core import freeze
  from jaxstep.trainer.plan import steps

  trainable = steps.trainable(cfg)
  if trainable is None:
    return optimizer
  labels = jax.tree.map(lambda t: "train" if t else "frozen", freeze.mask(params, trainable))
  return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)


def main(argv=None) -> int:
  from jaxstep.trainer.config import loading as config_lib

  p = Parser(
    prog="jaxstep check",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_config_args(p)
  p.add_argument(
    "--against-hf",
    metavar="DIR",
    default=None,
    help="compare a local Hugging Face model folder with transformers, stage by stage "
    "(needs torch and transformers; takes no config)",
  )
  args = p.parse_intermixed_args(argv)
  if args.against_hf is not None and (args.config is not None or args.overrides):
    p.error("--against-hf takes no --config or key=value overrides")
  try:
    if args.against_hf is not None:
      from jaxstep.models.hf_parity import parity_report

      result = parity_report(args.against_hf)
    else:
      result = check_config(config_lib.load(args.config, args.overrides))
  except JaxstepError as e:
    return report(e)
  print(result)
  return 0 if result.passed else 1


def _on_quantized_base(cfg, apply_fn, params):
  """``(apply_fn, params)`` of a run on a quantized base (``model.lora.base_quant``): the
  trainable part as the params the check differentiates, the base quantized as the run
  stores it and closed over (its integer codes have no gradient)."""
  from jaxstep.core import chunked_loss, freeze
  from jaxstep.trainer.plan import steps

  trainable = steps.trainable(cfg)
  train, base = freeze.partition(steps.quant_base(cfg, params, trainable), trainable)

  def on_base(p, inputs, **kwargs):
    return apply_fn(freeze.combine(p, base), inputs, **kwargs)

  return chunked_loss.like(on_base, apply_fn), train
