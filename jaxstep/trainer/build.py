"""Everything a run builds once from a ``Config``: data, mesh, model, optimizer, the jitted
train and eval steps, the initial state and run position. All config and data errors
surface here, before anything is written."""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxstep
from jaxstep import data, models, parallel
from jaxstep.core import geometry
from jaxstep.core.loss_scale import DynamicLossScale
from jaxstep.core.losses import masked_nll, next_token_loss
from jaxstep.core.optim import make_optimizer
from jaxstep.core.state import TrainState
from jaxstep.core.step import make_train_step
from jaxstep.errors import ConfigError, DataError
from jaxstep.models import GPTConfig
from jaxstep.trainer import auto_accum
from jaxstep.trainer import config as config_lib
from jaxstep.trainer.run_state import RunState


@dataclasses.dataclass(frozen=True)
class Run:
  """What a run builds once: data, compiled functions, and the schedule's length."""

  cfg: config_lib.Config
  dataset: data.Dataset
  step_fn: Callable  # jitted (state, batch) -> (state, metrics), state donated
  eval_fn: Callable  # jitted (params, batch) -> (nll_sum, tokens, target UTF-8 bytes)
  mesh: Mesh
  batch_sharding: NamedSharding  # samples over every device
  total_steps: int  # update steps this run will take in all (max_steps / epochs)
  schedule_steps: int  # update steps the lr schedule spans (train.schedule_steps or total)
  steps_per_epoch: int
  flops_per_token: float
  accum_table: tuple = ()  # grad_accum_steps=auto: the (K, bytes per device) compiled


def _total_update_steps(train_cfg, steps_per_epoch: int) -> int:
  """``min(max_steps, epochs × steps_per_epoch)``, where 0 means "no limit"."""
  limits = [train_cfg.max_steps] if train_cfg.max_steps else []
  limits += [train_cfg.epochs * steps_per_epoch] if train_cfg.epochs else []
  return min(limits)


def config_digest(cfg: config_lib.Config) -> str:
  return hashlib.sha256(config_lib.dump(cfg).encode()).hexdigest()[:16]


def _loss_scaler(t: config_lib.TrainConfig) -> DynamicLossScale | None:
  """Dynamic loss scaling for fp16 from ``train.loss_scale_*``; None otherwise."""
  if t.precision != "fp16":
    return None
  return DynamicLossScale(
    t.loss_scale_init, t.loss_scale_growth_interval, t.loss_scale_min, t.loss_scale_max
  )


def _poisonable(loss_fn):
  """Fault injection for ``train.debug_nan_step``: adds ``Σ batch["poison"]`` to the loss."""

  def poisoned(params, batch, rng):
    batch = dict(batch)
    poison = batch.pop("poison")
    loss_sum, aux = loss_fn(params, batch, rng)
    return loss_sum + jnp.sum(poison), aux

  return poisoned


