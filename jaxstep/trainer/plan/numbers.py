"""A config resolved once: every value the config leaves to be derived (``0`` or ``auto``)
becomes a number here, and everything downstream — ``build``, ``memory``, ``check`` and the
CPU device split — reads the plan instead of deriving it again.

Derived values, in the order they depend on each other:

- the model section of a ``model.init_from`` folder (``init_from.resolve``);
- the devices: a CPU-only host is split into virtual devices before JAX starts
  (``configure_devices``; K counts as 1 while ``auto`` is unresolved, since any K the search
  may choose also has to divide G over those devices);
- the mesh on those devices, checked against G and K;
- ``model.vocab_size`` 0 → the tokenizer's size, padded (``resolve_vocab``);
- steps per epoch (full global batches in the train split), the run's total update steps
  ``min(max_steps, epochs × steps_per_epoch)`` and the schedule's length
  (``train.schedule_steps``, 0 = the total);
- ``train.grad_accum_steps: auto`` → the smallest K whose compiled step fits the budget
  (``auto_accum``, compiled on abstract inputs: nothing is allocated or run).

The data is read only when a value needs it (a vocabulary of 0, or ``train.epochs``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from jax.sharding import Mesh

from jaxstep import data, parallel
from jaxstep.core import device_memory, geometry, layout
from jaxstep.errors import ConfigError, DataError
from jaxstep.models import GPTConfig, LlamaConfig, gpt, hf_weights, llama, lora
from jaxstep.parallel.cpu_devices import fresh_compiles_for_expert_meshes
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.config.schema import CONFIG_NAMES_OF_G_AND_K, TrainConfig
from jaxstep.trainer.plan import auto_accum, init_from, preference_plan, steps, tensor_split

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class Plan:
  """``cfg`` with ``model.vocab_size`` and ``train.grad_accum_steps`` concrete, the mesh, and
  the run's length in update steps."""

  cfg: config_lib.Config
  mesh: Mesh
  total_steps: int  # update steps the run takes in all (max_steps / epochs)
  schedule_steps: int  # update steps the lr schedule spans
  steps_per_epoch: int | None  # full global batches per epoch (None: the data was not read)
  accum_table: tuple = ()  # grad_accum_steps=auto: the (K, bytes per device) compiled
  dataset: data.Dataset | None = None  # the data, when a derived value needed it

  @property
  def grad_accum_steps(self) -> int:
    return self.cfg.train.grad_accum_steps

  @property
  def devices(self) -> int:
    return layout.batch_shards(self.mesh)


def split_k(train_cfg: TrainConfig) -> int:
  """The K that G must divide by before ``auto`` is resolved: the config's, or 1."""
  k = train_cfg.grad_accum_steps
  return 1 if k == "auto" else k


def configure_devices(cfg: config_lib.Config) -> None:
  """The CPU device split for ``cfg`` (a no-op on accelerators or once JAX has started).

  A run with a frozen base (LoRA, ``optim.trainable``) on a mesh left to the split gets one
  device: every virtual device would hold its own replica of the frozen weights, which
  train on nothing, so the split's speed costs the base's bytes again (measured in
  docs/performance.md); ``mesh.cpu_devices`` chooses otherwise."""
  from jaxstep.parallel.cpu_devices import configure_cpu_defaults

  m = cfg.mesh
  frozen = config_lib.frozen_base(cfg)
  automatic = m.data == -1 and m.fsdp == 1 and m.tensor == 1 and m.expert == 1
  configure_cpu_defaults(
    cfg.train.global_batch_size,
    split_k(cfg.train),
    data=m.data,
    fsdp=m.fsdp,
    cpu_devices=m.cpu_devices or (1 if frozen and automatic else 0),
    tensor=m.tensor * m.expert,  # a fixed factor of the device count, as tensor is
  )


def mesh_for(cfg: config_lib.Config) -> Mesh:
  """The mesh of ``cfg`` on this host's devices, checked against G and K (1 for auto)."""
  t = cfg.train
  check_expert_split(cfg)
  m = cfg.mesh
  mesh = parallel.make_mesh(m.data, m.fsdp, tensor=m.tensor, expert=m.expert)
  fresh_compiles_for_expert_meshes(mesh)
  tensor_split.check(cfg.model, cfg.mesh, cfg.train.seq_len)
  problem = geometry.split_problem(
    t.global_batch_size, split_k(t), layout.batch_shards(mesh), names=CONFIG_NAMES_OF_G_AND_K
  )
  if problem:
    raise ConfigError(problem)
  return mesh


