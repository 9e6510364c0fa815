"""A LoRA model's adapters written out in PEFT's format (``jaxstep export --adapter``):
``adapter_config.json`` and ``adapter_model.safetensors``, as ``peft.PeftModel.save_pretrained``
writes them for ``LoraConfig(r, lora_alpha, target_modules, lora_dropout, bias="none",
task_type="CAUSAL_LM")``, so ``peft.PeftModel.from_pretrained(base, folder)`` loads them
onto the base model. Pure numpy and safetensors: neither torch nor peft is imported.

The math is the same on both sides: an adapted projection computes ``y = x·W + b +
(α/r)·(x·A)·B`` (jaxstep, ``A`` ``[in, r]``, ``B`` ``[r, out]``), which is PEFT's ``y =
base(x) + (lora_alpha/r)·lora_B(lora_A(x))`` with ``lora_A.weight = Aᵀ`` ``[r, in]`` and
``lora_B.weight = Bᵀ`` ``[out, r]`` (PyTorch's ``Linear`` stores ``[out, in]``). So each
adapter leaf is transposed on the way out and nothing else changes, but for the GPT's
``qkv`` ``B``, whose columns are head-major here and ``[q | k | v]`` in GPT-2
(``hf_gpt2.columns``); ``lora_alpha`` is ``model.lora.alpha``, ``r`` is
``model.lora.rank`` (no rsLoRA, no DoRA) and ``lora_dropout`` is ``model.lora.dropout``
(both drop the adapter's input ``x`` while training, so PEFT trains on as the run did).

Tensors are named ``base_model.model.<module>.lora_A.weight`` / ``…lora_B.weight``, where
``<module>`` is the projection's module in the transformers model: ``hf_weights.hf_names``'
tensor name without ``.weight`` (``model.layers.{i}.self_attn.q_proj``,
``transformer.h.{i}.attn.c_attn``). ``target_modules`` lists the adapted projections' module
names: the Llama family's are jaxstep's own (``q_proj`` … ``down_proj``); the bundled GPT's
are GPT-2's ``c_attn`` (``qkv``), ``attn.c_proj`` (``proj``), ``c_fc`` (``fc``) and
``mlp.c_proj`` (``out``), the two ``c_proj`` written as ``c_proj`` when both are adapted
(PEFT matches a name against a module's full name or a ``.``-separated suffix of it).
GPT-2's projections are ``Conv1D`` layers, which store ``[in, out]``: PEFT's config then says
``fan_in_fan_out: true``, which only changes how PEFT merges into the base weight; the
adapter tensors are laid out as for a ``Linear``.

Phi-3's fused projections (``qkv_proj``, ``gate_up_proj``) hold several of jaxstep's: the
adapters on the parts of one (rank ``r`` each, ``n`` of them adapted) are one adapter of
rank ``n·r`` on it, exactly: ``A`` the parts' ``A`` side by side ``[in, n·r]``, ``B``
block-diagonal ``[n·r, out]`` (zero columns for a part not adapted), listed in PEFT's
``rank_pattern`` (``n·r``) and ``alpha_pattern`` (``n·α``) so its scale stays ``α/r``. PEFT
then drops the fused adapter's input once where jaxstep drew a mask per part: the same model
at inference, a different dropout draw when PEFT trains on with ``lora_dropout`` > 0.

Routed experts (``model.lora.targets`` naming ``experts.gate_up_proj`` /
``experts.down_proj``) are PEFT's ``target_parameters``: an adapter on transformers' fused
expert parameter ``mlp.experts.gate_up_proj`` ``[E, 2f, d]`` (or ``down_proj`` ``[E, d, f]``),
stored as ``lora_A.weight`` ``[E·r, in]`` (expert ``e``'s ``Aᵀ`` in rows ``e·r … e·r+r−1``)
and ``lora_B.weight`` ``[out, r·E]`` (column ``j·E + e`` holding row ``j`` of expert ``e``'s
``B``), PEFT's ``ParamWrapper`` layout. PEFT nests one wrapper per targeted parameter of a
module; with both adapted ``gate_up_proj``'s is the inner one, its tensors named
``…mlp.experts.base_layer.lora_A.weight``, and ``down_proj``'s ``…mlp.experts.lora_A.weight``
(read from PEFT 0.21 on transformers 5, whose experts are these fused parameters: on
transformers 4's per-expert ``Linear`` modules the names match nothing).

Params may be per block or stacked (``model.scan_layers``: one leaf per adapter with a
leading layer axis, sliced one layer at a time). The folder is written whole or not at all,
and replaces only a folder jaxstep wrote, as ``hf_export`` writes (``export_folder``).
"""

