"""A Llama-family model's (or the bundled GPT's, as GPT-2: ``hf_gpt2.py``) params written
out as a Hugging Face model folder: ``config.json``
plus ``model.safetensors`` (or shards ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json``), the layout transformers' ``save_pretrained`` writes and
``from_pretrained`` reads.

The inverse of ``hf_config`` + ``hf_weights``: tensor names are ``hf_weights.hf_names``',
kernels are transposed back to PyTorch's ``[out, in]``, norms' ``scale`` is ``weight``, the
GPT's fused q/k/v columns go back to GPT-2's order (``hf_gpt2.columns``), a mixture of
experts' stacked leaves are written one tensor per expert (``hf_moe``).
Params may be in either layout (per block or stacked by ``model.scan_layers``) and may be
jax arrays sharded over devices: each tensor is gathered to the host on its own (a stacked
leaf one layer at a time) and written before the next is gathered, so host memory holds one
tensor at a time, never the whole model.

``config.json`` says what the model was trained as, so that transformers builds that model
and not its class's defaults: the special token ids (the base folder's, else the run's
tokenizer's, written also when unknown, as null: GPT-2's default 50256 lies outside a small
vocabulary) and every dropout rate the family's config has (``dropout_fields``).
``generation_config.json`` is the base folder's with the ids it lacks filled in, or one of
the ids alone, so a plain ``generate()`` stops at the end-of-text id the model learned.

The folder is written beside its target under a temporary name and renamed into place at
the end (``export_folder``): a failure or a kill leaves no half-written folder behind, and
only a folder jaxstep wrote itself is ever replaced.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import pathlib
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from jaxstep.core.trees import key_name
from jaxstep.errors import ConfigError
from jaxstep.models import export_folder, hf_dense, hf_gemma, hf_gpt2, hf_moe, layers
from jaxstep.models.gpt import GPTConfig
from jaxstep.models.hf_config import ARCHITECTURES, CONFIG, json_object, set_rope
from jaxstep.models.hf_weights import expected_shapes, hf_names, leaf_of
from jaxstep.models.llama import LlamaConfig
from jaxstep.models.safetensors_out import Tensor, write_weights

MODEL_TYPES = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "mistral",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
  "Olmo2ForCausalLM": "olmo2",
  "GraniteForCausalLM": "granite",
  "SmolLM3ForCausalLM": "smollm3",
  "Phi3ForCausalLM": "phi3",
  "Gemma2ForCausalLM": "gemma2",
  "Gemma3ForCausalLM": "gemma3_text",
  **{name: family.model_type for name, family in hf_moe.ARCHITECTURES.items()},
}
DTYPES = ("float32", "bfloat16")
GENERATION = "generation_config.json"  # the file hf_folder reads a folder's stop ids from
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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
  special_ids: Mapping[str, int | None] | None = None,
) -> pathlib.Path:
  """Writes ``params`` of ``cfg``'s model as a Hugging Face folder at ``folder``; returns it.

  ``architecture``: a key of ``hf_config.ARCHITECTURES`` that matches ``cfg`` (Qwen2 needs
  q/k/v biases, Qwen3 q/k norms, Llama and Mistral neither), or for a mixture of experts
  one of ``hf_moe.ARCHITECTURES`` (``hf_moe.check_export``). ``dtype``: of the written
  tensors, ``float32`` or ``bfloat16``. ``max_shard_bytes``: a weights file grows up to this
  many bytes before the next is started (one tensor larger than it gets a file of its own),
  as transformers' ``max_shard_size``. ``base_config``: the ``config.json`` dict of the folder
  the model was imported from; its fields jaxstep does not know (token ids, generation
  settings) are kept. ``extra_files`` (tokenizer files) are copied in, ``provenance`` (the
  run and step) goes into the folder's marker. ``special_ids``: the BOS/EOS/PAD ids of the
  tokenizer the model was trained with (``token_ids``), for the ids that neither
  ``base_config`` nor a ``generation_config.json`` among ``extra_files`` gives; that file
  is written with the ids it lacks filled in, or built from the ids when there is none
  (``generation_config``). The folder is written whole or not at all, and an existing one
  is replaced only if jaxstep wrote it and it is none of ``protected`` (``export_folder``'s
  rules).

  Raises:
    ConfigError: an unknown ``architecture`` or ``dtype``, params that do not match ``cfg``,
      an unreadable ``generation_config.json``, or a ``folder`` that may not be written
      (left untouched).
  """
  folder = pathlib.Path(folder)
  if dtype not in DTYPES:
    raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  if max_shard_bytes <= 0:
    raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
  extra_files = [pathlib.Path(f) for f in extra_files]
  source = next((f for f in extra_files if f.name == GENERATION), None)
  settings = json_object(source) if source is not None else {}
  fallback = {**(special_ids or {}), **_valid_ids(settings, cfg.vocab_size)}
  hf = export_config(cfg, architecture, dtype=dtype, base_config=base_config, special_ids=fallback)
  generation = generation_config(settings, hf, cfg.vocab_size)
  if source is not None and generation == settings:  # copied as it is: the same file
    generation = None
  tensors = tensors_of(cfg, params, architecture)

  def fill(staging: pathlib.Path) -> None:
    write_weights(staging, tensors, dtype, max_shard_bytes)
    (staging / CONFIG).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if generation is not None:
      (staging / GENERATION).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")

  provenance = {"kind": "model", "architecture": architecture, **(provenance or {})}
  if generation is not None:  # written above, its ids filled in
    extra_files = [f for f in extra_files if f.name != GENERATION]
  return export_folder.write(
    folder, fill, provenance=provenance, protected=protected, extra_files=extra_files
  )


def generation_config(settings: dict, hf: dict, vocab_size: int) -> dict:
  """The ``generation_config.json`` of an export: ``settings`` (the base folder's, ``{}``
  without one) with each special id it lacks, or that is no id of the vocabulary, taken
  from ``config.json``'s ``hf``. transformers' ``generate`` reads its stop id from this file
  alone when the folder has one: a base's file without ``eos_token_id`` would generate past
  the end of text whatever ``config.json`` says. A base's file that names every id is
  copied unchanged (the folder's tokenizer files stay the same files)."""
  out = dict(settings)
  for key in TOKEN_IDS:
    if not _is_id(settings.get(key), vocab_size) and (hf[key] is not None or key in settings):
      out[key] = hf[key]
  return out


def token_ids(tokenizer) -> dict[str, int | None]:
  """The special ids ``tokenizer`` (a run's, ``jaxstep.data``'s) trained the model with, by
  ``config.json``'s names: a jaxstep tokenizer's ``BOS``/``EOS``/``PAD`` (the byte
  tokenizer's 257, 258, 256); a model folder's (``hf_folder``) only the ids it declares:
  its BOS may be none (Qwen), and without a pad token it pads with EOS, which it never
  called a pad id."""
  declared = getattr(tokenizer, "template_tokens", None)
  if declared is None:
    return dict(zip(TOKEN_IDS, (tokenizer.BOS, tokenizer.EOS, tokenizer.PAD), strict=True))
  pad = tokenizer.PAD if declared.get("pad_token") is not None else None
  return dict(zip(TOKEN_IDS, (tokenizer.bos_id, tokenizer.EOS, pad), strict=True))


def _is_id(value, vocab_size: int) -> bool:
  """An id of a vocabulary of ``vocab_size`` (or a non-empty list of them: several EOS)."""
  values = value if isinstance(value, list) and value else [value]
  return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values)


