"""Everything a run builds once from a ``Config``: the plan (data, mesh, the derived values),
the model, the jitted train and eval steps, the initial state and run position. All config
and data errors surface here, before anything is written."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxstep import data, models, parallel
from jaxstep._version import __version__
from jaxstep.core import distill, freeze, param_groups
from jaxstep.core.state import TrainState
from jaxstep.errors import ConfigError
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.evaluation import eval_sets, harness_tasks, text_samples
from jaxstep.trainer.plan import init_from, preference_plan, reference_logps, steps, teacher
from jaxstep.trainer.plan.numbers import make_plan
from jaxstep.trainer.store.run_state import RunState, optimizer_of
from jaxstep.trainer.tracking import trackers

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class Run:
  """What a run builds once: data, compiled functions, and the schedule's length."""

  cfg: config_lib.Config  # resolved: vocabulary and K are numbers
  dataset: data.Dataset
  step_fn: Callable  # jitted (state, batch) -> (state, metrics), state donated
  eval_fn: Callable  # jitted (params, batch) -> sums: (nll, tokens, target UTF-8 bytes); pairs'
  mesh: Mesh
  batch_sharding: NamedSharding  # samples over every device
  total_steps: int  # update steps this run will take in all (max_steps / epochs)
  schedule_steps: int  # update steps the lr schedule spans (train.schedule_steps or total)
  steps_per_epoch: int
  flops_per_token: float
  accum_table: tuple = ()  # grad_accum_steps=auto: the (K, bytes per device) compiled
  eval_sets: dict = dataclasses.field(default_factory=dict)  # eval.sets: name -> windows
  # preference.reference=precompute: jitted (params, batch of pairs) -> their reference log-probs
  reference_fn: Callable | None = None


def config_digest(cfg: config_lib.Config) -> str:
  return hashlib.sha256(config_lib.dump(cfg).encode()).hexdigest()[:16]


def _base_identity(cfg: config_lib.Config, fingerprint: str) -> dict:
  """The identity of the weights a run reloads at every start (``RunState.base``):
  ``fingerprint`` is the full one of the read that gave the run its first params."""
  if steps.stored(cfg) is None:
    return {}
  return {"path": cfg.model.init_from, "fingerprint": fingerprint}


