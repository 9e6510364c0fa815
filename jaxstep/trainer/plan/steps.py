"""The jitted functions a config's run is made of: its train step with K micro-steps, the
jit that lays the state and batch out on the mesh, the abstract state and batch that
``memory`` and ``auto`` compile against, and the evaluation step."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxstep import models, parallel
from jaxstep.core import freeze, preference, router_loss
from jaxstep.core.loss_scale import DynamicLossScale
from jaxstep.core.losses import next_token_loss, token_nll
from jaxstep.core.optim import make_optimizer
from jaxstep.core.step import make_train_step
from jaxstep.models import lora, quant
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.config.schema import TrainConfig
from jaxstep.trainer.plan import preference_plan, rl_plan, teacher


def loss_scaler(t: TrainConfig) -> DynamicLossScale | None:
  """Dynamic loss scaling for fp16 from ``train.loss_scale_*``; None otherwise."""
  if t.precision != "fp16":
    return None
  return DynamicLossScale(
    t.loss_scale_init, t.loss_scale_growth_interval, t.loss_scale_min, t.loss_scale_max
  )


def _poisonable(loss_fn):
  """Fault injection for ``train.debug_nan_step``: adds ``Σ batch["poison"]`` to the loss."""

  def poisoned(params, batch, rng, *model_state):  # a live reference or a teacher: 4 args
    batch = dict(batch)
    poison = batch.pop("poison")
    loss_sum, *rest = loss_fn(params, batch, rng, *model_state)
    return (loss_sum + jnp.sum(poison), *rest)

  if hasattr(loss_fn, "global_sums"):  # an MoE model's routing pass reads no poison
    poisoned.global_sums = lambda params, batch, rng: loss_fn.global_sums(
      params, {k: v for k, v in batch.items() if k != "poison"}, rng
    )
  return poisoned


def training_loss(cfg: config_lib.Config, apply_fn) -> tuple[Callable, Callable | None]:
  """``(loss_fn, units_fn)``: the loss ``cfg`` trains on (SFT's, a preference or an RL loss,
  or a teacher's; an MoE model's router losses added, exact over the global batch) and the
  count it is normalized by (None: the loss-masked tokens). ``jaxstep check`` compares the
  same loss."""
  pairs, rl = bool(cfg.preference.loss), bool(cfg.rl.rewards)
  if rl:
    build = lambda f: rl_plan.loss_fn(cfg, f, rl_plan.sampler_allowed(cfg))  # noqa: E731
    rows, units = router_loss.rl_rows, rl_plan.units_fn(cfg)
  elif pairs:
    build = lambda f: preference_plan.loss_fn(cfg, f)  # noqa: E731
    rows, units = router_loss.preference_rows, preference.pair_units
  else:
    build = functools.partial(next_token_loss, chunk=cfg.model.loss_chunk)
    rows, units = router_loss.sft_rows, None
  if cfg.distill.teacher:  # a frozen teacher in the state's model_state
    allowed = rl_plan.sampler_allowed(cfg) if rl else None
    build = lambda f: teacher.loss_fn(cfg, f, allowed)  # noqa: E731
  if sparse(cfg):  # an MoE model: its router losses, exact over the global batch
    loss_fn = router_loss.with_router_losses(build, apply_fn, cfg.model, rows)
  else:
    loss_fn = build(apply_fn)
  return loss_fn, units


def train_step(cfg: config_lib.Config, apply_fn, mesh: Mesh, schedule_steps: int, k: int):
  """The (unjitted) train step of ``cfg`` with K = ``k`` micro-steps and an lr schedule
  spanning ``schedule_steps`` update steps."""
  t = cfg.train
  pairs, rl = bool(cfg.preference.loss), bool(cfg.rl.rewards)
  loss_fn, units = training_loss(cfg, apply_fn)
  sharded = mesh.devices.size > 1
  step = make_train_step(
    _poisonable(loss_fn) if t.debug_nan_step else loss_fn,
    make_optimizer(cfg.optim, schedule_steps),
    grad_accum_steps=k,
    precision=t.precision,
    mesh=mesh if sharded else None,
    loss_scale=loss_scaler(t),
    spike_factor=t.spike_factor,
    spike_window=t.spike_window,
    scan_unroll=t.scan_unroll,
    trainable=trainable(cfg),
    units_fn=units,
  )
  if rl:
    step = rl_plan.with_token_means(step)
  elif pairs:
    step = preference_plan.with_pair_means(step)
  elif cfg.distill.teacher:
    step = teacher.with_token_means(step)
  if sparse(cfg):
    terms = k * (parallel.batch_shards(mesh) if sharded else 1)
    step = router_loss.with_router_metrics(step, cfg.model, terms)
  return step


def sparse(cfg: config_lib.Config) -> bool:
  """Whether ``cfg``'s model is a mixture of experts."""
  return bool(getattr(cfg.model, "num_experts", 0))


def trainable(cfg: config_lib.Config) -> freeze.Trainable | None:
  """Which params train: with LoRA the adapters plus ``optim.trainable``'s matches, else
  ``optim.trainable``'s (None: all)."""
  patterns = cfg.optim.trainable
  if cfg.model.lora.rank:
    patterns = (lora.ADAPTER, *patterns)
  return freeze.by_patterns(patterns) if patterns else None


