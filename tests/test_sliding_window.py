"""Sliding-window attention (``model.sliding_window``, ``model.full_layers``): a query sees
its last ``window`` keys, itself included, as transformers' ``sliding_window``. Every
kernel computes the reference's values and gradients, with and without documents; folders
of Mistral, Qwen2, SmolLM3 and Phi-3 whose window is shorter than the sequence give
transformers' logits, and (with Gemma 2's and 3's) ``generate``'s tokens 40 past it; K
micro-batches give one batch's update. (Logits and export of each family:
``test_hf_import``, ``test_hf_export``.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_hf_import import SHAPE, save_tiny, torch_logits
from test_phi3 import greedy, imported, logits_of
from tolerance import assert_close, assert_far

from jaxstep import make_train_step, models, next_token_loss
from jaxstep.errors import ConfigError
from jaxstep.models import backends, hf_config
from jaxstep.models.llama import LlamaConfig

torch = pytest.importorskip("torch")
TERMS = SHAPE["intermediate_size"] * SHAPE["num_hidden_layers"]
B, S, H, KV, D = 2, 150, 4, 2, 8  # 150 positions: query blocks of 64, keys skipped left


def reference(q, k, v, window, segments, cap=0.0):
  """Every score computed (soft-capped if ``cap``), then masked: causal, within the window
  and the document."""
  kk, vv = (jnp.repeat(x, H // KV, axis=2) for x in (k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(D)
  scores = cap * jnp.tanh(scores / cap) if cap else scores
  i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
  allowed = (j <= i) & ((j > i - window) if window else True)
  if segments is not None:
    allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
  p = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, vv)


@pytest.mark.parametrize(
  "window, documents, cap",
  [
    (100, True, 0.7),  # Gemma 2's soft-capped scores, windowed
    pytest.param(5, True, 0.0, marks=pytest.mark.slow),
    *(
      pytest.param(*case, marks=pytest.mark.slow)
      for case in ((1, False, 0.0), (64, False, 0.0), (0, False, 0.7), (200, False, 0.0))
    ),
  ],
)
def test_every_kernel_computes_the_windowed_reference_and_its_gradient(window, documents, cap):
  rng = np.random.default_rng(window)
  q, k, v = (jnp.asarray(rng.normal(size=(B, S, h, D)), jnp.float32) for h in (H, KV, KV))
  segments = jnp.asarray(np.repeat([[0] * 70 + [1] * 80], B, 0)) if documents else None
  want = reference(q, k, v, window, segments, cap)
  loss = lambda f: lambda *x: jnp.sum(jnp.sin(f(*x)))  # noqa: E731
  ref = lambda *x: reference(*x, window, segments, cap)  # noqa: E731
  want_grads = jax.grad(loss(ref), (0, 1, 2))(q, k, v)
  for kernel in ("blocked", "xla"):
    f = jax.jit(
      lambda q, k, v, kernel=kernel: backends.causal_attention(
        q, k, v, kernel, segments, window, cap
      )
    )
    assert_close(f(q, k, v), want, terms=S)
    for got, expected in zip(jax.grad(loss(f), (0, 1, 2))(q, k, v), want_grads, strict=True):
      assert_close(got, expected, terms=S)
  if 0 < window < (80 if documents else S):  # shorter than the longest document: it masks
    assert_far(reference(q, k, v, 0, segments, cap), want, terms=S)
  if cap:
    assert_far(reference(q, k, v, window, segments), want, terms=S)


@pytest.mark.parametrize(
  "family",
  [
    "qwen2-window",
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("mistral-window", "smollm3", "phi3")),
  ],
)
def test_a_folders_window_is_the_models_and_it_matters(tmp_path, family):
  model = save_tiny(tmp_path, family)
  cfg, params = imported(tmp_path)
  assert 0 < cfg.sliding_window < 12
  ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, 12))
  theirs = torch_logits(model, ids)
  assert_close(logits_of(cfg, params, ids), theirs, terms=TERMS)
  everything = dataclasses.replace(cfg, sliding_window=0, full_layers=())
  assert_far(logits_of(everything, params, ids), theirs, terms=TERMS)


def test_which_layers_are_windowed_is_read_as_transformers_builds_them():
  base = {**SHAPE, "num_hidden_layers": 4, "sliding_window": 3}
  read = lambda arch, **kw: hf_config.model_config(  # noqa: E731
    {**base, "architectures": [arch], **kw}
  )
  assert read("MistralForCausalLM").windows == (3, 3, 3, 3)
  assert read("Qwen2ForCausalLM").sliding_window == 0  # use_sliding_window false by default
  assert read("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=2).windows == (
    0, 0, 3, 3,
  )  # fmt: skip
  types = ["sliding_attention", "full_attention"] * 2
  assert read("Qwen3ForCausalLM", use_sliding_window=True, layer_types=types).windows == (
    3, 0, 3, 0,
  )  # fmt: skip
  assert read("SmolLM3ForCausalLM", use_sliding_window=True).windows == (0, 0, 0, 3)
  # transformers' defaults: Qwen's class window of 4,096; SmolLM3's layer_types alone
  qwen = {k: v for k, v in base.items() if k != "sliding_window"}
  assert hf_config.model_config(
    {**qwen, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
     "max_window_layers": 3}
  ).windows == (0, 0, 0, 4096)  # fmt: skip
  assert read("SmolLM3ForCausalLM", layer_types=types).windows == (3, 0, 3, 0)
  with pytest.raises(ConfigError, match="layer_types must be 4 of"):
    read("Qwen3ForCausalLM", use_sliding_window=True, layer_types=["x"] * 4)
  with pytest.raises(ConfigError, match="scan_layers needs every block alike"):
    hf_config.model_config(
      {**base, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
       "layer_types": types}, scan_layers=True,
    )  # fmt: skip


@pytest.mark.parametrize(
  "family",
  [
    "mistral-window",
    *(
      pytest.param(f, marks=pytest.mark.slow)
      for f in ("qwen2-window", "smollm3", "gemma2", "gemma3")
    ),
  ],
)
def test_greedy_decoding_40_tokens_past_the_window_gives_generates_tokens(tmp_path, family):
  model = save_tiny(tmp_path, family)
  cfg, params = imported(tmp_path)
  prompts = [np.array([5, 17, 3, 40, 2, 9, 11]), np.array([9, 60])]
  greedy(model, cfg, params, prompts, new=40)


@pytest.mark.slow
def test_k_micro_batches_of_a_windowed_model_give_one_batchs_update():
  cfg = LlamaConfig(
    vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48,
    sliding_window=4, full_layers=(1,),
  )  # fmt: skip
  apply_fn, params = models.build(cfg, 0)
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 50, size=(8, 17))
  mask = (rng.random((8, 16)) < 0.7).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
  new = {}
  for k in (1, 4):
    step = make_train_step(next_token_loss(apply_fn), optax.sgd(0.5), grad_accum_steps=k)
    new[k], _ = jax.jit(step)(step.init(params, jax.random.PRNGKey(0)), batch)
  for a, b in zip(jax.tree.leaves(new[1].params), jax.tree.leaves(new[4].params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