def check_expert_split(cfg: config_lib.Config) -> None:
  """``mesh.expert`` > 1 needs an MoE model whose experts it divides."""
  expert, experts = cfg.mesh.expert, getattr(cfg.model, "num_experts", 0)
  if expert == 1:
    return
  if not experts:
    raise ConfigError(
      f"mesh.expert={expert} splits a mixture-of-experts model's experts, and this model "
      "has none (model.num_experts=0): set mesh.expert=1"
    )
  if experts % expert:
    fits = [d for d in range(1, experts + 1) if experts % d == 0]
    nearest = min(fits, key=lambda d: (abs(d - expert), d))
    raise ConfigError(
      f"mesh.expert={expert} does not divide model.num_experts={experts}; the nearest that "
      f"does is mesh.expert={nearest}"
    )


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


def rl_steps_per_epoch(cfg: config_lib.Config, prompts: int) -> int:
  """An RL run's updates per pass over its prompts: ``rl.iterations`` per rollout, one
  rollout per ``global_batch_size / num_generations`` prompts (a last partial batch of
  prompts is left for the next epoch's order)."""
  per_rollout = cfg.train.global_batch_size // cfg.rl.num_generations
  if cfg.rl.filter_groups and cfg.train.epochs:
    raise ConfigError(
      "train.epochs counts passes over the prompts, and rl.filter_groups draws them at a rate "
      "no one knows in advance; give train.max_steps (update steps) instead"
    )
  if prompts < per_rollout:
    raise DataError(
      f"{prompts} training prompts, but one rollout takes {per_rollout} "
      f"(train.global_batch_size / rl.num_generations); give more prompts or lower it"
    )
  return prompts // per_rollout * cfg.rl.iterations


def total_update_steps(train_cfg: TrainConfig, steps_per_epoch: int | None) -> int:
  """``min(max_steps, epochs × steps_per_epoch)``, where 0 means "no limit"."""
  limits = [train_cfg.max_steps] if train_cfg.max_steps else []
  if train_cfg.epochs:
    limits.append(train_cfg.epochs * steps_per_epoch)
  return min(limits)


def approx_num_params(model: GPTConfig | LlamaConfig) -> int:
  """The model's parameter count from its shape alone (matmul weights, the token embeddings
  and the GPT's position embeddings; norm scales and biases left out: under 0.1 % at any
  real size)."""
  return sum(count for count, _, _ in _param_parts(model))


def _param_parts(model: GPTConfig | LlamaConfig) -> list[tuple[int, str, str]]:
  """``(parameters, what they are, the keys that size them)`` for each part of the model,
  so that a refusal names the keys that actually make it too large: a GPT's learned
  positions grow with ``max_seq_len``, which no other part depends on."""
  d, vocab = model.d_model, model.vocab_size
  embeddings = vocab * d * (1 if model.tie_embeddings else 2)  # the head is in matmul_params
  width = "model.d_model or model.n_layers"
  if isinstance(model, LlamaConfig):
    width = "model.d_model, model.n_layers or model.intermediate_size"
  parts = [
    (model.matmul_params() - vocab * d, f"the {model.n_layers} blocks", width),
    (embeddings, "the token embeddings and output head", "model.vocab_size or model.d_model"),
  ]
  if isinstance(model, GPTConfig):
    parts.append(
      (
        model.max_seq_len * d,
        "the learned positions (model.max_seq_len × model.d_model)",
        "model.max_seq_len or model.d_model",
      )
    )
  if model.lora.rank:
    parts.append((_adapter_params(model), "the LoRA adapters", "model.lora.rank"))
  return parts


def _adapter_params(model: GPTConfig | LlamaConfig) -> int:
  """``rank × (in + out)`` summed over the adapted projections of every block, and over
  every expert of the adapted routed-expert weights (``gate|up``: ``d + 2f``, ``down``:
  ``f + d``)."""
  projections = gpt.PROJECTIONS if isinstance(model, GPTConfig) else llama.PROJECTIONS
  shapes = hf_weights.expected_shapes(dataclasses.replace(model, scan_layers=False))
  dense = sum(
    model.lora.rank * sum(shape)
    for path, shape in shapes.items()
    if path[-1] == "kernel" and path[-2] in projections and model.lora.adapts(path[-2])
  )
  if isinstance(model, GPTConfig) or not model.num_experts:
    return dense
  d, f = model.d_model, model.expert_size
  fans = dict(zip(lora.ROUTED, (d + 2 * f, f + d), strict=True))
  per_layer = sum(fan for name, fan in fans.items() if model.lora.adapts(name))
  return dense + model.lora.rank * model.num_experts * per_layer * sum(model.moe_layers)


