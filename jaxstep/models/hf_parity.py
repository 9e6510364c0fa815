"""Does a Hugging Face folder run the same in jaxstep as in transformers? The first-divergence
idea of the accumulation check (``core/check.py``) applied to a conversion: both run the
same token ids and are compared stage by stage — embeddings → the output of each block →
the final norm → the logits — and the first stage past the tolerance is where they part.

jaxstep's side is the model ``load_pretrained`` builds (its config and fp32 params, read by
the same functions; the tokenizer is not needed), walked through its own modules
(``embed_inputs``, each block, ``norm``); its logits are the whole forward pass ``model(ids)``.
A mixture of experts' blocks are stages like any other (router, experts and shared expert
inside each), so a conversion error in one MoE layer shows at that block.
transformers' side is ``AutoModelForCausalLM`` with eager attention in fp32, its stages
caught by forward hooks on ``embed_tokens``, each decoder layer and ``norm``: not
``output_hidden_states``, whose last entry in current transformers is the *normed* output
of the last block, so the last block's own output would be missing from it.

torch and transformers are imported only when a report is made (``pip install
'jaxstep[test]'``); without them it is a ConfigError that says so.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstep.core.check import Stage
from jaxstep.errors import ConfigError
from jaxstep.models import GPT, GPTConfig, Llama, hf_config, hf_gpt2, hf_weights

TOLERANCE = 1e-4  # max |jaxstep - transformers| / max |transformers| per stage, fp32
DEFAULT_SHAPE = (2, 16)  # rows × ids of the default batch
INSTALL = "pip install 'jaxstep[test]' (or pip install torch transformers)"


@dataclasses.dataclass(frozen=True)
class ParityReport:
  """Where jaxstep and transformers agree on one folder, stage by stage; ``str()`` is the
  table (as the accumulation check's) and a verdict: PASS, or FAIL at the first stage
  that diverges."""

  stages: tuple[Stage, ...]
  architecture: str  # e.g. "Qwen3ForCausalLM"
  folder: pathlib.Path
  shape: tuple[int, int]  # rows × ids compared
  tolerance: float
  transformers_version: str

  @property
  def passed(self) -> bool:
    return all(s.passed for s in self.stages)

  @property
  def first_divergence(self) -> str | None:
    """The first stage over the tolerance (``"embeddings"``, ``"block 3"``, ``"final
    norm"``, ``"logits"``); None if all pass."""
    return next((s.name for s in self.stages if not s.passed), None)

  def __str__(self) -> str:
    rows, ids = self.shape
    lines = [
      f"jaxstep vs transformers {self.transformers_version} on {self.folder} "
      f"({self.architecture}, {rows} × {ids} ids, fp32, tolerance {self.tolerance:.0e} "
      "relative):",
      f"  {'stage':<16} {'max abs err':>12} {'max rel err':>12}  result",
    ]
    for s in self.stages:
      verdict = "PASS" if s.passed else "FAIL"
      lines.append(f"  {s.name:<16} {s.max_abs:>12.3e} {s.max_rel:>12.3e}  {verdict}")
    failed = self.first_divergence
    if failed is None:
      lines.append("PASS: every stage matches transformers")
    else:
      lines.append(
        f"FAIL: first divergence at '{failed}' (the stages after it inherit the difference)"
      )
    return "\n".join(lines)


def default_tokens(vocab_size: int, max_len: int) -> np.ndarray:
  """A fixed batch: ``DEFAULT_SHAPE`` ids drawn below ``vocab_size`` with seed 0, no
  padding (every row full), at most ``max_len`` ids long."""
  rows, ids = DEFAULT_SHAPE
  return np.random.default_rng(0).integers(0, vocab_size, (rows, min(ids, max_len)))


def _errors(ours, reference) -> tuple[float, float]:
  """Max abs error and max abs error over max ``|reference|`` (as the accumulation check);
  both infinite when the shapes differ."""
  a, b = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
  if a.shape != b.shape:  # not comparable at all: a divergence
    return float("inf"), float("inf")
  max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
  return max_abs, max_abs / max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-30)


def read_model(folder: pathlib.Path, seq_len: int):
  """``load_pretrained``'s model config and fp32 params of ``folder`` for ``seq_len`` ids,
  refused as it refuses them (an unsupported setting, a mixture of experts' sliding window
  shorter than the ids, a missing, mis-shaped or unused tensor), without its tokenizer:
  the comparison needs none, so a folder of weights alone can be checked."""
  hf, where = hf_config.read_config(folder), str(folder / hf_config.CONFIG)
  gpt = hf_config.architecture(hf, where) == hf_gpt2.ARCHITECTURE  # positions are weights
  config = hf_config.model_config(hf, where, **({} if gpt else {"max_seq_len": seq_len}))
  hf_config.check_sliding_window(hf, seq_len, where)
  if unused := hf_weights.unused_tensors(folder, config):
    raise ConfigError(
      f"{folder}: {len(unused)} tensor(s) that jaxstep's model has no place for, e.g. "
      f"{', '.join(unused[:3])}; it would compute without them"
    )
  return config, hf_weights.read_params(folder, config, dtype=np.float32)


def jaxstep_stages(config, params, tokens) -> list[np.ndarray]:
  """The embeddings, each block's output, the final norm and the logits of ``tokens``
  through the model of ``config`` with ``params`` (a ``load_pretrained``'s), no dropout."""
  module = GPT if isinstance(config, GPTConfig) else Llama
  abstract = nnx.eval_shape(lambda: module(config, rngs=nnx.Rngs(0)))
  graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
  rest = nnx.to_pure_dict(rest)

  @jax.jit
  def run(params, ids):
    model = nnx.merge(graphdef, params, rest, copy=True)
    x = model.embed_inputs(ids, jnp.arange(ids.shape[1]))
    stages = [x]
    for block in model.block_list():
      x = _hidden(block(x, rng=None, train=False))
      stages.append(x)
    final_norm = model.ln_f if module is GPT else model.norm
    return [*stages, final_norm(x), _hidden(model(ids))]  # the logits: the whole forward pass

  with jax.default_matmul_precision("highest"):  # fp32 dots, not TF32 on a GPU
    stages = run(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens))
  return [np.asarray(x) for x in stages]


