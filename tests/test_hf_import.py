"""Hugging Face model folders in: ``config.json`` → a Llama-family config, safetensors →
params, checked against transformers' own forward pass on tiny random models saved locally
(nothing is downloaded)."""

import json

import jax
import numpy as np
import pytest
from conftest import TINY_HF_SHAPE
from tolerance import assert_close, assert_far, planted

from jaxstep import models
from jaxstep.errors import ConfigError
from jaxstep.models import hf_config, hf_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = TINY_HF_SHAPE
# jaxstep against transformers on the same weights: the longest sum (GPT-2's MLP, 4 × hidden;
# the others' is intermediate_size) once per layer
TERMS = 4 * SHAPE["hidden_size"] * SHAPE["num_hidden_layers"]
FAMILIES = {
  "llama": ("LlamaConfig", {}),
  "llama3-scaled": (
    "LlamaConfig",
    {
      "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
      }
    },
  ),
  "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
  "mistral": ("MistralConfig", {"sliding_window": None}),
  "mistral-window": ("MistralConfig", {"sliding_window": 5}),  # every layer, 5 keys each
  "qwen2-window": (  # layer 1 windowed (from max_window_layers on), layer 0 full
    "Qwen2Config",
    {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
  ),
  "qwen2": ("Qwen2Config", {}),
  "qwen3": ("Qwen3Config", {"head_dim": 12}),
  # transformers' OLMo 2 defaults name ids outside a tiny vocabulary, and its embedding
  # never updates the pad id's row (torch's padding_idx): none, as Llama's defaults
  "olmo2": ("Olmo2Config", {"head_dim": 12, "pad_token_id": None, "eos_token_id": None}),
  "smollm3": (  # layer 1 without rotary embeddings (every 4th by default: none of 2)
    "SmolLM3Config",
    {
      "no_rope_layers": [1, 0],
      **dict(use_sliding_window=True, sliding_window=5),  # on the NoPE layer
      **dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
    },
  ),
  "granite": (
    "GraniteConfig",
    {
      **dict(embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.6),
      **dict(logits_scaling=2.5, bos_token_id=None, eos_token_id=None),
    },
  ),
  "phi3": (  # fused projections, RoPE over 6 of 8 features, LongRoPE past 16 positions
    "Phi3Config",
    {
      "partial_rotary_factor": 0.75,
      "original_max_position_embeddings": 16,
      "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.3, 2.1],
        "long_factor": [1.5, 4.0, 9.0],
      },
      **dict(pad_token_id=None, eos_token_id=None, sliding_window=7),
    },
  ),
  "gemma2": (  # soft-capped scores and logits; layer 0 windowed (5 keys), layer 1 full
    "Gemma2Config",
    {
      **dict(head_dim=8, query_pre_attn_scalar=12, sliding_window=5),
      **dict(attn_logit_softcapping=0.8, final_logit_softcapping=1.5),
    },
  ),
  "gemma3": (  # a local layer (5-key window, base 100) and a global one (base 10,000)
    "Gemma3TextConfig",
    {
      "head_dim": 8,
      "query_pre_attn_scalar": 12,
      "sliding_window": 5,
      "layer_types": ["sliding_attention", "full_attention"],
      "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
      },
    },
  ),
  "gpt2": ("GPT2Config", {"layer_norm_epsilon": 1e-5}),
  "gpt2-untied": ("GPT2Config", {"tie_word_embeddings": False}),
}


def save_tiny(folder, family: str, dtype=torch.float32, **save_kwargs):
  """A random model of ``family`` saved with ``save_pretrained``; every weight (norms
  included, which start at one) drawn at random. Returns the torch model."""
  name, extra = FAMILIES[family]
  cfg = getattr(transformers, name)(**SHAPE, **extra)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  model = model.to(dtype).eval()
  model.save_pretrained(folder, **save_kwargs)
  return model


def imported_logits(folder, ids: np.ndarray) -> np.ndarray:
  cfg = hf_config.model_config(hf_config.read_config(folder), attention="xla")
  apply_fn, _ = models.build(cfg, 0, abstract=True)
  params = hf_weights.read_params(folder, cfg)
  return np.asarray(jax.jit(apply_fn)(params, ids))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model.float()(torch.tensor(ids)).logits.numpy()