def _valid_ids(hf: Mapping, vocab_size: int) -> dict:
  """The special ids ``hf`` sets that are ids of the vocabulary (a GPT-2 config built from
  the class's defaults says 50256 whatever its size: no id of that model)."""
  return {k: hf[k] for k in TOKEN_IDS if _is_id(hf.get(k), vocab_size)}


def check_architecture(cfg: LlamaConfig | GPTConfig, architecture: str) -> None:
  """``ConfigError`` unless ``architecture`` is supported and has exactly ``cfg``'s q/k/v
  biases, q/k norms and norm placement (otherwise transformers would build other tensors
  than those written, or compute others); the bundled GPT is ``GPT2LMHeadModel``."""
  if isinstance(cfg, GPTConfig) or architecture == hf_gpt2.ARCHITECTURE:
    if not (isinstance(cfg, GPTConfig) and architecture == hf_gpt2.ARCHITECTURE):
      raise ConfigError(f"the bundled GPT exports as {hf_gpt2.ARCHITECTURE} and only as it")
    return
  supported = (*ARCHITECTURES, *hf_moe.ARCHITECTURES)
  if architecture not in supported:
    raise ConfigError(
      f"architecture {architecture!r} is not supported; supported: {', '.join(supported)}"
    )
  if architecture in hf_moe.ARCHITECTURES or hf_moe.needs_moe_architecture(cfg):
    hf_moe.check_export(cfg, architecture)
    return
  hf_dense.check_export(cfg, architecture)


