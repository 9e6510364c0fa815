"""Generation in-process: the key/value cache against the full forward pass, batching of
unequal prompts, stop reasons, seeds, sampling filters, bad prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstep import models
from jaxstep.data import ByteTokenizer
from jaxstep.errors import ConfigError, PromptError
from jaxstep.generation import Generator, filter_logits, next_tokens

CFG = models.GPTConfig(vocab_size=264, max_seq_len=48, d_model=32, n_layers=2, n_heads=4)
TOK = ByteTokenizer()
PROMPTS = ["the ", "12 + 3", "a longer prompt of text", "x"]
DRAW = jax.jit(next_tokens)  # compiled once: k, p and the temperature are traced


@pytest.fixture(scope="module")
def params():
  return models.build(CFG, 0)[1]


def relative(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def cached_logits_by_position(params, tokens, lengths, dtype=jnp.float32):
  """Prefill the prompts (right-padded to the longest), then feed the rest of each row one
  position at a time, its own positions: the logits at every position of every row."""
  dec = models.decoder(CFG)
  decode_fn = jax.jit(dec.decode_fn)
  p = jax.tree.map(lambda x: x.astype(dtype), params)
  tokens = np.asarray(tokens)
  b, s = tokens.shape
  prefill = int(lengths.max())
  cache = dec.init_cache(b, s, dtype)
  positions = np.broadcast_to(np.arange(prefill, dtype=np.int32), (b, prefill))
  logits, cache = decode_fn(p, tokens[:, :prefill], positions, cache)
  logits = np.asarray(logits)
  out = np.zeros((b, s, CFG.vocab_size), np.float32)
  for row in range(b):
    out[row, : lengths[row]] = logits[row, : lengths[row]]
  pos = np.asarray(lengths, np.int32)
  rows = np.arange(b)
  while int(pos.min()) < s:
    at = np.minimum(pos, s - 1)
    step, cache = decode_fn(p, tokens[rows, at][:, None], at[:, None], cache)
    step = np.asarray(step)
    for row in range(b):
      if pos[row] < s:
        out[row, int(pos[row])] = step[row, 0]
    pos = pos + 1
  return out


def test_cached_decode_equals_the_full_forward_at_every_position_fp32(params):
  tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 40), 0, 259)
  lengths = np.array([5, 17, 1])  # unequal prompts: the padding is overwritten later
  full = jax.jit(models.decoder(CFG).apply_fn)(params, tokens)
  cached = cached_logits_by_position(params, tokens, lengths)
  assert relative(cached, full) <= 1e-5


@pytest.mark.slow
def test_cached_decode_in_bf16_is_within_its_stated_tolerance(params):
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 40), 0, 259)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  full = jax.jit(models.decoder(CFG).apply_fn)(bf16, tokens).astype(jnp.float32)
  cached = cached_logits_by_position(params, tokens, np.array([7, 3]), jnp.bfloat16)
  assert relative(cached, full) <= 2e-2  # docs/generation.md states this bound


@pytest.mark.slow
def test_greedy_output_is_the_same_with_and_without_the_cache(params):
  kw = dict(max_new_tokens=30, temperature=0.0)
  cached = Generator(CFG, params, TOK).generate(PROMPTS, **kw)
  recomputed = Generator(CFG, params, TOK, use_cache=False).generate(PROMPTS, **kw)
  assert [s.tokens for s in cached] == [s.tokens for s in recomputed]
  assert [s.stop_reason for s in cached] == [s.stop_reason for s in recomputed]
  assert sum(len(s.tokens) for s in cached) > 60  # not a trivially short comparison


@pytest.mark.slow
def test_prompts_of_unequal_length_batch_as_if_each_ran_alone(params):
  gen = Generator(CFG, params, TOK)
  together = gen.generate(PROMPTS, max_new_tokens=20, temperature=0.0)
  for prompt, sample in list(zip(PROMPTS, together, strict=True))[1:3]:
    alone = gen.generate([prompt], max_new_tokens=20, temperature=0.0)[0]
    assert sample.prompt == prompt and sample.tokens == alone.tokens


def test_sampling_is_reproducible_from_the_seed(params):
  gen = Generator(CFG, params, TOK)
  kw = dict(max_new_tokens=25, temperature=1.0, num_samples=2)
  a, b = gen.generate(["the "], seed=3, **kw), gen.generate(["the "], seed=3, **kw)
  c = gen.generate(["the "], seed=4, **kw)
  assert [s.tokens for s in a] == [s.tokens for s in b]
  assert [s.tokens for s in a] != [s.tokens for s in c]
  assert a[0].tokens != a[1].tokens  # two samples of one prompt are two draws


def scripted_model(eos_after: int, vocab=264, token=122):  # 122: "z"
  """A model without a cache whose logits at position p (which choose the token at p + 1)
  want ``token`` below position ``eos_after`` and EOS from there on."""

  def apply_fn(params, tokens):
    del params
    pos = jnp.arange(tokens.shape[1])[None, :, None]
    want = jnp.where(pos >= eos_after, TOK.EOS, token)
    return jnp.where(jnp.arange(vocab)[None, None] == want, 10.0, 0.0) * jnp.ones(
      tokens.shape + (1,)
    )

  return apply_fn


def test_rows_stop_at_eos_max_new_tokens_or_max_seq_len_and_say_which():
  gen = Generator(scripted_model(eos_after=6), None, TOK, max_seq_len=12)
  eos, length = gen.generate(["ab", "abcdefgh"], max_new_tokens=3, temperature=0.0)
  assert eos.tokens == [ord("z"), ord("z"), ord("z")] and eos.stop_reason == "max_new_tokens"
  assert length.tokens == [TOK.EOS] and length.stop_reason == "eos" and length.text == ""
  gen = Generator(scripted_model(eos_after=100), None, TOK, max_seq_len=12)
  (full,) = gen.generate(["abcdefgh"], max_new_tokens=50, temperature=0.0)
  assert full.stop_reason == "max_seq_len" and len(full.tokens) == 12 - 9  # BOS + 8 + 3 = 12


def test_eos_ends_only_its_own_row():
  gen = Generator(scripted_model(eos_after=5), None, TOK, max_seq_len=16)
  short, longer = gen.generate(["a", "abcd"], max_new_tokens=8, temperature=0.0)
  assert short.tokens == [ord("z")] * 4 + [TOK.EOS] and short.text == "zzzz"  # positions 2-6
  assert longer.tokens == [ord("z"), TOK.EOS] and longer.stop_reason == "eos"


def test_pad_bos_and_the_padded_vocabulary_are_never_generated():
  def loves_specials(params, tokens):  # PAD, BOS and a padded row outrank everything
    logits = jnp.zeros(tokens.shape + (264,)).at[..., [TOK.PAD, TOK.BOS, 263]].set(50.0)
    return logits.at[..., ord("q")].set(1.0)

  gen = Generator(loves_specials, None, TOK, max_seq_len=16)
  for temperature in (0.0, 1.0):
    (s,) = gen.generate(["hi"], max_new_tokens=5, temperature=temperature)
    assert set(s.tokens) <= set(range(259)) - {TOK.PAD, TOK.BOS}


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.floats(0.05, 0.95), st.integers(0, 2**31 - 1))
def test_draws_stay_inside_the_top_k_and_the_nucleus(k, p, seed):
  logits = jax.random.normal(jax.random.PRNGKey(seed), (4, 20)) * 3
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), 4)
  allowed = jnp.ones(20, bool)
  drawn = np.asarray(DRAW(logits, keys, allowed, 1.0, k, 1.0))
  ranks = np.argsort(-probs, axis=-1)
  assert all(drawn[r] in ranks[r, :k] for r in range(4))
  drawn = np.asarray(DRAW(logits, keys, allowed, 1.0, 0, p))
  for r in range(4):  # the nucleus: the fewest top ids whose mass reaches p
    mass = np.cumsum(probs[r, ranks[r]])
    nucleus = ranks[r, : int(np.searchsorted(mass, p)) + 1]
    assert drawn[r] in nucleus


def test_top_k_one_and_a_tiny_top_p_are_greedy():
  logits = jax.random.normal(jax.random.PRNGKey(0), (8, 30))
  keys = jax.random.split(jax.random.PRNGKey(1), 8)
  greedy = np.argmax(logits, axis=-1)
  allowed = jnp.ones(30, bool)
  assert (np.asarray(DRAW(logits, keys, allowed, 1.5, 1, 1.0)) == greedy).all()
  assert (np.asarray(DRAW(logits, keys, allowed, 1.5, 0, 1e-6)) == greedy).all()
  kept = np.isfinite(np.asarray(jax.jit(filter_logits)(logits, 1.0, 0, 1.0)))
  assert kept.all()  # both filters off: nothing removed


def test_bad_prompts_and_settings_are_one_clear_error(params):
  gen = Generator(CFG, params, TOK)
  with pytest.raises(PromptError, match="prompt 2 is empty"):
    gen.generate(["ok", ""])
  with pytest.raises(PromptError, match="max_seq_len is 48: shorten it to at most 46"):
    gen.generate(["x" * 47])
  with pytest.raises(PromptError, match="not valid text"):
    gen.generate(["lone surrogate \udcff"])
  with pytest.raises(PromptError, match="list of one or more"):
    gen.generate("the ")
  for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)):
    with pytest.raises(ConfigError):
      gen.generate(["ok"], **bad)


def test_characters_the_tokenizer_cannot_encode_are_named(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers

  from jaxstep.data import load_tokenizer

  tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "<pad>": 2}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  word_level = load_tokenizer(str(tmp_path / "tokenizer.json"))
  gen = Generator(scripted_model(5, vocab=8), None, word_level, max_seq_len=16)
  with pytest.raises(PromptError, match="cannot encode"):
    gen.generate(["hello naïve"])
