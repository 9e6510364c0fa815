"""The Llama-family decoder: logits equal to Hugging Face's Llama, Qwen2, Qwen3 and Mistral
for the same weights; the key/value cache against the full forward pass; scanned layers
and remat change nothing; config errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close, assert_far

from jaxstep import models
from jaxstep.errors import BatchError, ConfigError
from jaxstep.models import layers

VOCAB = 96
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 12))
HF_SHAPE = dict(
  vocab_size=VOCAB,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=16,
  rms_norm_eps=1e-6,
  initializer_range=0.2,  # large enough that attention is far from uniform
)
# llama3 scaling with Dh = 8 and θ = 100: wavelengths 2π, 20, 63, 199 against the bands
# L/high = 8 and L/low = 32, so one frequency is kept, one smoothed and two divided.
LLAMA3 = dict(
  rope_type="llama3",
  rope_theta=100.0,
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=32,
)
SCALING = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}  # jaxstep's rope_scaling
INNER = 48  # the longest sum to the logits: the MLP's down projection (intermediate_size)
HF_CASES = {
  "llama-gqa": ("llama", {}),
  "llama3-rope-tied": (
    "llama",
    dict(rope_parameters=LLAMA3, max_position_embeddings=64, tie_word_embeddings=True),
  ),
  "qwen2-bias-tied": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
  "qwen3-head-dim-qk-norm": ("qwen3", dict(head_dim=16)),
  "mistral-mqa": ("mistral", dict(num_key_value_heads=1, sliding_window=None)),
}


def hf_model(model_type: str, **changes):
  """A tiny random HF causal LM in fp32 eval mode with eager attention; RMSNorm weights
  and biases randomized too (they initialise to ones and zeros)."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  torch.manual_seed(0)
  cfg = transformers.AutoConfig.for_model(model_type, **{**HF_SHAPE, **changes})
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.3 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.3 * torch.randn_like(p))
  return model.eval().float()


def llama_config(hf, **changes) -> models.LlamaConfig:
  """The ``LlamaConfig`` of an HF config (what an importer does)."""
  rope = dict(hf.rope_parameters)
  theta = rope.pop("rope_theta")
  return models.LlamaConfig(
    vocab_size=hf.vocab_size,
    max_seq_len=hf.max_position_embeddings,
    d_model=hf.hidden_size,
    n_layers=hf.num_hidden_layers,
    n_heads=hf.num_attention_heads,
    n_kv_heads=hf.num_key_value_heads,
    head_dim=getattr(hf, "head_dim", None) or 0,
    intermediate_size=hf.intermediate_size,
    rms_norm_eps=hf.rms_norm_eps,
    rope_theta=theta,
    rope_scaling=rope,
    tie_embeddings=hf.tie_word_embeddings,
    attention_bias=hf.model_type == "qwen2" or getattr(hf, "attention_bias", False),
    qk_norm=hf.model_type == "qwen3",
    **changes,
  )