from __future__ import annotations

import itertools
import json
import pathlib
from collections.abc import Iterable

import numpy as np

from jaxstep.core.trees import path_name
from jaxstep.errors import ConfigError
from jaxstep.models import (
  export_folder,
  gpt,
  hf_export,
  hf_gpt2,
  layers,
  llama,
  lora,
  safetensors_out,
)
from jaxstep.models.gpt import GPTConfig
from jaxstep.models.hf_dense import PHI3
from jaxstep.models.hf_weights import hf_names
from jaxstep.models.llama import LlamaConfig
from jaxstep.models.rope import LongRope

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel → LoraModel → the transformers model
GPT2_MODULES = {"qkv": "c_attn", "proj": "attn.c_proj", "fc": "c_fc", "out": "mlp.c_proj"}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_ranks(cfg: LlamaConfig | GPTConfig, architecture: str | None) -> dict[str, int]:
  """Per fused module with more than one adapted part, how many are (Phi-3's)."""
  if architecture != PHI3:
    return {}
  counts = {m: sum(cfg.lora.adapts(p) for p in parts) for m, parts in FUSED.items()}
  return {m: n for m, n in counts.items() if n > 1}


def adapted(cfg: LlamaConfig | GPTConfig) -> tuple[str, ...]:
  """The projections ``cfg``'s adapters sit on, in the model's order."""
  projections = gpt.PROJECTIONS if isinstance(cfg, GPTConfig) else llama.PROJECTIONS
  return tuple(p for p in projections if cfg.lora.adapts(p))


def target_modules(cfg: LlamaConfig | GPTConfig, architecture: str | None = None) -> list[str]:
  """PEFT's ``target_modules``: names that select exactly the adapted projections."""
  names = adapted(cfg)
  if not isinstance(cfg, GPTConfig):
    fused = {p: m for m, parts in FUSED.items() for p in parts} if architecture == PHI3 else {}
    return list(dict.fromkeys(fused.get(p, p) for p in names))
  modules = [GPT2_MODULES[p] for p in names]
  if "attn.c_proj" in modules and "mlp.c_proj" in modules:
    modules = [m for m in modules if m not in ("attn.c_proj", "mlp.c_proj")] + ["c_proj"]
  return modules


def routed(cfg: LlamaConfig | GPTConfig) -> tuple[str, ...]:
  """The routed-expert parameters ``cfg``'s adapters sit on (``lora.ROUTED`` order)."""
  if isinstance(cfg, GPTConfig) or not cfg.num_experts:
    return ()
  return tuple(p for p in lora.ROUTED if cfg.lora.adapts(p))


def adapter_config(
  cfg: LlamaConfig | GPTConfig, base_model_name_or_path: str = "", architecture=None
) -> dict:
  """``adapter_config.json`` of ``cfg``'s adapters: PEFT's ``LoraConfig`` fields that say what
  the adapters compute (the rest left to PEFT's defaults); ``architecture``: the base's
  (Phi-3's fused projections get their ranks and alphas by pattern)."""
  alpha = cfg.lora.alpha
  fused = fused_ranks(cfg, architecture)
  return {
    "alpha_pattern": {m: n * alpha for m, n in fused.items()},
    "auto_mapping": None,
    "base_model_name_or_path": base_model_name_or_path,
    "bias": "none",
    "fan_in_fan_out": isinstance(cfg, GPTConfig),  # GPT-2's Conv1D stores [in, out]
    "inference_mode": True,
    "init_lora_weights": True,
    "layers_pattern": None,
    "layers_to_transform": None,
    "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
    "lora_dropout": float(cfg.lora.dropout),  # both drop the adapter's input x
    "modules_to_save": None,
    "peft_type": "LORA",
    "r": cfg.lora.rank,
    "rank_pattern": {m: n * cfg.lora.rank for m, n in fused.items()},
    "revision": None,
    "target_modules": target_modules(cfg, architecture),
    "task_type": "CAUSAL_LM",
    "use_dora": False,
    "use_rslora": False,
    # routed experts only: a PEFT older than target_parameters may refuse the key
    **({"target_parameters": [f"mlp.{p}" for p in routed(cfg)]} if routed(cfg) else {}),
  }