def refuse_what_cannot_fit(cfg: config_lib.Config, mesh: Mesh, memory_bytes: int) -> None:
  """Values that are in their domain but out of reach are config errors before anything is
  allocated or compiled: the persistent training state (fp32 params and two Adam moments:
  12 bytes per parameter, over fsdp) or one global batch's token arrays (3 int32 arrays of
  G × seq_len, over the data axis) alone larger than a device's memory. The estimate is a
  floor (activations come on top), so nothing that fits is refused here; ``jaxstep memory``
  gives the whole picture."""
  gib = 2**30
  params = approx_num_params(cfg.model)
  state = 12 * params / (mesh.shape["fsdp"] * dict(mesh.shape).get("tensor", 1))
  if state > memory_bytes:
    count, what, keys = max(_param_parts(cfg.model))
    raise ConfigError(
      f"the model has about {params:,} parameters: its training state alone needs "
      f"{state / gib:,.1f} GiB per device, more than the {memory_bytes / gib:,.1f} GiB one "
      f"holds; {what} hold {count / params:.0%} of them: shrink {keys}, or shard it over "
      f"more devices (mesh.fsdp)"
    )
  t = cfg.train
  if 4 * t.spike_window > memory_bytes:
    raise ConfigError(
      f"train.spike_window {t.spike_window:,} losses need {4 * t.spike_window / gib:,.1f} GiB; "
      f"it counts update steps: use a window of tens to hundreds"
    )
  batch = 3 * 4 * t.global_batch_size * t.seq_len / layout.batch_shards(mesh)
  if batch > memory_bytes:
    raise ConfigError(
      f"one global batch (train.global_batch_size {t.global_batch_size:,} × train.seq_len "
      f"{t.seq_len:,}) needs {batch / gib:,.1f} GiB per device for its tokens alone, more "
      f"than the {memory_bytes / gib:,.1f} GiB one holds; lower train.global_batch_size"
    )


def _warn_quantized_without_remat(model) -> None:
  """One line when a quantized base trains without remat: the backward pass then keeps
  every block's dequantized weights, the whole base in full precision."""
  if model.lora.base_quant != "none" and model.remat == "none":
    log.warning(
      "model.lora.base_quant=%s with model.remat=none: the backward pass keeps every "
      "block's dequantized weights (the whole base in full precision); set "
      "model.remat=block to dequantize each block's again instead",
      model.lora.base_quant,
    )


def _warn_all_warmup(warmup_steps: int, schedule_steps: int, shape: str) -> None:
  """One line when the warmup fills the whole schedule: the lr would only ever rise, and a
  later, longer run would drop from the peak straight to the decayed value."""
  if warmup_steps and warmup_steps >= schedule_steps:
    log.warning(
      "optim.warmup_steps %d ≥ the schedule's %d update steps: the lr only warms up (no %s "
      "phase); lower optim.warmup_steps or lengthen the schedule (train.schedule_steps)",
      warmup_steps,
      schedule_steps,
      shape,
    )


def _warn_settings_without_effect(cfg: config_lib.Config) -> None:
  """One line for each setting that the rest of the config switches off."""
  lora = cfg.model.lora
  if not lora.rank and lora != type(lora)():  # rank 0 with another setting changed
    log.warning(
      "model.lora.rank is 0, so adapters are off and the whole model trains: "
      "model.lora.targets, alpha and dropout have no effect (set model.lora.rank > 0 for LoRA)"
    )
  if cfg.data.document_mask is True and not cfg.data.pack:
    log.warning(
      "data.document_mask: true has no effect with data.pack: false (each window holds one "
      "document already); set data.pack: true to pack documents and mask between them"
    )
  _warn_other_objectives(cfg)