def build(
  cfg: config_lib.Config, load_teacher: Callable | None = None
) -> tuple[Run, TrainState, RunState]:
  """Loads data (all data errors surface here), resolves the plan, checks the sample prompts
  against the tokenizer and the model, builds the jitted steps.

  With more than one device, the state is sharded by ``jaxstep.parallel`` rules and the
  step accumulates device-locally under ``shard_map`` (one gradient reduction per update).
  ``run.cfg`` is the plan's: ``model.vocab_size`` and ``train.grad_accum_steps`` resolved.
  ``load_teacher(cfg, tokenizer, mesh) -> (params, identity)`` reads ``distill.teacher``
  onto the mesh (``saved_run.teacher.load``, a room above this one).
  """
  trackers.check_available(cfg.train.trackers)  # a missing extra: before any work
  harness_tasks.check_tasks(cfg.eval)
  plan = make_plan(cfg, read_data=True)
  cfg, mesh, t, dataset = plan.cfg, plan.mesh, plan.cfg.train, plan.dataset
  text_samples.check_prompts(cfg.model, dataset.tokenizer, t)
  if cfg.rl.rewards:
    sets = {}  # the held-out prompts only
    if cfg.distill.teacher:
      d = cfg.distill
      distill.check_completion_column(d.lmbda, d.completion_column, dataset.train.columns)
  elif cfg.preference.loss:
    sets = preference_plan.load_eval_sets(cfg, dataset)
  else:
    sets = eval_sets.load_eval_sets(cfg.eval.sets, cfg.data, t.seq_len, dataset, progress=False)
  clash = sorted(set(sets) & set(dataset.source_evals))
  if clash:
    raise ConfigError(
      f"eval.sets name {clash[0]!r} is also a data.sources name, whose held-out split is "
      f"evaluated under it; rename one"
    )
  apply_fn, params = models.build(
    cfg.model, jax.random.PRNGKey(t.seed), abstract=bool(cfg.model.init_from)
  )
  base_fingerprint = ""  # of model.init_from's weights, hashed as they are read
  if cfg.model.init_from:
    params, base_fingerprint = init_from.read_base(cfg.model, mesh, t.seed, steps.base_leaf(cfg))
  freeze.check_patterns(params, cfg.optim.trainable)
  if cfg.optim.groups:
    _log_groups(cfg, params)
  params = steps.frozen_cast(cfg, params)
  step = steps.train_step(cfg, apply_fn, mesh, plan.schedule_steps, t.grad_accum_steps)
  reference = steps.reference_state(cfg, params)  # a live reference: a copy, frozen
  taught, teacher_id = None, {}
  if cfg.distill.teacher:
    if load_teacher is None:
      raise ConfigError(
        "distill.teacher needs build(cfg, load_teacher=jaxstep.trainer.saved_run.teacher.load)"
      )
    taught, teacher_id = load_teacher(cfg, dataset.tokenizer, mesh)  # onto the mesh
  frozen = teacher.model_state(cfg, reference, taught)
  state = step.init(params, jax.random.fold_in(jax.random.PRNGKey(t.seed), 1), model_state=frozen)
  state_sh = parallel.tree_shardings(state, mesh)
  state = jax.device_put(state, state_sh)
  if cfg.rl.rewards:
    eval_step = None  # the held-out prompts are decoded and scored (rl.evaluate)
  elif cfg.preference.loss:
    eval_step = preference_plan.make_eval_step(cfg, apply_fn)
  else:
    eval_step = steps.make_eval_step(
      apply_fn, dataset.tokenizer.token_bytes(), cfg.model.vocab_size, cfg.model.loss_chunk
    )
  batch_sh, replicated = parallel.batch_sharding(mesh), NamedSharding(mesh, PartitionSpec())
  if eval_step is None:
    eval_fn = None
  elif cfg.preference.loss:  # pairs: (params, batch, model_state)
    eval_fn = jax.jit(eval_step, out_shardings=replicated)
  else:
    eval_fn = jax.jit(eval_step, in_shardings=(state_sh.params, batch_sh), out_shardings=replicated)
  reference_fn = None
  if cfg.preference.loss and preference_plan.reference_kind(cfg) == "precompute":
    reference_fn = reference_logps.logps_fn(apply_fn, state_sh.params, mesh)
  run = Run(
    cfg=cfg,
    dataset=dataset,
    step_fn=steps.jit_step(step, state_sh, mesh),
    eval_fn=eval_fn,
    mesh=mesh,
    batch_sharding=batch_sh,
    total_steps=plan.total_steps,
    schedule_steps=plan.schedule_steps,
    steps_per_epoch=plan.steps_per_epoch,
    flops_per_token=cfg.model.flops_per_token(t.seq_len),
    accum_table=plan.accum_table,
    eval_sets=sets,
    reference_fn=reference_fn,
  )
  run_state = RunState(
    dataset_fingerprint=dataset.fingerprint,
    global_batch_size=t.global_batch_size,
    grad_accum_steps=t.grad_accum_steps,
    config_digest=config_digest(cfg),
    jaxstep_version=__version__,
    seed=t.seed,
    schedule_steps=plan.schedule_steps,
    lr_schedule=cfg.optim.schedule,
    model=config_lib.to_dict(cfg.model),
    trainable=list(cfg.optim.trainable),
    base=_base_identity(cfg, base_fingerprint),
    optim=optimizer_of(cfg.optim),
    teacher=teacher_id,
  )
  return run, state, run_state


def _log_groups(cfg, params) -> None:
  """The leaves each of ``optim.groups`` got, one line a group (a group that matches no
  trainable leaf, or a leaf two groups match, is one ``ConfigError`` line)."""
  trainable = steps.trainable(cfg)
  train = params if trainable is None else freeze.partition(params, trainable)[0]
  got = param_groups.assignment(train, cfg.optim.groups)
  for i, g in enumerate(cfg.optim.groups):
    names = got[f"group{i}"]
    shown = ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")
    log.info("optim.groups[%d] (match %r): %s", i, g["match"], shown)
  log.info(
    "optim: %d leaves in no group keep optim.name=%s", len(got.get("main", [])), cfg.optim.name
  )