def adapter_tensors(
  cfg: LlamaConfig | GPTConfig, params: dict, architecture: str | None = None
) -> list[hf_export.Tensor]:
  """Every adapter tensor of the file, block by block, checked against the projections'
  shapes and ``cfg``'s rank (nothing is gathered yet). Params' layout is read from the tree;
  ``architecture`` names the modules (Phi-3's fused ones: one adapter per module)."""
  stacked = bool(layers.layout_of(params))
  targets, out, stored = set(adapted(cfg)), [], set()
  entries = hf_names(cfg, architecture=architecture)
  for name, run in itertools.groupby(entries, key=lambda entry: entry[1]):
    paths = [path for path, _, _ in run if path[0] == "blocks" and path[-1] == "kernel"]
    pairs = {p: _pair(cfg, params, p, stacked, stored) for p in paths if p[-2] in targets}
    if not pairs:
      continue
    module = PREFIX + name.removesuffix(".weight")
    a, b = _stacked_pair(params, paths, pairs, stacked, cfg.lora.rank)
    out += [
      hf_export.Tensor(f"{module}.lora_A.weight", *a),
      hf_export.Tensor(f"{module}.lora_B.weight", *b),
    ]
  out += _routed_tensors(cfg, params, stacked, stored)
  _check_all_written(params, stored)
  return out


def _pair(cfg, params: dict, path: tuple, stacked: bool, stored: set[str]) -> tuple:
  """The ``(A, B)`` fetchers of the adapter on the projection at ``path``, each leaf checked
  against the projection's shape and ``cfg``'s rank."""
  fan_in, fan_out = hf_export.leaf_shape(params, path, stacked)
  fetches = []
  for leaf, shape in (("lora_a", (fan_in, cfg.lora.rank)), ("lora_b", (cfg.lora.rank, fan_out))):
    where = (*path[:-1], "lora", leaf)
    if (got := hf_export.leaf_shape(params, where, stacked)) != shape:
      raise ConfigError(f"params{hf_export.spell(where)} has shape {got}, the config needs {shape}")
    stored.add("/".join(map(str, hf_export.stored_path(where, stacked)[0])))
    fetches.append(
      hf_export.fetcher(params, where, stacked, hf_gpt2.columns(cfg, where, to_hf=True))
    )
  return tuple(fetches)


def _stacked_pair(params: dict, paths: list, pairs: dict, stacked: bool, r: int) -> tuple:
  """``(fetch, transposed, shape)`` of a module's ``lora_A`` and ``lora_B``: one projection's
  own, or the fused module's (the adapted parts' ``A`` side by side, ``B`` block-diagonal
  over all parts' output columns)."""
  fan_in = hf_export.leaf_shape(params, paths[0], stacked)[0]
  widths = [hf_export.leaf_shape(params, p, stacked)[1] for p in paths]
  n = len(pairs)
  if len(paths) == 1:
    ((fetch_a, fetch_b),) = pairs.values()
    return (fetch_a, True, (r, fan_in)), (fetch_b, True, (widths[0], r))

  def fetch_a():
    return np.concatenate([np.asarray(a()) for a, _ in pairs.values()], axis=-1)

  def fetch_b():
    b, row, column = np.zeros((n * r, sum(widths)), np.float32), 0, 0
    for path, width in zip(paths, widths, strict=True):
      if path in pairs:
        b[row : row + r, column : column + width] = np.asarray(pairs[path][1]())
        row += r
      column += width
    return b

  return (fetch_a, True, (n * r, fan_in)), (fetch_b, True, (sum(widths), n * r))