def _warn_other_objectives(cfg: config_lib.Config) -> None:
  """One line naming the ``preference.*``, ``rl.*`` and ``distill.*`` keys set away from
  their defaults in a run of another kind: a run is a preference run only with
  ``preference.loss``, an RL run only with ``rl.rewards``, and distills only from a
  ``distill.teacher``, so ``preference.reference=precompute`` alone trains a plain language
  model, and nothing else would say so."""
  ignored = []
  sections = ("preference", cfg.preference.loss), ("rl", cfg.rl.rewards)
  for section, on in (*sections, ("distill", cfg.distill.teacher)):
    if on:
      continue
    given = getattr(cfg, section)
    default = config_lib.to_dict(type(given)())
    ignored += [
      f"{section}.{k}={v}" for k, v in config_lib.to_dict(given).items() if v != default[k]
    ]
  if not ignored:
    return
  run = (
    "a preference run" if cfg.preference.loss else "an RL run" if cfg.rl.rewards else "supervised"
  )
  log.warning(
    "%s %s no effect: this run is %s (preference.loss makes a preference run, rl.rewards an "
    "RL run, distill.teacher names a teacher); drop %s",
    ", ".join(ignored),
    "has" if len(ignored) == 1 else "have",
    run,
    "it" if len(ignored) == 1 else "them",
  )


def _choose_k(cfg: config_lib.Config, mesh: Mesh, schedule_steps: int) -> tuple[int, list]:
  """``auto``: the K ``auto_accum`` chooses by compiling the step on the abstract state for
  the candidates it tries, and the ``(K, bytes)`` table compiled."""
  t = cfg.train
  budget = auto_accum.budget_bytes(t.memory_budget_gb)
  apply_fn, state = steps.abstract_state(cfg, mesh, schedule_steps)

  def compile_k(k):
    return steps.compile_step(cfg, apply_fn, mesh, schedule_steps, k, state)

  return auto_accum.choose(t.global_batch_size, layout.batch_shards(mesh), compile_k, budget)


def load_data(cfg: config_lib.Config):
  """A run's data: the pairs of a preference run (``preference.loss``), else the corpus or
  mixture of ``cfg.data``."""
  t, p = cfg.train, cfg.preference
  if cfg.rl.rewards:
    return data.load_prompt_dataset(
      cfg.data.path,
      cfg.data.tokenizer,
      max_prompt_len=t.seq_len + 1 - cfg.rl.max_new_tokens,
      eval_fraction=cfg.data.eval_fraction,
    )
  if p.loss:
    return data.load_pair_dataset(
      cfg.data.path,
      cfg.data.tokenizer,
      seq_len=t.seq_len,
      max_prompt_len=p.prompt_len(t.seq_len),
      eval_fraction=cfg.data.eval_fraction,
      **preference_plan.cut_settings(cfg),
    )
  return data.load_dataset(cfg.data, t.seq_len, progress=t.progress and sys.stderr.isatty())


def make_plan(
  cfg: config_lib.Config, dataset: data.Dataset | None = None, *, read_data: bool = False
) -> Plan:
  """Resolves ``cfg`` on this host's devices and ``dataset``'s tokenizer and size. Without a
  ``dataset`` the data of ``cfg.data`` is read here when ``read_data`` is set or a derived
  value needs it (after the mesh is checked, so a config error comes first)."""
  cfg = init_from.resolve(cfg)
  t = cfg.train
  mesh = mesh_for(cfg)
  memory = device_memory.device_memory_bytes()
  refuse_what_cannot_fit(cfg, mesh, memory)  # before the data is read: a vocabulary of 0 counts 0
  if dataset is None and (read_data or cfg.model.vocab_size == 0 or t.epochs):
    dataset = load_data(cfg)
  if dataset is not None:
    cfg = dataclasses.replace(cfg, model=resolve_vocab(cfg.model, dataset.vocab_size))
    tensor_split.check_vocab(cfg.model.vocab_size, cfg.mesh.tensor, dataset.vocab_size)
    refuse_what_cannot_fit(cfg, mesh, memory)
  spe = None if dataset is None else data.split_steps_per_epoch(dataset.train, t.global_batch_size)
  if dataset is not None and cfg.rl.rewards:
    spe = rl_steps_per_epoch(cfg, len(dataset.train))
  total = total_update_steps(t, spe)
  schedule_steps = t.schedule_steps or total
  _warn_all_warmup(cfg.optim.warmup_steps, schedule_steps, cfg.optim.schedule)
  _warn_quantized_without_remat(cfg.model)
  _warn_settings_without_effect(cfg)
  table = []
  if t.grad_accum_steps == "auto":
    k, table = _choose_k(cfg, mesh, schedule_steps)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum_steps=k))
  return Plan(cfg, mesh, total, schedule_steps, spe, tuple(table), dataset)