def make_eval_step(apply_fn, token_bytes, vocab_size: int) -> Callable:
  """``(params, batch) -> (Σ NLL, Σ tokens, Σ bytes)`` over the loss-masked targets (fp32
  sums), where bytes are the UTF-8 bytes the targets stand for (``token_bytes`` per id)."""
  table = jnp.zeros(vocab_size, jnp.float32).at[: len(token_bytes)].set(token_bytes)

  def eval_step(params, batch):
    logits = apply_fn(params, batch["inputs"], train=False)
    nll_sum, _ = masked_nll(logits, batch["targets"], batch["loss_mask"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return nll_sum, jnp.sum(mask), jnp.sum(table[batch["targets"]] * mask)

  return eval_step


def resolve_vocab(model_cfg: GPTConfig, tokenizer_size: int) -> GPTConfig:
  """``model.vocab_size`` 0 becomes the tokenizer's size rounded up to a multiple of 64
  (matmul-friendly; 8 below 1024 ids, where 64 would add a large share of dead rows to a
  small vocabulary: bytes' 259 → 264, not 320); an explicit size must hold every id."""
  if model_cfg.vocab_size == 0:
    multiple = 64 if tokenizer_size >= 1024 else 8
    padded = -(-tokenizer_size // multiple) * multiple
    return dataclasses.replace(model_cfg, vocab_size=padded)
  if model_cfg.vocab_size < tokenizer_size:
    raise DataError(
      f"the tokenizer has {tokenizer_size} ids but model.vocab_size is "
      f"{model_cfg.vocab_size}; set model.vocab_size >= {tokenizer_size} (or 0 to follow the "
      f"tokenizer)"
    )
  return model_cfg


def mesh_for(cfg: config_lib.Config) -> Mesh:
  """The mesh of ``cfg`` on this host's devices, checked against G and K (K = 1 for auto)."""
  t = cfg.train
  mesh = parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
  problem = geometry.split_problem(
    t.global_batch_size,
    1 if t.grad_accum_steps == "auto" else t.grad_accum_steps,
    mesh.devices.size,
    names=config_lib.CONFIG_NAMES_OF_G_AND_K,
  )
  if problem:
    raise ConfigError(problem)
  return mesh


def train_step(cfg: config_lib.Config, apply_fn, mesh: Mesh, schedule_steps: int, k: int):
  """The (unjitted) train step of ``cfg`` with K = ``k`` micro-steps."""
  t = cfg.train
  loss_fn = next_token_loss(apply_fn)
  return make_train_step(
    _poisonable(loss_fn) if t.debug_nan_step else loss_fn,
    make_optimizer(cfg.optim, schedule_steps),
    grad_accum_steps=k,
    precision=t.precision,
    mesh=mesh if mesh.devices.size > 1 else None,
    loss_scale=_loss_scaler(t),
    spike_factor=t.spike_factor,
    spike_window=t.spike_window,
    scan_unroll=t.scan_unroll,
  )


def jit_step(step, state_shardings, mesh: Mesh):
  """``step`` jitted: state donated and laid out by ``state_shardings``, the batch's samples
  over every device, metrics replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(
    step,
    in_shardings=(state_shardings, parallel.batch_sharding(mesh)),
    out_shardings=(state_shardings, replicated),
    donate_argnums=0,
  )


def abstract_batch(t: config_lib.TrainConfig, mesh: Mesh) -> dict:
  """A global batch's shapes, dtypes and sharding (what the loop feeds the step)."""
  sharding = parallel.batch_sharding(mesh)
  shape = (t.global_batch_size, t.seq_len)
  batch = {
    k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    for k in ("inputs", "targets", "loss_mask")
  }
  if t.debug_nan_step:
    batch["poison"] = jax.ShapeDtypeStruct(shape[:1], jnp.float32, sharding=sharding)
  return batch


def abstract_state(cfg: config_lib.Config, mesh: Mesh, schedule_steps: int):
  """``(apply_fn, state)``: the model and its initial train state as shapes and shardings
  only (nothing allocated: what ``memory`` and ``auto`` compile against)."""
  apply_fn, params = models.build(cfg.model, jax.random.PRNGKey(cfg.train.seed), abstract=True)
  step = train_step(cfg, apply_fn, mesh, schedule_steps, 1)
  state = jax.eval_shape(step.init, params, jax.random.PRNGKey(0))
  return apply_fn, _with_shardings(state, parallel.tree_shardings(state, mesh))


def _with_shardings(tree, shardings):
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def resolve_grad_accum(cfg, apply_fn, mesh: Mesh, schedule_steps: int, state) -> tuple[int, list]:
  """``train.grad_accum_steps``, or for ``auto`` the K ``auto_accum`` chooses by compiling
  the step on ``state`` (abstract or concrete) for the candidates it tries; the second item
  is the ``(K, bytes)`` table compiled (empty for a fixed K)."""
  t = cfg.train
  if t.grad_accum_steps != "auto":
    return t.grad_accum_steps, []
  budget = auto_accum.budget_bytes(t.memory_budget_gb)
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  state, batch = _with_shardings(state, state_sh), abstract_batch(t, mesh)  # shapes only

  def compile_k(k):
    step = train_step(cfg, apply_fn, mesh, schedule_steps, k)
    return jit_step(step, state_sh, mesh).lower(state, batch).compile()

  return auto_accum.choose(t.global_batch_size, mesh.devices.size, compile_k, budget)


def build(cfg: config_lib.Config) -> tuple[Run, TrainState, RunState]:
  """Loads data (all data errors surface here), lays out the mesh, builds the jitted steps.

  With more than one device, the state is sharded by ``jaxstep.parallel`` rules and the
  step accumulates device-locally under ``shard_map`` (one gradient reduction per update).
  ``train.grad_accum_steps: auto`` is resolved here (``auto_accum``); ``run.cfg`` holds
  the K chosen.
  """
  t = cfg.train
  mesh = mesh_for(cfg)
  dataset = data.load_dataset(cfg.data, t.seq_len, progress=t.progress and sys.stderr.isatty())
  cfg = dataclasses.replace(cfg, model=resolve_vocab(cfg.model, dataset.vocab_size))
  spe = data.steps_per_epoch(len(dataset.train), t.global_batch_size)
  total = _total_update_steps(t, spe)
  schedule_steps = t.schedule_steps or total
  apply_fn, params = models.build(cfg.model, jax.random.PRNGKey(t.seed))
  init = train_step(cfg, apply_fn, mesh, schedule_steps, 1).init
  state = init(params, jax.random.fold_in(jax.random.PRNGKey(t.seed), 1))
  state_sh = parallel.tree_shardings(state, mesh)
  state = jax.device_put(state, state_sh)
  k, table = resolve_grad_accum(cfg, apply_fn, mesh, schedule_steps, state)
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum_steps=k))
  t = cfg.train
  eval_step = make_eval_step(apply_fn, dataset.tokenizer.token_bytes(), cfg.model.vocab_size)
  batch_sh, replicated = parallel.batch_sharding(mesh), NamedSharding(mesh, PartitionSpec())
  run = Run(
    cfg=cfg,
    dataset=dataset,
    step_fn=jit_step(train_step(cfg, apply_fn, mesh, schedule_steps, k), state_sh, mesh),
    eval_fn=jax.jit(eval_step, in_shardings=(state_sh.params, batch_sh), out_shardings=replicated),
    mesh=mesh,
    batch_sharding=batch_sh,
    total_steps=total,
    schedule_steps=schedule_steps,
    steps_per_epoch=spe,
    flops_per_token=cfg.model.flops_per_token(t.seq_len),
    accum_table=tuple(table),
  )
  run_state = RunState(
    dataset_fingerprint=dataset.fingerprint,
    global_batch_size=t.global_batch_size,
    grad_accum_steps=t.grad_accum_steps,
    config_digest=config_digest(cfg),
    jaxstep_version=jaxstep.__version__,
    seed=t.seed,
    schedule_steps=schedule_steps,
    model=config_lib.to_dict(cfg.model),
  )
  return run, state, run_state
