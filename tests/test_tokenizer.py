"""Tokenizers from local files: round trips, special ids per kind, training on them."""

import json

import numpy as np
import pytest
from conftest import make_cfg
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstep import ConfigError, DataError, trainer
from jaxstep.data.tokenizer import ByteTokenizer, train_bpe
from jaxstep.data.tokenizer_loading import load_tokenizer

UTF8_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
CORPUS = [
  "the cat sat on the mat.",
  "17 + 25 = 42",
  "Grüße aus Köln — naïve café ☕",
  "def f(x):\n    return x * 2\n",
] * 50


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  return train_bpe(CORPUS, 320, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


@given(UTF8_TEXT)
def test_bytes_round_trip_any_utf8_text(text):
  tok = ByteTokenizer()
  assert tok.decode(tok.encode(text)) == text


@settings(max_examples=60, deadline=None)
@given(text=UTF8_TEXT)
def test_trained_byte_level_bpe_round_trips_any_utf8_text(bpe, text):
  assert bpe.decode(bpe.encode(text)) == text


@settings(max_examples=60, deadline=None)
@given(text=UTF8_TEXT)
def test_token_bytes_add_up_to_the_utf8_length_for_bytes_and_byte_level_bpe(bpe, text):
  """What bits per byte divides by: the UTF-8 bytes the ids stand for; specials none."""
  for tok in (ByteTokenizer(), bpe):
    table = tok.token_bytes()
    ids = [tok.BOS, *tok.encode(text), tok.EOS, tok.PAD]
    assert len(table) == tok.vocab_size and table[ids].sum() == len(text.encode("utf-8"))


def test_trained_bpe_has_its_specials_first_and_merges_common_words(bpe):
  assert (bpe.PAD, bpe.BOS, bpe.EOS) == (0, 1, 2) and bpe.vocab_size == 320
  assert len(bpe.encode("the cat sat on the mat.")) < len("the cat sat on the mat.") / 2
  assert bpe.decode([bpe.BOS, *bpe.encode("hi"), bpe.EOS, bpe.PAD]) == "hi"  # specials dropped
  assert [list(x) for x in bpe.encode_batch(["a b", "c"])] == [
    list(bpe.encode("a b")),
    list(bpe.encode("c")),
  ]


def save_plain_bpe(path, special_tokens=()):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=list(special_tokens), show_progress=False
  )
  tok.train_from_iterator(CORPUS, trainer=trainer)
  tok.save(str(path))
  return tok.get_vocab_size()


def test_tokenizer_json_without_specials_gets_them_added(tmp_path):
  base = save_plain_bpe(tmp_path / "plain.json")
  tok = load_tokenizer(str(tmp_path / "plain.json"))
  assert sorted((tok.PAD, tok.BOS, tok.EOS)) == [base, base + 1, base + 2]
  assert tok.vocab_size == base + 3


def test_tokenizer_json_uses_its_own_endoftext_as_eos(tmp_path):
  save_plain_bpe(tmp_path / "gpt2ish.json", special_tokens=["<|endoftext|>"])
  tok = load_tokenizer(str(tmp_path / "gpt2ish.json"))
  assert tok.EOS == 0 and len({tok.PAD, tok.BOS, tok.EOS}) == 3
  assert tok.describe()["eos_id"] == 0 and tok.describe()["kind"] == "tokenizer.json"


def test_sentencepiece_model_with_pad_disabled_gets_a_pad_id(tmp_path):
  import sentencepiece

  from jaxstep.data.corpus import text_documents

  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(text_documents(200)))
  sentencepiece.SentencePieceTrainer.train(
    input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=100, minloglevel=2
  )
  tok = load_tokenizer(str(tmp_path / "sp.model"))
  assert (tok.BOS, tok.EOS) == (1, 2) and tok.PAD == 100 and tok.vocab_size == 101
  assert tok.decode(tok.encode("the cat sat on the mat.")) == "the cat sat on the mat."
  assert tok.decode([tok.BOS, *tok.encode("the mat"), tok.EOS, tok.PAD]) == "the mat"
  table = tok.token_bytes()  # "▁the▁mat": the dummy-prefix space counts as a byte
  assert table[tok.encode("the mat")].sum() == len(" the mat") and table[[1, 2, 100]].sum() == 0


def test_unknown_or_missing_tokenizer_is_a_clear_error(tmp_path):
  with pytest.raises(ConfigError, match="tokenizer.json"):
    load_tokenizer("gpt2")
  with pytest.raises(DataError, match="does not exist"):
    load_tokenizer(str(tmp_path / "nope.json"))
  (tmp_path / "bad.json").write_text(json.dumps({"not": "a tokenizer"}))
  with pytest.raises(DataError, match="not a readable tokenizer.json"):
    load_tokenizer(str(tmp_path / "bad.json"))


@pytest.mark.slow
def test_a_run_trains_on_a_bpe_vocabulary(tmp_path, bpe):
  cfg = make_cfg(
    tmp_path,
    f"data.tokenizer={bpe.path}",
    "model.vocab_size=320",
    "train.max_steps=6",
    "train.global_batch_size=8",
    "train.grad_accum_steps=2",
  )
  result = trainer.train(cfg)
  assert result.run_state.step == 6 and np.isfinite(result.last_metrics["loss"])
  with pytest.raises(DataError, match="set model.vocab_size >= 320"):
    trainer.train(
      make_cfg(tmp_path / "small", f"data.tokenizer={bpe.path}", "model.vocab_size=264")
    )
  follows = trainer.build(make_cfg(tmp_path / "auto", f"data.tokenizer={bpe.path}"))[0]
  assert follows.cfg.model.vocab_size == 320  # 0: the tokenizer's size


def test_special_token_names_in_text_stay_text(bpe):
  for text in ("<pad>", "a <bos> b </s>", "<|endoftext|>"):
    ids = bpe.encode(text)
    assert bpe.PAD not in ids and bpe.BOS not in ids and bpe.EOS not in ids
    assert bpe.decode(ids) == text