VARIANTS = ("llama-tied", "mistral", "qwen2", "gpt2-untied")  # a sibling of each stays fast


@pytest.mark.parametrize(
  "family",
  [f if f not in VARIANTS else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)],
)
def test_imported_logits_equal_transformers(tmp_path, family):
  model = save_tiny(tmp_path, family)
  ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(3, 12))
  ours, theirs = imported_logits(tmp_path, ids), torch_logits(model, ids)
  assert_close(ours, theirs, terms=TERMS)
  assert_far(planted(ours), theirs, terms=TERMS)


@pytest.mark.slow
def test_a_sharded_bf16_folder_reads_the_same_values(tmp_path):
  model = save_tiny(tmp_path, "qwen3", dtype=torch.bfloat16, max_shard_size="20KB")
  assert (tmp_path / hf_weights.INDEX).is_file()
  ids = np.arange(24).reshape(2, 12) % SHAPE["vocab_size"]
  # not an fp32 reordering: transformers' model cast to bf16 keeps its RoPE frequencies
  # rounded to bf16 after .float() (~2e-5 off on these logits), jaxstep computes them in fp32
  np.testing.assert_allclose(imported_logits(tmp_path, ids), torch_logits(model, ids), atol=1e-4)


def test_the_older_folder_layout_reads_the_same(tmp_path):
  """``rope_theta`` / ``rope_scaling`` at the top level, as transformers 4 wrote them."""
  save_tiny(tmp_path, "llama3-scaled")
  new = hf_config.read_config(tmp_path)
  old = {k: v for k, v in new.items() if k != "rope_parameters"}
  scaling = dict(new["rope_parameters"])
  old["rope_theta"] = scaling.pop("rope_theta")
  old["rope_scaling"] = scaling
  assert hf_config.model_config(old) == hf_config.model_config(new)
  assert hf_config.model_config(new).rope_theta == 500000.0


def test_a_folder_without_config_json_names_what_to_give(tmp_path):
  with pytest.raises(ConfigError, match="has no config.json"):
    hf_config.read_config(tmp_path)


def test_an_unsupported_architecture_lists_the_supported():
  with pytest.raises(ConfigError, match="'GemmaForCausalLM' is not supported; supported: Llama"):
    hf_config.model_config({**SHAPE, "architectures": ["GemmaForCausalLM"]})


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "linear"])
def test_an_unsupported_rope_scaling_is_named(kind):
  hf = {**SHAPE, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": kind}}
  with pytest.raises(ConfigError, match=f"rope scaling type '{kind}' is not supported"):
    hf_config.model_config(hf)


def test_a_window_jaxstep_does_not_read_is_refused_where_it_is_shorter_than_the_sequence():
  """The mixtures of experts' windows are not read: refused once they would mask; the dense
  families' are the model's (``read_windows``)."""
  hf = {"architectures": ["Qwen3MoeForCausalLM"], "sliding_window": 8, "use_sliding_window": True}
  hf_config.check_sliding_window(hf, 8)
  with pytest.raises(ConfigError, match="sliding_window 8 is shorter than the sequence length"):
    hf_config.check_sliding_window(hf, 16)
  hf_config.check_sliding_window({**hf, "architectures": ["MistralForCausalLM"]}, 16)


def test_a_missing_or_misshaped_tensor_is_named(tmp_path):
  from safetensors.numpy import load_file, save_file

  save_tiny(tmp_path, "llama")
  cfg = hf_config.model_config(hf_config.read_config(tmp_path))
  tensors = load_file(tmp_path / hf_weights.SINGLE)
  name = "model.layers.1.mlp.up_proj.weight"
  save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / hf_weights.SINGLE)
  with pytest.raises(ConfigError, match=f"lack 1 tensor.*{name}"):
    hf_weights.read_params(tmp_path, cfg)
  tensors[name] = tensors[name][:, :-1]
  save_file(tensors, tmp_path / hf_weights.SINGLE)
  shapes = r"has shape \(48, 31\), config.json needs \(48, 32\)"
  with pytest.raises(ConfigError, match=rf"tensor {name} {shapes}"):
    hf_weights.read_params(tmp_path, cfg)


