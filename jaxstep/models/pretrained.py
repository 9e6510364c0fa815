"""A local Hugging Face model folder as one object: its model config, its params (each
tensor placed where you want it as it is read), its tokenizer with the folder's own special
ids, its chat template and its ``config.json``; and back out with ``save``.

Nothing is downloaded and torch is never imported: ``config.json`` is read by
``models.hf_config``, the safetensors weights by ``models.hf_weights`` (numpy, bf16 through
``ml_dtypes``), the tokenizer by ``jaxstep.data.hf_folder``. docs/pretrained.md has the supported
architectures and what is refused.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np

from jaxstep.data import hf_folder
from jaxstep.errors import ConfigError
from jaxstep.models import GPTConfig, LlamaConfig, hf_config, hf_export, hf_weights, lora


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """What ``load_pretrained`` read from a folder."""

  config: LlamaConfig | GPTConfig  # the model's shape, plus the kernel options given
  params: dict  # per-block layout unless scan_layers; leaves as ``place`` returned them
  tokenizer: object  # jaxstep.data.hf_folder's tokenizer: the folder's special ids, stop ids
  chat_template: str | None  # the jinja2 template (render with jaxstep.data.hf_folder.render_chat)
  hf_config: dict  # the folder's config.json, kept so an export writes what it does not know
  architecture: str  # e.g. "LlamaForCausalLM"
  path: pathlib.Path
  # the weights' full fingerprint (``hf_weights.FingerprintDigest``), hashed as they were read
  fingerprint: str = ""

  def save(self, folder, params=None, *, dtype: str = "float32", **kwargs) -> pathlib.Path:
    """``params`` (default: the ones read) as a complete Hugging Face folder: ``config.json``
    (this folder's, updated with what jaxstep knows), safetensors weights, and this
    folder's tokenizer, generation config and chat template files beside them, so
    ``transformers.AutoModelForCausalLM.from_pretrained`` and its tokenizer load it as it
    is. ``folder`` must be new, empty or an earlier export, never the folder these weights
    were read from (``export_folder``'s rules). With adapters (loaded with ``lora``) they
    are merged into the weights, ``W + (α/r)·A·B``, as ``jaxstep export`` merges a LoRA
    run's; ``peft_export.save_adapter(…, architecture=self.architecture)`` writes them
    alone instead. ``kwargs``:
    ``hf_export.save_pretrained``'s (``max_shard_bytes``)."""
    config, params = self.config, self.params if params is None else params
    if config.lora.rank:
      params = lora.merged(params, config.lora.scale)
      config = dataclasses.replace(config, lora=lora.LoraConfig())
    return hf_export.save_pretrained(
      folder,
      config,
      params,
      architecture=self.architecture,
      dtype=dtype,
      base_config=self.hf_config,
      extra_files=hf_folder.tokenizer_files(self.path),
      provenance={"source": str(self.path.resolve())},
      protected={self.path: "the folder these weights were read from"},
      special_ids=hf_export.token_ids(self.tokenizer),
      **kwargs,
    )


def load_pretrained(
  path: str | pathlib.Path,
  *,
  dtype=np.float32,
  place: Callable[[tuple, np.ndarray], object] | None = None,
  seed: int = 0,
  **model_options,
) -> Pretrained:
  """Reads a local Hugging Face model folder (``config.json``, ``model.safetensors`` or a
  sharded index, ``tokenizer.json`` or ``tokenizer.model`` with ``tokenizer_config.json``).

  Args:
    path: the folder.
    dtype: the params' dtype on the host (fp32 masters by default; the folder's bf16 is
      widened exactly).
    place: ``(params path, numpy array) -> leaf``, called per tensor as it is read (e.g.
      ``jax.device_put`` onto the leaf's sharding), so a model that only fits sharded never
      sits whole on one device; default: numpy arrays. With ``scan_layers`` the per-layer
      leaves are then stacked (each stacked leaf exists twice for a moment).
    seed: the seed of the adapters' initial ``A`` with ``lora`` (``B`` starts at zero, so
      the model computes what the folder's weights compute).
    **model_options: model settings the folder does not decide: ``attention``, ``remat``,
      ``scan_layers`` (the params are then stacked), ``max_seq_len``, ``dropout``, ``lora``
      (a ``LoraConfig``: the params then hold fresh adapters beside the folder's weights,
      ready for ``make_train_step(..., trainable=freeze.by_patterns([lora.ADAPTER]))``).

  Raises:
    ConfigError: no ``config.json``, an unsupported architecture or setting (named), a
      mixture of experts' sliding window shorter than ``max_seq_len``, a missing,
      mis-shaped or unused tensor (named), a ``vocab_size`` smaller than the tokenizer.
      DataError: the tokenizer files.
  """
  path = pathlib.Path(path)
  hf, where = hf_config.read_config(path), str(path / hf_config.CONFIG)
  arch = hf_config.architecture(hf, where)
  scanned = model_options.pop("scan_layers", False)  # read per block, then stacked
  per_block = hf_config.model_config(hf, where, **model_options)
  hf_config.check_sliding_window(hf, per_block.max_seq_len, where)
  tokenizer = hf_folder.folder_tokenizer(path)
  if tokenizer.vocab_size > per_block.vocab_size:  # an id past the embedding's last row
    raise ConfigError(
      f"{where}: vocab_size {per_block.vocab_size} is smaller than the folder's tokenizer "
      f"({tokenizer.vocab_size} ids): ids past it have no embedding row, so the tokenizer "
      f"and the weights do not belong together"
    )
  unused = hf_weights.unused_tensors(path, per_block)
  if unused:
    raise ConfigError(
      f"{path}: {len(unused)} tensor(s) that {arch} as jaxstep builds it has no place for, "
      f"e.g. {', '.join(unused[:3])}; loading would drop them"
    )
  digest = hf_weights.FingerprintDigest()
  params = hf_weights.read_params(path, per_block, dtype=dtype, place=place, digest=digest)
  config = dataclasses.replace(per_block, scan_layers=scanned)
  if scanned:
    from jaxstep.models import layers

    params = layers.convert_layout(params, scan_layers=True)
  if config.lora.rank:
    params = lora.attach(params, config, seed)
  return Pretrained(
    config=config,
    params=params,
    tokenizer=tokenizer,
    chat_template=tokenizer.chat_template,
    hf_config=hf,
    architecture=arch,
    path=path,
    fingerprint=digest.value,
  )
