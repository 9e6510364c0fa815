"""A run that starts from a Hugging Face model folder (``model.init_from``).

The folder decides the model: its ``config.json`` becomes the model section (the family,
every shape key, the RoPE settings) and its weights the first params; the model section
keeps only what the folder cannot know — ``dropout``, the kernel choices ``attention``,
``remat``, ``scan_layers``, a mixture of experts' ``capacity_factor``, ``moe_matmul`` and
``lbl_scope`` — and the router loss weights ``router_aux_loss`` / ``router_z_loss`` where
it sets them to anything but their defaults (else the folder's coefficients). A shape key
the config sets to something else than the folder says is refused by name rather than
silently overridden. ``data.tokenizer`` left at ``byte`` becomes the folder (its tokenizer,
its special ids); any other tokenizer must fit the folder's vocabulary
(``plan.resolve_vocab`` checks).

The resolved config is what ``run_dir/config.yaml`` records, so a resume, ``generate`` or
``evaluate`` of the run needs nothing but the run directory; only a fresh start reads the
weights. Each tensor is put onto its target sharding as it is read (the fsdp rule depends on
the shape alone), so a model that only fits sharded never sits whole on one device.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
from jax.sharding import Mesh, NamedSharding

from jaxstep.core import layout
from jaxstep.errors import ConfigError
from jaxstep.models import hf_config, lora
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.config.values import require_init_from

# model keys the folder does not decide: they stay as the config sets them (a mixture of
# experts' training settings among them)
OPTION_KEYS = (
  "dropout",
  "attention",
  "remat",
  "scan_layers",
  "init_from",
  "lora",
  "loss_chunk",
  "capacity_factor",
  "moe_matmul",
  "lbl_scope",
)
# keys the folder gives a value (its router_aux_loss_coef, router_z_loss_coef) that a config
# setting them to anything but their default overrides
PREFERRED_KEYS = ("router_aux_loss", "router_z_loss")


def resolve(cfg: config_lib.Config) -> config_lib.Config:
  """``cfg`` with its model section read from ``model.init_from`` (unchanged without one)."""
  model = cfg.model
  if not model.init_from:
    return cfg
  require_init_from(model.init_from)
  folder = pathlib.Path(model.init_from)
  hf = hf_config.read_config(folder)
  where = str(folder / hf_config.CONFIG)
  resolved = hf_config.model_config(hf, where, **_options(model))
  _refuse_contradictions(model, resolved, where)
  routed = [t for t in model.lora.targets if t in lora.ROUTED]
  if routed and not getattr(resolved, "num_experts", 0):
    raise ConfigError(
      f"model.lora.targets: {', '.join(routed)} names routed experts, and the model of "
      f"{where} has none: drop them from model.lora.targets"
    )
  hf_config.check_sliding_window(hf, cfg.train.seq_len, where)
  if cfg.train.seq_len > resolved.max_seq_len:
    raise ConfigError(
      f"train.seq_len {cfg.train.seq_len} exceeds the {resolved.max_seq_len} positions of "
      f"{where} (max_position_embeddings); lower train.seq_len"
    )
  tokenizer = str(folder) if cfg.data.tokenizer == "byte" else cfg.data.tokenizer
  data = dataclasses.replace(cfg.data, tokenizer=tokenizer)
  return dataclasses.replace(cfg, model=resolved, data=data)


def _options(model) -> dict:
  """The model settings the config decides: ``OPTION_KEYS`` its family has, and each of
  ``PREFERRED_KEYS`` it sets to something else than its default (the folder's otherwise)."""
  defaults = type(model)(vocab_size=0)
  options = {k: getattr(model, k) for k in OPTION_KEYS if hasattr(model, k)}
  for k in PREFERRED_KEYS:
    if hasattr(model, k) and getattr(model, k) != getattr(defaults, k):
      options[k] = getattr(model, k)
  return options


def _refuse_contradictions(model, resolved, where: str) -> None:
  """A shape key set to neither its default nor the folder's value is a ``ConfigError``."""
  defaults = type(model)(vocab_size=0)
  for field in dataclasses.fields(model):
    name = field.name
    mine, theirs = getattr(model, name), getattr(resolved, name, "not a setting there")
    settings = (*OPTION_KEYS, *PREFERRED_KEYS)
    if name not in settings and mine != getattr(defaults, name) and mine != theirs:
      raise ConfigError(
        f"model.{name} {mine} contradicts {where} ({theirs}); with model.init_from the "
        f"model's shape comes from the folder: drop model.{name}"
      )


def read_base(model_cfg, mesh: Mesh, seed: int = 0, convert=None) -> tuple[dict, str]:
  """``(params, fingerprint)``: the folder's weights as fp32 params in ``model_cfg``'s
  layout, each tensor on its ``core.layout`` sharding as it is read (stacked layers: read,
  stacked, then placed), fresh adapters with ``model.lora``, and the weights' full
  fingerprint (``hf_weights.FingerprintDigest``), hashed from the same read. ``convert``:
  ``(path, array) -> leaf`` on each tensor as it is read (``steps.base_leaf``: a frozen
  weight cast, or quantized, before the next one is read)."""
  from jaxstep.models.pretrained import load_pretrained

  convert = convert or (lambda path, array: array)

  def place(path, array):  # a tensor mesh's split too: no device ever holds the whole tensor
    leaf = convert(path, array)
    return jax.device_put(
      leaf, jax.tree.map(lambda x: layout.leaf_sharding(path, x.shape, mesh), leaf)
    )

  scanned = model_cfg.scan_layers
  options = {k: getattr(model_cfg, k) for k in ("dropout", "attention", "remat")}  # no lora
  loaded = load_pretrained(
    model_cfg.init_from,
    place=convert if scanned else place,
    scan_layers=scanned,
    max_seq_len=model_cfg.max_seq_len,
    **options,
  )
  params = loaded.params
  if scanned:
    params = jax.device_put(params, layout.tree_shardings(params, mesh))
  if model_cfg.lora.rank:
    fsdp = mesh.shape["fsdp"]
    params = lora.attach(
      params,
      model_cfg,
      seed,
      place=lambda a: jax.device_put(a, NamedSharding(mesh, layout.leaf_spec(a.shape, fsdp))),
    )
  if layout.has_tensor(mesh):  # the tensor split goes by each leaf's path: placed once named
    params = jax.device_put(params, layout.tree_shardings(params, mesh))
  return params, loaded.fingerprint


def is_model_folder(path: str | pathlib.Path) -> bool:
  """Whether ``path`` is a Hugging Face model folder: ``config.json`` and no ``config.yaml``."""
  path = pathlib.Path(path)
  return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


def folder_config(folder: pathlib.Path) -> config_lib.Config:
  """The config of a run started from the model folder ``folder`` (``model.init_from``
  resolved; ``data.tokenizer`` the folder; ``train`` at its defaults, ``train.seq_len`` at
  most the positions the model takes), read from its ``config.json`` alone: what a model
  folder read back for use (``jaxstep generate``, a teacher) runs as."""
  hf = hf_config.read_config(folder)
  longest = _usable_positions(hf, hf_config.model_config(hf, str(folder / hf_config.CONFIG)))
  cfg = config_lib.load(None)
  train = dataclasses.replace(cfg.train, seq_len=min(cfg.train.seq_len, longest))
  model = dataclasses.replace(cfg.model, init_from=str(folder))
  cfg = resolve(dataclasses.replace(cfg, model=model, train=train))
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_len=longest))


def _usable_positions(hf: dict, model_cfg) -> int:
  """The longest sequence the model attends over exactly: ``max_position_embeddings``, or a
  shorter sliding window it uses where jaxstep does not read it (a mixture of experts')."""
  from jaxstep.models import hf_config, hf_dense

  window = hf.get("sliding_window")
  if hf_config.architecture(hf) in hf_dense.READS_WINDOWS:
    return model_cfg.max_seq_len  # the model computes its window
  if window is not None and hf.get("use_sliding_window", True):
    return min(model_cfg.max_seq_len, int(window))
  return model_cfg.max_seq_len