def _hidden(out):
  """A block's (or the model's) output without a mixture of experts' routing sums."""
  return out[0] if isinstance(out, tuple) else out


def transformers_stages(folder, tokens) -> tuple[list[np.ndarray], str]:
  """The same stages from transformers' ``AutoModelForCausalLM`` (eager attention, fp32),
  and transformers' version."""
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ConfigError(
      f"comparing with transformers needs torch and transformers ({e}): {INSTALL}"
    ) from e

  bars = transformers.utils.logging.is_progress_bar_enabled()
  transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar
  try:
    model = transformers.AutoModelForCausalLM.from_pretrained(
      str(folder), attn_implementation="eager"
    )
  finally:
    if bars:
      transformers.utils.logging.enable_progress_bar()
  model = model.to(torch.float32).eval()  # a bf16 folder is widened exactly, as jaxstep's
  if hasattr(model, "transformer"):  # GPT-2: token + position embeddings, then dropout
    decoder = model.transformer
    modules = [decoder.drop, *decoder.h, decoder.ln_f]
  else:
    decoder = model.model
    modules = [decoder.embed_tokens, *decoder.layers, decoder.norm]
  caught: dict[int, np.ndarray] = {}

  def catch(i):
    def hook(module, inputs, output):
      output = output[0] if isinstance(output, tuple) else output  # transformers 4's layers
      caught[i] = output.detach().float().numpy()

    return hook

  handles = [m.register_forward_hook(catch(i)) for i, m in enumerate(modules)]
  try:
    with torch.no_grad():
      logits = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits
  finally:
    for h in handles:
      h.remove()
  stages = [caught[i] for i in range(len(modules))] + [logits.float().numpy()]
  # Granite multiplies the embeddings in the model's forward, after embed_tokens
  stages[0] = stages[0] * getattr(model.config, "embedding_multiplier", 1.0)
  return stages, transformers.__version__


def parity_report(folder, tokens=None, *, tolerance: float = TOLERANCE) -> ParityReport:
  """Runs ``tokens`` (``[B, S]`` ids; default ``default_tokens``) through the folder's model
  in jaxstep (``load_pretrained``, fp32) and in transformers, and compares every stage:
  PASS where ``max |jaxstep - transformers| / max |transformers|`` is at most ``tolerance``.

  Raises:
    ConfigError: a folder ``load_pretrained`` refuses; torch or transformers missing; ids
      outside the vocabulary or longer than the model's positions.
  """
  folder = pathlib.Path(folder)
  hf, where = hf_config.read_config(folder), str(folder / hf_config.CONFIG)
  shape = hf_config.model_config(hf, where)
  vocab, positions = shape.vocab_size, shape.max_seq_len
  tokens = default_tokens(vocab, positions) if tokens is None else np.asarray(tokens)
  if tokens.ndim != 2 or not tokens.size or not np.issubdtype(tokens.dtype, np.integer):
    raise ConfigError(f"tokens must be [rows, ids] integers, got {tokens.dtype} {tokens.shape}")
  if tokens.min() < 0 or tokens.max() >= vocab:
    raise ConfigError(f"token ids must be in [0, {vocab}), got {tokens.min()}…{tokens.max()}")
  if tokens.shape[1] > positions:
    raise ConfigError(f"{tokens.shape[1]} ids exceed the model's {positions} positions")
  config, params = read_model(folder, tokens.shape[1])
  reference, version = transformers_stages(folder, tokens)
  ours = jaxstep_stages(config, params, tokens)
  names = ["embeddings", *(f"block {i}" for i in range(config.n_layers)), "final norm"]
  stages = []
  for name, a, b in zip([*names, "logits"], ours, reference, strict=True):
    max_abs, max_rel = _errors(a, b)
    stages.append(Stage(name, max_abs, max_rel, max_rel <= tolerance))
  arch = hf_config.architecture(hf, where)
  return ParityReport(tuple(stages), arch, folder, tokens.shape, tolerance, version)