def test_every_tensor_of_the_folder_is_used(tmp_path):
  for family in ("qwen2", "qwen3", "llama-tied"):
    save_tiny(tmp_path / family, family)
    cfg = hf_config.model_config(hf_config.read_config(tmp_path / family))
    assert hf_weights.unused_tensors(tmp_path / family, cfg) == []
    saved = json.loads((tmp_path / family / "config.json").read_text())
    assert saved["architectures"][0] in hf_config.ARCHITECTURES


@pytest.mark.parametrize("key", ["attention_bias", "mlp_bias"])
def test_llama_biases_this_model_lacks_are_refused(key):
  hf = {**SHAPE, "architectures": ["LlamaForCausalLM"], key: True}
  with pytest.raises(ConfigError, match=f"{key}=true is not supported for LlamaForCausalLM"):
    hf_config.model_config(hf)


def test_a_damaged_safetensors_file_is_named(tmp_path):
  save_tiny(tmp_path, "llama")
  cfg = hf_config.model_config(hf_config.read_config(tmp_path))
  weights = tmp_path / hf_weights.SINGLE
  weights.write_bytes(weights.read_bytes()[:1000])  # cut short, as an interrupted copy
  with pytest.raises(ConfigError, match="model.safetensors is not a readable safetensors file"):
    hf_weights.read_params(tmp_path, cfg)


def test_an_fp16_folder_widens_every_weight_exactly(tmp_path):
  """Llama 2 and many fine-tunes ship fp16 weights: each tensor reads as its fp32 value,
  kernels transposed, nothing rounded or dropped."""
  model = save_tiny(tmp_path, "llama", dtype=torch.float16)
  cfg = hf_config.model_config(hf_config.read_config(tmp_path))
  params = hf_weights.read_params(tmp_path, cfg)
  weights = model.state_dict()
  for path, name, transposed in hf_weights.hf_names(cfg):
    leaf = params
    for key in path:
      leaf = leaf[key]
    want = weights[name].float().numpy()
    assert leaf.dtype == np.float32, name
    np.testing.assert_array_equal(leaf, want.T if transposed else want, err_msg=name)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded-bf16"])
def test_the_fingerprint_of_the_read_covers_every_byte_as_the_standalone_one(tmp_path, sharded):
  """``read_params(..., digest=)`` hashes the bytes it reads (and the buffers it skips):
  the same value as ``fingerprint``, which reads the files alone; a byte changed anywhere
  in the data (first, middle, last, in a skipped buffer) changes it."""
  from safetensors.numpy import load_file, save_file

  buffer = "model.layers.1.self_attn.rotary_emb.inv_freq"
  if sharded:
    save_tiny(tmp_path, "qwen3", dtype=torch.bfloat16, max_shard_size="20KB")
  else:
    save_tiny(tmp_path, "qwen3")
    tensors = load_file(tmp_path / hf_weights.SINGLE)  # a buffer the read skips
    tensors[buffer] = np.ones(6, np.float32)
    save_file(tensors, tmp_path / hf_weights.SINGLE, metadata={"format": "pt"})
  cfg = hf_config.model_config(hf_config.read_config(tmp_path))
  file = sorted(set(hf_weights.weight_files(tmp_path).values()))[-1]
  length = int.from_bytes(file.read_bytes()[:8], "little")
  start, size = 8 + length, file.stat().st_size
  offsets = [None, start, start + (size - start) // 4 * 2, size - 1]
  header = json.loads(file.read_bytes()[8:start])
  if buffer in header:
    offsets.append(start + header[buffer]["data_offsets"][0])
  seen = set()
  for offset in offsets:
    if offset is not None:
      data = bytearray(file.read_bytes())
      data[offset] ^= 1  # one bit of a value (its lowest exponent bit at most): still finite
      file.write_bytes(data)
    digest = hf_weights.FingerprintDigest()
    hf_weights.read_params(tmp_path, cfg, digest=digest)
    assert digest.value.startswith("xxh3:") and digest.value == hf_weights.fingerprint(tmp_path)
    seen.add(digest.value)
  assert len(seen) == len(offsets)
