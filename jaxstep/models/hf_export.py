"""A Llama-family model's (or the bundled GPT's, as GPT-2: ``hf_gpt2.py``) params written
out as a Hugging Face model folder: ``config.json``
plus ``model.safetensors`` (or shards ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json``), the layout transformers' ``save_pretrained`` writes and
``from_pretrained`` reads.

The inverse of ``hf_config`` + ``hf_weights``: tensor names are ``hf_weights.hf_names``',
kernels are transposed back to PyTorch's ``[out, in]``, norms' ``scale`` is ``weight``, the
GPT's fused q/k/v columns go back to GPT-2's order (``hf_gpt2.columns``).
Params may be in either layout (per block or stacked by ``model.scan_layers``) and may be
jax arrays sharded over devices: each tensor is gathered to the host on its own (a stacked
leaf one layer at a time), so host memory holds at most one shard file's tensors
(``max_shard_bytes``), never the whole model.

The folder is written beside its target under a temporary name and renamed into place at
the end (``export_folder``): a failure or a kill leaves no half-written folder behind, and
only a folder jaxstep wrote itself is ever replaced.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from jaxstep.core.trees import key_name
from jaxstep.errors import ConfigError
from jaxstep.models import export_folder, hf_gpt2, layers
from jaxstep.models.gpt import GPTConfig
from jaxstep.models.hf_config import ARCHITECTURES, CONFIG, rope_settings
from jaxstep.models.hf_weights import INDEX, SINGLE, expected_shapes, hf_names
from jaxstep.models.llama import LlamaConfig

MODEL_TYPES = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "mistral",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
}
DTYPES = ("float32", "bfloat16")
SHARD = "model-{:05d}-of-{:05d}.safetensors"
ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class Tensor(NamedTuple):
  """One tensor to write: its HF name, how to fetch it (jaxstep layout, maybe on device),
  whether it is transposed on the way out, and its shape as the file lays it."""

  name: str
  fetch: Callable[[], object]
  transposed: bool
  shape: tuple


def save_pretrained(
  folder: str | pathlib.Path,
  cfg: LlamaConfig | GPTConfig,
  params: dict,
  *,
  architecture: str,
  dtype: str = "float32",
  max_shard_bytes: int = 5 * 2**30,
  base_config: dict | None = None,
  extra_files: Iterable[str | pathlib.Path] = (),
  provenance: dict | None = None,
  protected: export_folder.Protected = None,
) -> pathlib.Path:
  """Writes ``params`` of ``cfg``'s model as a Hugging Face folder at ``folder``; returns it.

  ``architecture``: a key of ``hf_config.ARCHITECTURES`` that matches ``cfg`` (Qwen2 needs
  q/k/v biases, Qwen3 q/k norms, Llama and Mistral neither). ``dtype``: of the written
  tensors, ``float32`` or ``bfloat16``. ``max_shard_bytes``: a weights file grows up to this
  many bytes before the next is started (one tensor larger than it gets a file of its own),
  as transformers' ``max_shard_size``. ``base_config``: the ``config.json`` dict of the folder
  the model was imported from; its fields jaxstep does not know (token ids, generation
  settings) are kept. ``extra_files`` (tokenizer files) are copied in, ``provenance`` (the
  run and step) goes into the folder's marker. The folder is written whole or not at all,
  and an existing one is replaced only if jaxstep wrote it and it is none of ``protected``
  (``export_folder``'s rules).

  Raises:
    ConfigError: an unknown ``architecture`` or ``dtype``, params that do not match ``cfg``,
      or a ``folder`` that may not be written (left untouched).
  """
  folder = pathlib.Path(folder)
  if dtype not in DTYPES:
    raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  if max_shard_bytes <= 0:
    raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
  hf = export_config(cfg, architecture, dtype=dtype, base_config=base_config)
  tensors = tensors_of(cfg, params)

  def fill(staging: pathlib.Path) -> None:
    _write_weights(staging, tensors, dtype, max_shard_bytes)
    (staging / CONFIG).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

  provenance = {"kind": "model", "architecture": architecture, **(provenance or {})}
  return export_folder.write(
    folder, fill, provenance=provenance, protected=protected, extra_files=extra_files
  )


def check_architecture(cfg: LlamaConfig | GPTConfig, architecture: str) -> None:
  """``ConfigError`` unless ``architecture`` is supported and has exactly ``cfg``'s q/k/v
  biases and q/k norms (otherwise transformers would build other tensors than those written);
  the bundled GPT is ``GPT2LMHeadModel``."""
  if isinstance(cfg, GPTConfig) or architecture == hf_gpt2.ARCHITECTURE:
    if not (isinstance(cfg, GPTConfig) and architecture == hf_gpt2.ARCHITECTURE):
      raise ConfigError(f"the bundled GPT exports as {hf_gpt2.ARCHITECTURE} and only as it")
    return
  if architecture not in ARCHITECTURES:
    raise ConfigError(
      f"architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )
  bias, qk_norm = ARCHITECTURES[architecture]
  if (cfg.attention_bias, cfg.qk_norm) != (bias, qk_norm):
    raise ConfigError(
      f"{architecture} has attention_bias={bias}, qk_norm={qk_norm}; the model has "
      f"attention_bias={cfg.attention_bias}, qk_norm={cfg.qk_norm}: pick the architecture "
      f"it was built as"
    )


def export_config(
  cfg: LlamaConfig | GPTConfig,
  architecture: str,
  *,
  dtype: str = "float32",
  base_config: dict | None = None,
) -> dict:
  """The ``config.json`` dict of ``cfg``'s model: ``base_config`` (left unchanged) with the
  fields jaxstep knows updated, else one built from ``cfg`` alone.

  ``max_position_embeddings`` never shrinks below the base's: jaxstep's ``max_seq_len`` caps
  the training inputs, while rotary positions go as far as the original model's. RoPE is
  written in the layout(s) the base uses; a config built from scratch has both the older
  top-level ``rope_theta`` / ``rope_scaling`` (transformers 4) and ``rope_parameters``
  (transformers 5), which agree."""
  check_architecture(cfg, architecture)
  if isinstance(cfg, GPTConfig):
    return hf_gpt2.export_config(cfg, dtype=dtype, base_config=copy.deepcopy(base_config))
  hf = copy.deepcopy(base_config) if base_config else _fresh(architecture)
  longest = max(cfg.max_seq_len, int(hf.get("max_position_embeddings") or 0))
  hf.update(
    architectures=[architecture],
    model_type=MODEL_TYPES[architecture],
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.d_model,
    intermediate_size=cfg.intermediate_size,
    num_hidden_layers=cfg.n_layers,
    num_attention_heads=cfg.n_heads,
    num_key_value_heads=cfg.resolved_kv_heads,
    head_dim=cfg.resolved_head_dim,
    max_position_embeddings=longest,
    rms_norm_eps=cfg.rms_norm_eps,
    tie_word_embeddings=cfg.tie_embeddings,
    hidden_act="silu",
  )
  if architecture != "Qwen2ForCausalLM":  # Qwen2's q/k/v biases are not a config field
    hf["attention_bias"] = False
  _set_rope(hf, cfg, fresh=not base_config)
  for key in [k for k in ("torch_dtype", "dtype") if k in hf] or ["torch_dtype", "dtype"]:
    hf[key] = dtype
  return hf


def _fresh(architecture: str) -> dict:
  """Fields a config built from scratch needs beyond the model's shape: Mistral's
  transformers default is a 4096-token sliding window, which this model does not have."""
  return {"sliding_window": None} if architecture == "MistralForCausalLM" else {}


def _rope_of(cfg: LlamaConfig) -> tuple[float, tuple | None]:
  """``cfg``'s RoPE as ``hf_config.rope_settings`` reads it back from a config."""
  scaling = cfg.rope_scaling
  if scaling is None:
    return float(cfg.rope_theta), None
  return float(cfg.rope_theta), tuple((k, float(getattr(scaling, k))) for k in ROPE_KEYS)


def _set_rope(hf: dict, cfg: LlamaConfig, *, fresh: bool) -> None:
  """Writes ``cfg``'s RoPE into ``hf`` unless it already says the same (then the base's own
  spelling is kept)."""
  theta, scaling = _rope_of(cfg)
  if not fresh:
    try:
      if rope_settings(hf) == (theta, scaling):
        return
    except ConfigError:  # a RoPE the base names but jaxstep does not compute: replaced
      pass
  old = None
  if scaling is not None:
    old = {"rope_type": "llama3", **dict(scaling)}
    old["original_max_position_embeddings"] = int(old["original_max_position_embeddings"])
  new_layout = fresh or isinstance(hf.get("rope_parameters"), dict)
  if new_layout:
    hf["rope_parameters"] = {"rope_type": "default", **(old or {}), "rope_theta": theta}
  if fresh or not new_layout or "rope_theta" in hf or hf.get("rope_scaling"):
    hf["rope_theta"], hf["rope_scaling"] = theta, old


def tensors_of(cfg: LlamaConfig | GPTConfig, params: dict) -> list[Tensor]:
  """Every tensor of the export, in ``hf_names`` order, checked against ``cfg``'s shapes
  (nothing is gathered yet). ``params``' layout (per block or stacked) is read from the
  tree itself."""
  stacked = bool(layers.layout_of(params))
  shapes = expected_shapes(dataclasses.replace(cfg, scan_layers=False))
  _check_leaves(params, shapes, stacked)
  out = []
  for path, name, transposed in hf_names(cfg):
    fetch = fetcher(params, path, stacked, hf_gpt2.columns(cfg, path, to_hf=True))
    shape = leaf_shape(params, path, stacked)
    if shape != shapes[path]:
      raise ConfigError(f"params{spell(path)} has shape {shape}, the config needs {shapes[path]}")
    out.append(Tensor(name, fetch, transposed, shape[::-1] if transposed else shape))
  return out


def spell(path: tuple) -> str:
  """A params path as an error message writes it: ``('blocks', 0, 'kernel')`` →
  ``['blocks'][0]['kernel']``."""
  return "".join(f"[{k!r}]" for k in path)


def _child(node, key):
  """``node[key]``, also when a checkpoint spelled an int block index as a string."""
  if key in node:
    return node[key]
  if str(key) in node:
    return node[str(key)]
  raise KeyError(key)


def stored_path(path: tuple, stacked: bool) -> tuple[tuple, int | None]:
  """Where a per-block path lives in ``params``: the path there and, when stacked, the
  layer's index along the leading axis."""
  if stacked and path[0] == "blocks":
    return ("blocks", *path[2:]), path[1]
  return path, None


def _lookup(params: dict, path: tuple, stacked: bool):
  where, _ = stored_path(path, stacked)
  node = params
  for key in where:
    try:
      node = _child(node, key)
    except (KeyError, TypeError):
      raise ConfigError(f"params lack {spell(where)}, which the config needs") from None
  return node


def leaf_shape(params: dict, path: tuple, stacked: bool) -> tuple:
  """The shape of the tensor at per-block ``path`` in ``params`` (one layer's, without the
  leading layer axis, when ``stacked``); ``ConfigError`` when ``params`` lack it."""
  shape = tuple(_lookup(params, path, stacked).shape)
  return shape[1:] if stored_path(path, stacked)[1] is not None else shape


def fetcher(params: dict, path: tuple, stacked: bool, columns=None) -> Callable[[], object]:
  """A function returning the tensor at ``path`` (a stacked leaf sliced to its layer only
  when called, so one layer's copy exists at a time), its last axis reordered by
  ``columns`` (``hf_gpt2.columns``) on the host when given."""
  leaf, (_, layer) = _lookup(params, path, stacked), stored_path(path, stacked)
  fetch = (lambda: leaf) if layer is None else (lambda: leaf[layer])
  if columns is None:
    return fetch
  import jax

  return lambda: columns(np.asarray(jax.device_get(fetch())))


def _check_leaves(params: dict, shapes: dict, stacked: bool) -> None:
  """``ConfigError`` for params leaves the config has no tensor for (they would be lost)."""
  import jax

  wanted = {tuple(map(str, stored_path(p, stacked)[0])) for p in shapes}
  found = jax.tree_util.tree_flatten_with_path(params)[0]
  extra = [p for p, _ in found if tuple(key_name(k) for k in p) not in wanted]
  if extra:
    names = ", ".join(jax.tree_util.keystr(p) for p in extra[:3])
    if any("lora" in map(key_name, p) for p in extra):
      raise ConfigError(
        f"params hold {len(extra)} LoRA adapter leaves ({names}) a model folder has no "
        f"tensor for: merge them into the weights first (params = "
        f"jaxstep.models.lora.merged(params, alpha / rank), as jaxstep export does), or write "
        f"them alone as a PEFT adapter (jaxstep.models.peft_export.save_adapter)"
      )
    raise ConfigError(f"params hold {len(extra)} leaves the config has no tensor for: {names}")


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
  """Tensor names per weights file, as ``huggingface_hub`` splits a state dict: in order,
  a new file when the next tensor would push the current one past ``max_bytes``; a tensor
  larger than ``max_bytes`` alone in a file of its own."""
  shards, current, size = [], [], 0
  for name, nbytes in sizes:
    if nbytes > max_bytes:
      shards.append([name])
      continue
    if size + nbytes > max_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(name)
    size += nbytes
  return [*shards, current] if current else shards


def numpy_dtype(dtype: str):
  """The numpy dtype a file's tensors are written in: ``bfloat16`` (``ml_dtypes``') or
  ``float32``."""
  import ml_dtypes

  return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def host(tensor: Tensor, dtype) -> np.ndarray:
  """The tensor on the host as the file lays it (cast to ``dtype``, transposed, contiguous):
  gathered here, one tensor at a time."""
  import jax

  array = np.asarray(jax.device_get(tensor.fetch())).astype(dtype, copy=False)
  return np.ascontiguousarray(array.T if tensor.transposed else array)


def _write_weights(staging: pathlib.Path, tensors: list[Tensor], dtype: str, max_bytes: int):
  """The safetensors files (and, for more than one, the index) into ``staging``, one file's
  tensors on the host at a time."""
  from safetensors.numpy import save_file

  np_dtype = numpy_dtype(dtype)
  itemsize = np.dtype(np_dtype).itemsize
  sizes = [(t.name, math.prod(t.shape) * itemsize) for t in tensors]
  shards = plan_shards(sizes, max_bytes)
  by_name = {t.name: t for t in tensors}
  weight_map = {}
  for i, names in enumerate(shards, 1):
    file = SINGLE if len(shards) == 1 else SHARD.format(i, len(shards))
    arrays = {name: host(by_name[name], np_dtype) for name in names}
    save_file(arrays, str(staging / file), metadata={"format": "pt"})
    del arrays
    weight_map.update(dict.fromkeys(names, file))
  if len(shards) > 1:
    metadata = {
      "total_parameters": sum(math.prod(t.shape) for t in tensors),
      "total_size": sum(n for _, n in sizes),
    }
    index = {"metadata": metadata, "weight_map": weight_map}
    (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