def export_config(
  cfg: LlamaConfig | GPTConfig,
  architecture: str,
  *,
  dtype: str = "float32",
  base_config: dict | None = None,
  special_ids: Mapping[str, int | None] | None = None,
) -> dict:
  """The ``config.json`` dict of ``cfg``'s model: ``base_config`` (left unchanged) with the
  fields jaxstep knows updated, else one built from ``cfg`` alone.

  The special token ids are the base's where they are ids of the vocabulary, else
  ``special_ids``' (the run's tokenizer's), else null: each of the three is written, since
  a key left out is the class's default (GPT-2's 50256, Llama's 1 and 2), an id the model
  never trained with. Every dropout rate of the family's config is written
  (``dropout_fields``), or transformers would train with its defaults (GPT-2's 0.1).

  ``max_position_embeddings`` never shrinks below the base's: jaxstep's ``max_seq_len`` caps
  the training inputs, while rotary positions go as far as the original model's. RoPE is
  written in the layout(s) the base uses; a config built from scratch has both the older
  top-level ``rope_theta`` / ``rope_scaling`` (transformers 4; a LongRoPE's with its
  attention factor, which some transformers 4 releases do not accept) and
  ``rope_parameters`` (transformers 5), which agree."""
  check_architecture(cfg, architecture)
  if isinstance(cfg, GPTConfig):
    hf = hf_gpt2.export_config(cfg, dtype=dtype, base_config=copy.deepcopy(base_config))
  else:
    hf = _llama_config(cfg, architecture, dtype=dtype, base_config=base_config)
  hf.update(dropout_fields(cfg, architecture))
  fallback = _valid_ids(special_ids or {}, cfg.vocab_size)
  ids = {**dict.fromkeys(TOKEN_IDS), **fallback, **_valid_ids(hf, cfg.vocab_size)}
  hf.update({k: ids[k] for k in TOKEN_IDS})
  return hf


def dropout_fields(cfg: LlamaConfig | GPTConfig, architecture: str) -> dict:
  """Every dropout rate of ``architecture``'s transformers config, as the model trained.

  jaxstep drops the embeddings and the attention's and the MLP's outputs at
  ``model.dropout``, never the attention probabilities. GPT-2 has the same three places
  (``embd_pdrop``, ``resid_pdrop`` for both outputs) and a rate for the attention
  probabilities (``attn_pdrop``: 0 here); ``summary_first_dropout`` belongs to a
  classification head jaxstep does not have, and gets the run's rate. The Llama family's
  only rate is ``attention_dropout``, on the attention probabilities: 0. Its models have
  no dropout on the embeddings or the residual branches, so a Llama-family run's
  ``model.dropout`` has no field there (inference is the same either way); Phi-3's has
  (``resid_pdrop``: on both outputs; ``embd_pdrop``, which transformers 5 reads but does
  not apply)."""
  if architecture == hf_gpt2.ARCHITECTURE:
    rate = float(cfg.dropout)
    return {
      "embd_pdrop": rate,
      "resid_pdrop": rate,
      "attn_pdrop": 0.0,
      "summary_first_dropout": rate,
    }
  if architecture == hf_dense.PHI3:  # transformers 5 reads no embd_pdrop; written as run
    return {
      "attention_dropout": 0.0,
      "resid_pdrop": float(cfg.dropout),
      "embd_pdrop": float(cfg.dropout),
    }
  return {"attention_dropout": 0.0}