def convert(state_dict, cfg: models.LlamaConfig) -> dict:
  """HF ``state_dict`` → jaxstep params: a rename, and ``[out, in]`` weights transposed
  to ``[in, out]`` kernels (transposed in numpy, not by an eager jax op per shape)."""
  sd = {k: v.detach().cpu().numpy() for k, v in state_dict.items()}

  def linear(name):
    out = {"kernel": sd[f"{name}.weight"].T}
    return {**out, "bias": sd[f"{name}.bias"]} if f"{name}.bias" in sd else out

  def block(i):
    p = f"model.layers.{i}"
    out = {
      n: {"scale": sd[f"{p}.{n}.weight"]} for n in ("input_layernorm", "post_attention_layernorm")
    }
    out |= {n: linear(f"{p}.self_attn.{n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    out |= {n: linear(f"{p}.mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")}
    out |= {
      n: {"scale": sd[f"{p}.self_attn.{n}.weight"]} for n in ("q_norm", "k_norm") if cfg.qk_norm
    }
    return out

  params = {
    "embed_tokens": {"embedding": sd["model.embed_tokens.weight"]},
    "blocks": {i: block(i) for i in range(cfg.n_layers)},
    "norm": {"scale": sd["model.norm.weight"]},
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = {"kernel": sd["lm_head.weight"].T}
  return jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_logits_equal_hugging_face_for_the_same_weights(case):
  import torch

  model_type, changes = HF_CASES[case]
  hf = hf_model(model_type, **changes)
  cfg = llama_config(hf.config)
  apply_fn, init = models.build(cfg, 0, abstract=True)
  params = convert(hf.state_dict(), cfg)
  chex.assert_trees_all_equal_shapes_and_dtypes(params, init)  # the same names and shapes
  with torch.no_grad():
    expected = hf(torch.as_tensor(TOKENS)).logits.numpy()
  forward = jax.jit(apply_fn)
  logits = forward(params, jnp.asarray(TOKENS))
  assert np.std(expected) > 0.1  # not a near-constant comparison
  assert_close(logits, expected, terms=INNER)
  # the margin: the two layers' weights swapped (a wrong layer index in the conversion)
  swapped = {**params, "blocks": {0: params["blocks"][1], 1: params["blocks"][0]}}
  assert_far(forward(swapped, jnp.asarray(TOKENS)), expected, terms=INNER)


DECODE_CFG = models.LlamaConfig(
  vocab_size=VOCAB,
  max_seq_len=16,
  d_model=32,
  n_layers=2,
  n_heads=4,
  n_kv_heads=2,
  head_dim=16,
  intermediate_size=48,
  rope_theta=100.0,
  rope_scaling=SCALING,
  attention_bias=True,
  qk_norm=True,
)


def test_cached_greedy_decode_equals_the_full_forward():
  """Prompts of 5 and 2 tokens (right-padded) prefilled together, then greedy steps, each
  row at its own position: the logits at every position equal the full forward pass over
  the sequences that came out."""
  dec, (_, params) = models.decoder(DECODE_CFG), models.build(DECODE_CFG, 3)
  decode_fn, s, lengths = jax.jit(dec.decode_fn), 12, np.array([5, 2])
  tokens = np.array(TOKENS[:, :s])
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  logits, cache = decode_fn(params, jnp.asarray(tokens[:, :5]), positions, dec.init_cache(2, s))
  cached = np.zeros((2, s, VOCAB), np.float32)
  for row, n in enumerate(lengths):
    cached[row, :n] = logits[row, :n]
  for pos in range(int(lengths.min()), s):  # row r next writes position max(pos, len_r)
    at = np.maximum(pos, lengths)
    live = at == pos
    nxt = cached[np.arange(2), at - 1].argmax(-1)
    tokens[live, at[live]] = nxt[live]
    step_tokens = jnp.asarray(tokens[np.arange(2), at][:, None])
    step, cache = decode_fn(params, step_tokens, jnp.asarray(at[:, None]), cache)
    cached[live, at[live]] = np.asarray(step)[live, 0]
  full = jax.jit(dec.apply_fn)(params, jnp.asarray(tokens))
  assert_close(cached, full, terms=INNER)
  # the margin: each step's logits read one position off (a cache index off by one)
  assert_far(cached[:, 1:], full[:, :-1], terms=INNER)
  assert dec.init_cache(2, s)[0][0].shape == (2, 2, 16, s)  # n_kv_heads, not n_heads


def loss_and_grads(cfg, params, rng):
  apply_fn, _ = models.build(cfg, 0, abstract=True)

  def loss(p):
    logits = apply_fn(p, jnp.asarray(TOKENS), rng=rng, train=True)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 3])

  return jax.jit(jax.value_and_grad(loss))(params)


DROPOUT_CFG = models.LlamaConfig(**{**DECODE_CFG.__dict__, "dropout": 0.1})
RNG = jax.random.key_data(jax.random.key(7))
OTHER_RNG = jax.random.key_data(jax.random.key(8))
TERMS = VOCAB  # the longest sum to the loss: the softmax over the vocabulary (≥ INNER)


@pytest.fixture(scope="module")
def plain_loss_and_grads():
  """The parameters, the loss and gradients with ``RNG``, and (the margin) the gradients
  with another dropout key."""
  params = models.build(DROPOUT_CFG, 0)[1]
  other = loss_and_grads(DROPOUT_CFG, params, OTHER_RNG)[1]
  return params, loss_and_grads(DROPOUT_CFG, params, RNG), other


@pytest.mark.slow
@pytest.mark.parametrize(
  "changes", [dict(scan_layers=True), dict(remat="block")], ids=["scan_layers", "remat_block"]
)
def test_scanned_layers_and_remat_give_the_same_loss_and_gradients(changes, plain_loss_and_grads):
  params, (loss_0, grads_0), grads_other = plain_loss_and_grads
  variant = models.LlamaConfig(**{**DROPOUT_CFG.__dict__, **changes})
  converted = layers.convert_layout(params, variant.scan_layers)
  loss_v, grads_v = loss_and_grads(variant, converted, RNG)
  assert_close(loss_v, loss_0, terms=TERMS)
  assert_close(layers.convert_layout(grads_v, False), grads_0, terms=TERMS)
  # the margin: another dropout draw is far outside the tolerance
  assert_far(grads_other, grads_0, terms=TERMS)


def test_a_seed_initialises_the_same_model_in_both_layouts():
  _, unrolled = models.build(DECODE_CFG, 0)
  scanned_cfg = models.LlamaConfig(**{**DECODE_CFG.__dict__, "scan_layers": True})
  _, scanned = models.build(scanned_cfg, 0)
  assert scanned["blocks"]["k_proj"]["kernel"].shape == (2, 32, 32)
  chex.assert_trees_all_equal(layers.convert_layout(unrolled, True), scanned)


def test_matmul_params_count_the_grouped_key_value_heads():
  for tied in (False, True):
    cfg = models.LlamaConfig(**{**DECODE_CFG.__dict__, "tie_embeddings": tied})
    params = jax.eval_shape(lambda cfg=cfg: models.build(cfg, 0)[1])
    kernels = jax.tree_util.tree_leaves_with_path(params)
    counted = sum(x.size for path, x in kernels if "kernel" in jax.tree_util.keystr(path))
    assert cfg.matmul_params() == counted + tied * cfg.d_model * cfg.vocab_size
  assert cfg.flops_per_token(16) == 6.0 * cfg.matmul_params() + 12.0 * 2 * 4 * 16 * 16


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(n_kv_heads=3), "model.n_kv_heads 3 does not divide model.n_heads 4"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "type 'yarn' is not supported"),
    (dict(rope_scaling={"type": "llama3", "fator": 4.0}), "unknown keys fator"),
    (dict(rope_scaling={"rope_type": "llama3", "high_freq_factor": 1.0}), "high_freq_factor"),
    (dict(head_dim=0, d_model=30), "model.d_model 30 is not divisible by model.n_heads 4"),
    (dict(head_dim=7), "model.head_dim must be even"),
    (dict(remat="full"), "model.remat must be one of"),
    (dict(intermediate_size=0), "model.intermediate_size must be > 0"),
  ],
)
def test_bad_config_values_are_config_errors_naming_the_key(changes, message):
  with pytest.raises(ConfigError, match=message):
    models.LlamaConfig(**{**DECODE_CFG.__dict__, **changes})


def test_rope_scaling_spellings_and_too_long_inputs():
  as_pairs = models.LlamaConfig(rope_scaling=tuple(SCALING.items()))
  assert as_pairs.rope_scaling.original_max_position_embeddings == 32
  assert models.LlamaConfig(rope_scaling={"rope_type": "default"}).rope_scaling is None
  assert hash(as_pairs)  # a static module attribute: must stay hashable
  short = models.LlamaConfig(vocab_size=8, max_seq_len=4, d_model=8)
  apply_fn, params = models.build(short, 0, abstract=True)  # the check needs no values
  with pytest.raises(BatchError, match="sequence length 5 exceeds model.max_seq_len 4"):
    apply_fn(params, jnp.zeros((1, 5), jnp.int32))
