"""An imported Hugging Face model trains and generates as transformers does: one update of
jaxstep's exact step (K micro-batches, uneven masks) moves every weight by torch's gradient
of the same loss, and greedy decoding over the key/value cache gives transformers'
``generate`` tokens."""

import types

import jax
import numpy as np
import optax
import pytest
from test_hf_import import SHAPE, save_tiny
from tolerance import assert_close, assert_far

from jaxstep import Generator, make_train_step, models, next_token_loss
from jaxstep.models import hf_config, hf_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
V = SHAPE["vocab_size"]


def imported(folder):
  cfg = hf_config.model_config(hf_config.read_config(folder), attention="xla")
  return cfg, hf_weights.read_params(folder, cfg)


def torch_grads(model, tokens: np.ndarray, mask: np.ndarray) -> dict:
  """∂(mean NLL over the masked targets)/∂w for every named weight, computed by torch."""
  model.float().train()
  model.zero_grad()
  logits = model(torch.tensor(tokens[:, :-1])).logits
  nll = torch.nn.functional.cross_entropy(
    logits.reshape(-1, V), torch.tensor(tokens[:, 1:]).reshape(-1), reduction="none"
  )
  m = torch.tensor(mask, dtype=torch.float32).reshape(-1)
  ((nll * m).sum() / m.sum()).backward()
  return {name: p.grad.numpy() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(
  "family", ["llama", "qwen3", "olmo2", "granite", "smollm3", "phi3", "gemma2", "gemma3"]
)
def test_one_exact_update_moves_every_weight_by_torchs_gradient(tmp_path, family):
  model = save_tiny(tmp_path, family)
  cfg, params = imported(tmp_path)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, V, size=(4, 13))
  mask = (rng.random((4, 12)) < 0.6).astype(np.int32)
  mask[0] = 0  # a whole micro-batch row without targets: the count is global
  apply_fn, _ = models.build(cfg, 0, abstract=True)
  step = make_train_step(next_token_loss(apply_fn), optax.sgd(1.0), grad_accum_steps=2)
  state = step.init(params, jax.random.PRNGKey(0))
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
  new, _ = step(state, batch)
  grads = torch_grads(model, tokens, mask)
  moved, expected = {}, {}
  for path, name, transposed in hf_weights.hf_names(cfg, grads):
    before, after = params, new.params
    for key in path:
      before, after = before[key], after[key]
    step_ = np.asarray(before) - np.asarray(after)  # sgd(1): the gradient itself
    # Phi-3's fused tensors: the parts' kernels side by side ([in, out_j] each)
    moved[name] = np.concatenate([moved[name], step_], -1) if name in moved else step_
    expected[name] = grads[name].T if transposed else grads[name]
  # two libraries: every sum of the forward and backward in another order, through both
  # layers (as the other folder comparisons count them)
  terms = SHAPE["intermediate_size"] * SHAPE["num_hidden_layers"]
  assert_close(moved, expected, terms=terms)
  # the margin: the gradient divided by 3/4 of N (a count that missed a quarter of the tokens)
  assert_far({k: v * 1.25 for k, v in moved.items()}, expected, terms=terms)


@pytest.mark.parametrize(
  "family",
  [
    "qwen3",
    "granite",
    # decoding past the window (test_sliding_window) and LongRoPE's switch (test_phi3)
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("olmo2", "smollm3", "phi3")),
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("gemma2", "gemma3")),
  ],
)
def test_greedy_decoding_gives_transformers_generate_tokens(tmp_path, family):
  model = save_tiny(tmp_path, family)
  cfg, params = imported(tmp_path)
  tokenizer = types.SimpleNamespace(vocab_size=V, PAD=0, BOS=0, EOS=1)
  prompts = [np.array([5, 17, 3, 40, 2]), np.array([9, 60]), np.array([33, 7, 21])]
  gen = Generator(cfg, params, tokenizer)
  ids, _ = gen.generate_ids(prompts, max_new_tokens=10, temperature=0.0)
  for prompt, got in zip(prompts, ids, strict=True):
    with torch.no_grad():
      out = (
        model.float()
        .eval()
        .generate(
          torch.tensor(prompt[None]),
          max_new_tokens=10,
          do_sample=False,
          eos_token_id=1,
          pad_token_id=0,
          suppress_tokens=[0],  # jaxstep never samples PAD or BOS
        )
      )
    assert got == out[0, len(prompt) :].tolist()