def _llama_config(cfg: LlamaConfig, architecture: str, *, dtype: str, base_config) -> dict:
  """``export_config``'s dict for the Llama family, without ids and dropout."""
  hf = copy.deepcopy(base_config) if base_config else {}
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
  if architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):  # biases: no field
    hf["attention_bias"] = False
  if architecture in hf_moe.ARCHITECTURES:
    hf.update(hf_moe.export_fields(cfg, architecture, hf, fresh=not base_config))
  hf.update(hf_dense.export_fields(cfg, architecture))
  hf.update(hf_dense.window_fields(cfg, architecture))
  if architecture in hf_gemma.GEMMAS:  # the activation named otherwise
    hf.pop("hidden_act", None)
    hf.update(hf_gemma.export_fields(cfg, longest, architecture))
  if architecture != hf_gemma.GEMMA3:  # Gemma 3's RoPE is keyed by layer type
    set_rope(hf, cfg, fresh=not base_config)
  for key in [k for k in ("torch_dtype", "dtype") if k in hf] or ["torch_dtype", "dtype"]:
    hf[key] = dtype
  return hf


def tensors_of(cfg: LlamaConfig | GPTConfig, params: dict, architecture=None) -> list[Tensor]:
  """Every tensor of the export, in ``hf_names`` order (as ``architecture`` names them),
  checked against ``cfg``'s shapes (nothing is gathered yet). ``params``' layout (per
  block or stacked) is read from the tree itself."""
  stacked = bool(layers.layout_of(params))
  shapes = expected_shapes(dataclasses.replace(cfg, scan_layers=False))
  _check_leaves(params, shapes, stacked)
  out = []
  for path, name, transposed in hf_names(cfg, architecture=architecture):
    fetch = fetcher(params, path, stacked, hf_gpt2.columns(cfg, path, to_hf=True))
    shape = leaf_shape(params, path, stacked)
    if shape != shapes[path]:
      raise ConfigError(f"params{spell(path)} has shape {shape}, the config needs {shapes[path]}")
    out.append(Tensor(name, fetch, transposed, shape[::-1] if transposed else shape))
  return fused(out)


def fused(tensors: list[Tensor]) -> list[Tensor]:
  """``tensors`` with each run of one name made one tensor, its parts' output rows stacked
  in turn (Phi-3's q, k, v in ``qkv_proj``; gate, up in ``gate_up_proj``): kernels
  ``[in, out_j]`` side by side, written transposed."""
  out = []
  for name, run in itertools.groupby(tensors, key=lambda t: t.name):
    run = list(run)
    if len(run) == 1:
      out += run
      continue
    fetches = [t.fetch for t in run]
    fetch = lambda fetches=fetches: np.concatenate([np.asarray(f()) for f in fetches], axis=-1)  # noqa: E731
    rows = sum(t.shape[0] for t in run)
    out.append(Tensor(name, fetch, True, (rows, *run[0].shape[1:])))
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
  """The shape of the tensor at per-block ``path`` in ``params`` (without the layer axis when
  ``stacked``, the expert axis for an expert's path); ``ConfigError`` when ``params`` lack it."""
  path, expert = leaf_of(path)
  shape = tuple(_lookup(params, path, stacked).shape)
  return shape[(stored_path(path, stacked)[1] is not None) + (expert is not None) :]


def fetcher(params: dict, path: tuple, stacked: bool, columns=None) -> Callable[[], object]:
  """A function returning the tensor at ``path`` (a stacked leaf sliced to its layer, and
  an expert's path to its expert, only when called, so one such copy exists at a time),
  its last axis reordered by ``columns`` (``hf_gpt2.columns``) on the host when given."""
  path, expert = leaf_of(path)
  leaf, (_, layer) = _lookup(params, path, stacked), stored_path(path, stacked)
  index = tuple(i for i in (layer, expert) if i is not None)
  fetch = (lambda: leaf) if not index else (lambda: leaf[index])
  if columns is None:
    return fetch
  import jax

  return lambda: columns(np.asarray(jax.device_get(fetch())))


def _check_leaves(params: dict, shapes: dict, stacked: bool) -> None:
  """``ConfigError`` for params leaves the config has no tensor for (they would be lost)."""
  import jax

  wanted = {tuple(map(str, stored_path(leaf_of(p)[0], stacked)[0])) for p in shapes}
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
