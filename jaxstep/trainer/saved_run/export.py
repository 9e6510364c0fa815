"""A run directory's checkpoint written out as a Hugging Face model folder (``jaxstep
export``): ``config.json``, safetensors weights (sharded with an index past a size) and the
run's tokenizer files — its chat template and generation config among them — so
``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` load the folder
as it is.

The architecture is the one the run was imported as (its ``hf_config.json``, whose other
fields are kept), else the one the model's settings name: the bundled GPT is GPT-2; a
Llama-family model with q/k norms is Qwen3, with q/k/v biases Qwen2, with neither Llama; a
mixture of experts is ``hf_moe.architecture_for``'s (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral).
A run on the byte tokenizer gets the byte tokenizer written as a Hugging Face one
(``jaxstep.data.byte_folder``: the same ids), so the folder is a model folder like any other
(``AutoTokenizer``, a later run's ``model.init_from``). ``config.json`` and
``generation_config.json`` carry the BOS/EOS/PAD ids the run trained with (the imported
folder's, else the run's tokenizer's), so ``generate()`` stops at its end-of-text id. A
LoRA run's adapters are merged into the weights (``W + (α/r)·A·B``).

With ``adapter=True`` a LoRA run's adapters alone are written instead, in PEFT's format
(``peft_export``: ``adapter_config.json`` + ``adapter_model.safetensors``, ``A`` and ``B``
transposed to ``lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``), with the
run's tokenizer files; ``base_model_name_or_path`` is the run's ``model.init_from`` (``""``
for a model trained from scratch, whose base weights only a merged export carries).
``peft.PeftModel.from_pretrained(base, folder)`` then computes what the run computes.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile

from jaxstep.data import byte_folder, hf_folder
from jaxstep.errors import ConfigError
from jaxstep.models import (
  GPTConfig,
  LlamaConfig,
  export_folder,
  hf_config,
  hf_dense,
  hf_export,
  hf_gemma,
  hf_gpt2,
  hf_moe,
  lora,
  peft_export,
)
from jaxstep.models.rope import LongRope
from jaxstep.trainer.saved_run import load as saved_run


def architecture_of(model_cfg: LlamaConfig | GPTConfig, base: dict | None) -> str:
  """The base's architecture, else the one ``model_cfg``'s settings name."""
  if base is not None:
    return hf_config.architecture(base, saved_run.BASE_CONFIG)
  if isinstance(model_cfg, GPTConfig):
    return hf_gpt2.ARCHITECTURE
  if hf_moe.needs_moe_architecture(model_cfg):
    return hf_moe.architecture_for(model_cfg)
  if hf_dense.scaled(model_cfg):
    return hf_dense.GRANITE
  if model_cfg.nope_layers:
    return hf_dense.SMOLLM3
  gemma = (model_cfg.norm_offset, model_cfg.mlp_activation != "silu", model_cfg.scale_embeddings)
  gemma += (model_cfg.block_norms == "both", model_cfg.query_pre_attn_scalar)
  if model_cfg.attn_logit_softcapping or model_cfg.final_logit_softcapping:
    return hf_gemma.GEMMA2
  if any(gemma) or model_cfg.local_rope_theta:
    return hf_gemma.GEMMA3 if model_cfg.qk_norm or model_cfg.local_rope_theta else hf_gemma.GEMMA2
  if model_cfg.partial_rotary_factor != 1 or isinstance(model_cfg.rope_scaling, LongRope):
    return hf_dense.PHI3
  if model_cfg.sliding_window and not (model_cfg.qk_norm or model_cfg.attention_bias):
    return "MistralForCausalLM" if not model_cfg.full_layers else hf_dense.SMOLLM3
  if model_cfg.block_norms == "post":
    return "Olmo2ForCausalLM"
  if model_cfg.qk_norm:
    return "Qwen3ForCausalLM"
  return "Qwen2ForCausalLM" if model_cfg.attention_bias else "LlamaForCausalLM"


def export_run(
  run_dir: str | pathlib.Path,
  out: str | pathlib.Path,
  *,
  step: int | None = None,
  dtype: str = "float32",
  max_shard_bytes: int = 5 * 2**30,
  adapter: bool = False,
) -> tuple[pathlib.Path, int]:
  """Writes update step ``step`` (default: the newest valid checkpoint) of the run at
  ``run_dir`` as a model folder at ``out``; returns ``(out, step)``. ``out`` must be new,
  empty or an earlier export, and neither the run's base model (``model.init_from``) nor
  its tokenizer folder (``export_folder``'s rules). ``adapter``: write the LoRA adapters
  alone as a PEFT adapter folder (``max_shard_bytes`` unused); ``ConfigError`` for a run
  without adapters."""
  run_dir = pathlib.Path(run_dir)
  cfg = saved_run.read_config(run_dir)
  if adapter and not cfg.model.lora.rank:
    raise ConfigError(
      f"the run has no adapters ({run_dir} was trained with model.lora.rank=0): export it "
      f"without --adapter"
    )
  base_file = run_dir / saved_run.BASE_CONFIG
  base = json.loads(base_file.read_text()) if base_file.is_file() else None
  arch = architecture_of(cfg.model, base)
  hf_export.check_architecture(cfg.model, arch)  # before the checkpoint is read
  protected = {  # the base last: it names a folder that is both
    cfg.data.tokenizer: "the run's tokenizer (data.tokenizer)",
    cfg.model.init_from: "the run's base model (model.init_from)",
  }
  export_folder.check_target(pathlib.Path(out), protected)  # before the checkpoint is read
  saved = saved_run.load_run(run_dir, step)
  provenance = {"run": str(run_dir.resolve()), "step": saved.step}
  with tempfile.TemporaryDirectory(prefix="jaxstep-export-") as scratch:
    files = tokenizer_files(run_dir) or byte_folder.write_byte_tokenizer(scratch)
    if adapter:
      out = peft_export.save_adapter(
        out,
        cfg.model,
        saved.params,
        base_model_name_or_path=cfg.model.init_from,
        dtype=dtype,
        extra_files=files,
        provenance=provenance,
        protected=protected,
        architecture=arch,
      )
      return out, saved.step
    model_cfg, params = cfg.model, saved.params
    if model_cfg.lora.rank:  # adapters folded in: the folder is a plain model
      params = lora.merged(params, model_cfg.lora.scale)
      model_cfg = dataclasses.replace(model_cfg, lora=lora.LoraConfig())
    out = hf_export.save_pretrained(
      out,
      model_cfg,
      params,
      architecture=arch,
      dtype=dtype,
      max_shard_bytes=max_shard_bytes,
      base_config=base,
      extra_files=files,
      provenance=provenance,
      protected=protected,
      special_ids=hf_export.token_ids(saved.tokenizer),
    )
    return out, saved.step


def tokenizer_files(run_dir: pathlib.Path) -> list[pathlib.Path]:
  """The run's tokenizer files an export copies: those of the folder it was imported from
  (chat template and generation config among them), or its ``tokenizer.json`` /
  ``tokenizer.model``; none for the byte tokenizer."""
  tokenizer = saved_run.saved_tokenizer_file(run_dir)
  if tokenizer is not None and tokenizer.is_dir():
    return hf_folder.tokenizer_files(tokenizer)
  if tokenizer is not None and tokenizer.suffix in (".json", ".model"):
    return [tokenizer]
  return []