def frozen_cast(cfg: config_lib.Config, params):
  """``params`` with the frozen leaves in ``optim.frozen_dtype``, and the frozen block
  weights quantized with ``model.lora.base_quant`` (``models/quant.py``; weights already
  quantized, as ``init_from`` reads them, stay as they are)."""
  train = trainable(cfg)
  if cfg.optim.frozen_dtype != "fp32":
    params = freeze.cast_frozen(params, train, jnp.bfloat16, keep=quant.is_quantized)
  return quant_base(cfg, params, train)


def base_leaf(cfg: config_lib.Config):
  """``(path, array) -> leaf`` for a tensor of ``model.init_from`` as it is read
  (``init_from.read_base``): a frozen one in ``optim.frozen_dtype``, and quantized when
  ``model.lora.base_quant`` quantizes it, so the whole base never sits in full precision."""
  train, spec = trainable(cfg), cfg.model.lora

  def convert(path, array):
    name = "/".join(map(str, path))
    if cfg.model.scan_layers:  # read a block at a time; trainable patterns see the stack
      name = re.sub(r"(^|/)blocks/\d+/", r"\1blocks/", name)
    if train is None or train(name, None):
      return array
    if cfg.optim.frozen_dtype != "fp32" and jnp.issubdtype(array.dtype, jnp.floating):
      array = array.astype(jnp.bfloat16)
    return quant.quantized_leaf(name, array, spec.base_quant, spec.quant_block)

  return convert


def quant_base(cfg: config_lib.Config, params, train: freeze.Trainable | None):
  """``params`` with the frozen ``quant.quantizable`` leaves quantized as ``model.lora``
  says (``base_quant`` none: unchanged)."""
  spec = cfg.model.lora
  frozen = lambda name: train is not None and not train(name, None)  # noqa: E731
  return quant.quantized(params, spec.base_quant, spec.quant_block, frozen)


def stored(cfg: config_lib.Config) -> freeze.Trainable | None:
  """Which params a checkpoint of ``cfg``'s run holds: a run from ``model.init_from`` with
  frozen leaves (LoRA) stores its trainable ones only, since every start reads the frozen
  ones from the folder again; any other run stores all (None)."""
  return trainable(cfg) if cfg.model.init_from else None


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


def compile_step(cfg: config_lib.Config, apply_fn, mesh: Mesh, schedule_steps: int, k: int, state):
  """The train step with K = ``k``, compiled (never run) on ``state``'s shapes and shardings
  (abstract or concrete) and an abstract global batch: what ``memory`` and ``auto`` measure."""
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  step = train_step(cfg, apply_fn, mesh, schedule_steps, k)
  return jit_step(step, state_sh, mesh).lower(state, abstract_batch(cfg, mesh)).compile()


def abstract_batch(cfg: config_lib.Config, mesh: Mesh) -> dict:
  """A global batch's shapes, dtypes and sharding (what the loop feeds the step)."""
  t = cfg.train
  sharding = parallel.batch_sharding(mesh)
  shape = (t.global_batch_size, t.seq_len)
  if cfg.rl.rewards:
    batch = rl_plan.abstract_batch(cfg, mesh)
  elif cfg.preference.loss:
    batch = preference_plan.abstract_batch(cfg, mesh)
  else:
    batch = {
      k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
      for k in ("inputs", "targets", "loss_mask")
    }
  if t.debug_nan_step:
    batch["poison"] = jax.ShapeDtypeStruct(shape[:1], jnp.float32, sharding=sharding)
  return batch


def abstract_state(cfg: config_lib.Config, mesh: Mesh, schedule_steps: int):
  """``(apply_fn, state)``: the model and its initial train state as shapes and shardings
  only (nothing allocated: what ``memory`` and ``auto`` compile against). ``cfg.model``
  must have its vocabulary resolved."""
  apply_fn, params = models.build(cfg.model, jax.random.PRNGKey(cfg.train.seed), abstract=True)
  params = frozen_cast(cfg, params)
  step = train_step(cfg, apply_fn, mesh, schedule_steps, 1)

  def init(params, rng, frozen_teacher):
    state = teacher.model_state(cfg, reference_state(cfg, params), frozen_teacher)
    return step.init(params, rng, model_state=state)

  state = jax.eval_shape(init, params, jax.random.PRNGKey(0), teacher.abstract_params(cfg))
  return apply_fn, with_shardings(state, parallel.tree_shardings(state, mesh))


def reference_state(cfg: config_lib.Config, params):
  """The ``model_state`` a run starts with: a live reference's copy (preference or RL), or
  None."""
  if cfg.rl.rewards:
    return rl_plan.reference_state(cfg, params)
  return preference_plan.reference_state(cfg, params)


def with_shardings(tree, shardings):
  """``tree``'s leaves as ``ShapeDtypeStruct``s carrying ``shardings``."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def make_eval_step(apply_fn, token_bytes, vocab_size: int, chunk: int | str = 0) -> Callable:
  """``(params, batch) -> (Σ NLL, Σ tokens, Σ bytes)`` over the loss-masked targets (fp32
  sums), where bytes are the UTF-8 bytes the targets stand for (``token_bytes`` per id);
  the NLL from the hidden states in chunks of ``chunk`` tokens (``model.loss_chunk``)."""
  table = jnp.zeros(vocab_size, jnp.float32).at[: len(token_bytes)].set(token_bytes)

  def eval_step(params, batch):
    nll_sum, _ = token_nll(apply_fn, params, batch, chunk=chunk)
    mask = batch["loss_mask"].astype(jnp.float32)
    return nll_sum, jnp.sum(mask), jnp.sum(table[batch["targets"]] * mask)

  return eval_step