def _routed_tensors(cfg, params: dict, stacked: bool, stored: set[str]) -> list[hf_export.Tensor]:
  """The routed experts' adapter tensors in PEFT's ``ParamWrapper`` layout (module
  docstring), checked against the experts' shapes and ``cfg``'s rank."""
  names, out = routed(cfg), []
  if not names:
    return out
  e, r, d, f = cfg.num_experts, cfg.lora.rank, cfg.d_model, cfg.expert_size
  fans = {"experts.gate_up_proj": ("gate_up", d, 2 * f), "experts.down_proj": ("down", f, d)}
  for i in (i for i, sparse in enumerate(cfg.moe_layers) if sparse):
    for nested, name in enumerate(names):
      node, fan_in, fan_out = fans[name]
      module = f"{PREFIX}model.layers.{i}.mlp.experts" + ".base_layer" * (len(names) - 1 - nested)
      for leaf, tag, shape in (
        ("lora_a", "lora_A", (e, fan_in, r)),
        ("lora_b", "lora_B", (e, r, fan_out)),
      ):
        where = ("blocks", i, "mlp", "experts", node, "lora", leaf)
        if (got := hf_export.leaf_shape(params, where, stacked)) != shape:
          raise ConfigError(
            f"params{hf_export.spell(where)} has shape {got}, the config needs {shape}"
          )
        stored.add("/".join(map(str, hf_export.stored_path(where, stacked)[0])))
        fetch = hf_export.fetcher(params, where, stacked, _peft_layout(leaf))
        hf_shape = (e * r, fan_in) if leaf == "lora_a" else (fan_out, r * e)
        out.append(hf_export.Tensor(f"{module}.{tag}.weight", fetch, False, hf_shape))
  return out


def _peft_layout(leaf: str):
  """``A`` ``[E, in, r]`` → ``[E·r, in]``; ``B`` ``[E, r, out]`` → ``[out, r·E]`` (r major)."""
  if leaf == "lora_a":
    return lambda a: np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, a.shape[1]))
  return lambda b: np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[2], -1))


def _check_all_written(params: dict, stored: set[str]) -> None:
  """``ConfigError`` for adapter leaves of ``params`` that ``cfg`` does not adapt (they would
  be lost): the params were trained with other ``model.lora.targets``."""
  import jax

  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  extra = [name for p, _ in leaves if "/lora/" in (name := path_name(p)) and name not in stored]
  if extra:
    raise ConfigError(
      f"params hold {len(extra)} adapter leaves the config does not adapt: {', '.join(extra[:3])}"
    )


def save_adapter(
  folder: str | pathlib.Path,
  model_cfg: LlamaConfig | GPTConfig,
  params: dict,
  *,
  base_model_name_or_path: str,
  dtype: str = "float32",
  extra_files: Iterable[str | pathlib.Path] = (),
  provenance: dict | None = None,
  protected: export_folder.Protected = None,
  architecture: str | None = None,
) -> pathlib.Path:
  """Writes the adapters in ``params`` of ``model_cfg``'s model as a PEFT adapter folder at
  ``folder``; returns it.

  ``base_model_name_or_path``: the model the adapters apply to (the run's
  ``model.init_from``; ``""`` for a model trained from scratch). ``dtype``: of the written
  tensors, ``float32`` or ``bfloat16``. ``extra_files`` (the run's tokenizer files) are
  copied in, ``provenance`` goes into the folder's marker; ``architecture``: the base
  model's (``hf_export.MODEL_TYPES``; it names the modules; None: Phi-3's fused modules for
  a model with a partial rotary share or LongRoPE, jaxstep's projections otherwise: pass a
  Phi-3 folder's, whose model may have neither). Written whole or not at all; an
  existing folder is replaced only if jaxstep wrote it and it is none of ``protected``
  (``export_folder``'s rules).

  Raises:
    ConfigError: ``model_cfg`` has no adapters (``model.lora.rank`` 0), an unknown
      ``dtype``, params that do not match ``model_cfg``, or a ``folder`` that may not be
      written (left untouched).
  """
  folder = pathlib.Path(folder)
  if not model_cfg.lora.rank:
    raise ConfigError("the model has no adapters (model.lora.rank is 0): nothing to save")
  if dtype not in hf_export.DTYPES:
    raise ConfigError(f"dtype must be one of {', '.join(hf_export.DTYPES)}, got {dtype!r}")
  if architecture is None and isinstance(model_cfg, LlamaConfig):
    phi3 = model_cfg.partial_rotary_factor != 1 or isinstance(model_cfg.rope_scaling, LongRope)
    architecture = PHI3 if phi3 else None
  config = adapter_config(model_cfg, base_model_name_or_path, architecture)
  tensors = adapter_tensors(model_cfg, params, architecture)

  def fill(staging: pathlib.Path) -> None:
    # one file (adapters are small: PEFT never shards them)
    safetensors_out.write_file(staging / WEIGHTS, tensors, dtype)
    (staging / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

  provenance = {"kind": "adapter", **(provenance or {})}
  return export_folder.write(
    folder, fill, provenance=provenance, protected=protected, extra_files=extra_files
  )
