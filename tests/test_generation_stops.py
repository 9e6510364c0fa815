"""Generation with a pretrained model folder's tokenizer: PAD or BOS may be a stop id, a
row stops at any stop id, and BOS goes before a prompt only as the model's texts start."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstep import models
from jaxstep.generation import Generator, allowed_ids

VOCAB = 32
LETTERS = "abcdefghijklmnopqrst"  # ids 5 … 24; 0 … 4 are left for special ids


def stub_tokenizer(pad, bos, eos, **folder):
  """A tokenizer of ``VOCAB`` ids: letters are ids 5 …, "^" is ``bos``; ``folder`` adds a
  model folder's ``stop_ids`` / ``has_bos`` (none: a jaxstep tokenizer's behaviour)."""

  def encode(text):
    return np.array([bos if c == "^" else 5 + LETTERS.index(c) for c in text], np.int32)

  def decode(ids):
    return "".join(LETTERS[i - 5] if 5 <= i < 25 else f"<{i}>" for i in ids)

  return types.SimpleNamespace(
    vocab_size=VOCAB, PAD=pad, BOS=bos, EOS=eos, encode=encode, decode=decode, **folder
  )


def favours(stop, after, token=7, bait=()):
  """A model without a cache whose logits at position p (which choose the token at p + 1)
  want ``token`` below position ``after`` and ``stop`` from there on; the ``bait`` ids
  outrank both everywhere, so they appear unless they are banned."""

  def apply_fn(params, tokens):
    del params
    pos = jnp.arange(tokens.shape[1])[None, :, None]
    ids = jnp.arange(VOCAB)[None, None]
    want = jnp.where(pos >= after, stop, token)
    logits = jnp.where(ids == want, 10.0, 0.0) * jnp.ones(tokens.shape + (1,))
    return logits.at[..., list(bait)].set(20.0) if bait else logits

  return apply_fn


def steered_llama(token):
  """A tiny Llama (cached decode) that always predicts ``token``: the blocks add nothing to
  the residual, every embedding is the same vector, and only ``token``'s head column reads it."""
  cfg = models.LlamaConfig(
    vocab_size=VOCAB, max_seq_len=16, d_model=16, n_layers=1, n_heads=2, intermediate_size=32
  )

  @jax.jit
  def steered():
    params = models.build(cfg, 0)[1]
    block = params["blocks"][0]
    block["o_proj"]["kernel"] = jnp.zeros_like(block["o_proj"]["kernel"])
    block["down_proj"]["kernel"] = jnp.zeros_like(block["down_proj"]["kernel"])
    params["embed_tokens"]["embedding"] = jnp.ones((VOCAB, 16))
    params["lm_head"]["kernel"] = jnp.zeros((16, VOCAB)).at[:, token].set(1.0)
    return params

  return cfg, steered()


def test_a_stop_id_that_is_also_pad_and_bos_is_generated_and_stops_the_row():
  tok = stub_tokenizer(pad=2, bos=2, eos=2, stop_ids=[2], has_bos=False)  # Qwen-like
  cfg, params = steered_llama(token=2)
  (s,) = Generator(cfg, params, tok).generate(["ab"], max_new_tokens=6, temperature=0.0)
  assert s.tokens == [2] and s.stop_reason == "eos" and s.text == ""


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_extra_stop_id_that_is_pad_is_allowed_and_stops_the_row(temperature):
  tok = stub_tokenizer(pad=0, bos=1, eos=3, stop_ids=[3, 0], has_bos=True)
  gen = Generator(favours(stop=0, after=4, bait=[1]), None, tok, max_seq_len=16)
  (s,) = gen.generate(["ab"], max_new_tokens=8, temperature=temperature)
  assert s.tokens == [7, 7, 0] and s.stop_reason == "eos"  # BOS, no stop id, stays banned
  allowed = allowed_ids(VOCAB, tok)
  assert allowed[[0, 3]].all() and not allowed[1]


def test_a_second_stop_id_stops_the_row_and_is_left_out_of_the_text():
  tok = stub_tokenizer(pad=0, bos=1, eos=2, stop_ids=[2, 4], has_bos=True)
  gen = Generator(favours(stop=4, after=5), None, tok, max_seq_len=16)
  short, longer = gen.generate(["a", "abcd"], max_new_tokens=8, temperature=0.0)
  assert short.tokens == [7, 7, 7, 7, 4] and short.stop_reason == "eos" and short.text == "cccc"
  assert longer.tokens == [7, 4] and longer.stop_reason == "eos" and longer.text == "c"


def test_a_model_whose_texts_start_without_bos_gets_none_prepended():
  tok = stub_tokenizer(pad=2, bos=2, eos=2, stop_ids=[2], has_bos=False)
  gen = Generator(favours(stop=2, after=5), None, tok, max_seq_len=16)
  assert gen.encode_prompt("abc").tolist() == [5, 6, 7]
  (s,) = gen.generate(["abc"], max_new_tokens=8, temperature=0.0)
  assert s.tokens == [7, 7, 7, 2]  # the prompt holds positions 0 … 2, not 0 … 3


def test_a_prompt_that_already_starts_with_bos_gets_no_second_one():
  tok = stub_tokenizer(pad=0, bos=1, eos=2, stop_ids=[2, 3], has_bos=True)  # Llama 3-like
  gen = Generator(favours(stop=2, after=5), None, tok, max_seq_len=16)
  assert gen.encode_prompt("^ab").tolist() == [1, 5, 6]
  assert gen.encode_prompt("ab").tolist() == [1, 5, 6]


def test_a_tokenizer_without_the_folder_attributes_behaves_as_before():
  tok = stub_tokenizer(pad=0, bos=1, eos=2)  # distinct ids, no stop_ids or has_bos
  gen = Generator(favours(stop=3, after=4, bait=[0, 1]), None, tok, max_seq_len=16)
  assert gen.encode_prompt("^ab").tolist() == [1, 1, 5, 6]  # always [BOS] + encode
  (s,) = gen.generate(["ab"], max_new_tokens=6, temperature=0.0)
  assert s.stop_reason == "max_new_tokens" and s.tokens == [7, 7, 3, 3, 3, 3]
  assert allowed_ids(VOCAB, tok)[2:].all() and not allowed_ids(VOCAB, tok)[:2].any()
  gen = Generator(favours(stop=2, after=4), None, tok, max_seq_len=16)
  assert gen.generate(["ab"], max_new_tokens=6, temperature=0.0)[0].tokens == [7, 7, 2]


def test_stop_ids_given_as_an_array_stop_already_encoded_prompts():
  tok = stub_tokenizer(pad=0, bos=1, eos=2, stop_ids=np.array([2, 4]), has_bos=True)
  gen = Generator(favours(stop=4, after=3), None, tok, max_seq_len=16)
  ids, reasons = gen.generate_ids([np.array([1, 5, 6])], max_new_tokens=4)
  assert ids == [[7, 4]] and reasons == ["eos"]
