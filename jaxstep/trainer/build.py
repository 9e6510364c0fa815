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


def _mesh(cfg: config_lib.Config) -> Mesh:
  t = cfg.train
  mesh = parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
  problem = geometry.split_problem(
    t.global_batch_size,
    t.grad_accum_steps,
    mesh.devices.size,
    names=config_lib.CONFIG_NAMES_OF_G_AND_K,
  )
  if problem:
    raise ConfigError(problem)
  return mesh


def build(cfg: config_lib.Config) -> tuple[Run, TrainState, RunState]:
  """Loads data (all data errors surface here), lays out the mesh, builds the jitted steps.

  With more than one device, the state is sharded by ``jaxstep.parallel`` rules and the
  step accumulates device-locally under ``shard_map`` (one gradient reduction per update).
  """
  t = cfg.train
  mesh = _mesh(cfg)
  dataset = data.load_dataset(cfg.data, t.seq_len, progress=t.progress and sys.stderr.isatty())
  cfg = dataclasses.replace(cfg, model=resolve_vocab(cfg.model, dataset.vocab_size))
  spe = data.steps_per_epoch(len(dataset.train), t.global_batch_size)
  total = _total_update_steps(t, spe)
  schedule_steps = t.schedule_steps or total
  apply_fn, params = models.build(cfg.model, jax.random.PRNGKey(t.seed))
  optimizer = make_optimizer(cfg.optim, schedule_steps)
  scaler = _loss_scaler(t)
  loss_fn = next_token_loss(apply_fn)
  step = make_train_step(
    _poisonable(loss_fn) if t.debug_nan_step else loss_fn,
    optimizer,
    grad_accum_steps=t.grad_accum_steps,
    precision=t.precision,
    mesh=mesh if mesh.devices.size > 1 else None,
    loss_scale=scaler,
    spike_factor=t.spike_factor,
    spike_window=t.spike_window,
    scan_unroll=t.scan_unroll,
  )

  eval_step = make_eval_step(apply_fn, dataset.tokenizer.token_bytes(), cfg.model.vocab_size)

  state = step.init(params, jax.random.fold_in(jax.random.PRNGKey(t.seed), 1))
  state_sh = parallel.tree_shardings(state, mesh)
  state = jax.device_put(state, state_sh)
  batch_sh, replicated = parallel.batch_sharding(mesh), NamedSharding(mesh, PartitionSpec())
  run = Run(
    cfg=cfg,
    dataset=dataset,
    step_fn=jax.jit(
      step,
      in_shardings=(state_sh, batch_sh),
      out_shardings=(state_sh, replicated),
      donate_argnums=0,
    ),
    eval_fn=jax.jit(eval_step, in_shardings=(state_sh.params, batch_sh), out_shardings=replicated),
    mesh=mesh,
    batch_sharding=batch_sh,
    total_steps=total,
    schedule_steps=schedule_steps,
    steps_per_epoch=spe,
    flops_per_token=cfg.model.flops_per_token(t.seq_len),
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
