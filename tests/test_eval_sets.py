"""Named eval sets: raw sets equal an independent byte tokenization cut as training cuts
it; prepared sets must share the training tokenizer and count both splits; bad config and
empty sets are refused in one line naming the set."""

import json

import numpy as np
import pytest

from jaxstep.data import ByteTokenizer, DataConfig, eval_batches, load_dataset, prepare
from jaxstep.data.manifest import MANIFEST
from jaxstep.errors import ConfigError, DataError
from jaxstep.trainer.config.schema import HELDOUT, MAX_EVAL_SETS, check_eval_sets
from jaxstep.trainer.evaluation.eval_sets import (
  ChainedWindows,
  load_eval_sets,
  training_tokenizer,
)

TOK = ByteTokenizer()
SEQ = 8


def all_rows(split) -> dict[str, np.ndarray]:
  return split.rows(np.arange(len(split)), len(split), TOK.PAD)


def expected_windows(docs: list[str], seq_len: int) -> dict[str, np.ndarray]:
  """The reference: ``BOS bytes EOS`` per document, packed, cut every ``seq_len`` tokens
  into ``seq_len + 1``-token windows padded with PAD; every token but a BOS is a target."""
  tokens = np.concatenate([[TOK.BOS, *TOK.encode(d), TOK.EOS] for d in docs]).astype(np.int32)
  flags = np.concatenate([[0, *np.ones(len(TOK.encode(d)) + 1)] for d in docs]).astype(np.int32)
  n = -(-(len(tokens) - 1) // seq_len)
  total = n * seq_len + 1
  tokens = np.concatenate([tokens, np.full(total - len(tokens), TOK.PAD, np.int32)])
  flags = np.concatenate([flags, np.zeros(total - len(flags), np.int32)])
  idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]
  return {
    "inputs": tokens[idx][:, :-1],
    "targets": tokens[idx][:, 1:],
    "loss_mask": flags[idx][:, 1:],
  }


def text_file(path, docs: list[str]):
  path.write_text("\n\n".join(docs) + "\n")
  return str(path)


@pytest.fixture
def training(tmp_path):
  """A byte-tokenized raw training set: its config and dataset."""
  cfg = DataConfig(path=text_file(tmp_path / "train.txt", ["one two", "three"]))
  return cfg, load_dataset(cfg, SEQ)


def test_raw_text_set_equals_an_independent_byte_tokenization(tmp_path, training):
  docs = ["the quick brown fox", "jumps over", "the lazy dog, twice over"]
  sets = {"fox": text_file(tmp_path / "fox.txt", docs)}
  got = load_eval_sets(sets, training[0], SEQ, training[1])
  want = expected_windows(docs, SEQ)
  assert list(got) == ["fox"] and len(got["fox"]) == len(want["inputs"])
  rows = all_rows(got["fox"])
  for key in ("inputs", "targets", "loss_mask"):
    np.testing.assert_array_equal(rows[key], want[key], err_msg=key)


def test_unpacked_training_cuts_each_document_on_its_own(tmp_path):
  cfg = DataConfig(path=text_file(tmp_path / "t.txt", ["abc"]), format="txt", pack=False)
  docs = ["a longer first document", "b"]
  got = load_eval_sets({"s": text_file(tmp_path / "s.txt", docs)}, cfg, SEQ, load_dataset(cfg, SEQ))
  want = [expected_windows([d], SEQ) for d in docs]
  rows = all_rows(got["s"])
  for key in ("inputs", "targets", "loss_mask"):
    np.testing.assert_array_equal(rows[key], np.concatenate([w[key] for w in want]))


def test_bundled_text_is_a_set(training):
  got = load_eval_sets({"bundled": "bundled:text"}, training[0], SEQ, training[1])
  assert len(got["bundled"]) > 0


def test_prepared_folder_set_counts_both_splits(tmp_path, training):
  docs = [f"document number {i} of the prepared set" for i in range(40)]
  folder = tmp_path / "prepared"
  manifest = prepare(
    [text_file(tmp_path / "p.txt", docs)], folder, fmt="txt", eval_fraction=0.5, progress=False
  )
  assert manifest["splits"]["eval"]["documents"] > 0 and manifest["splits"]["train"]["documents"]
  got = load_eval_sets({"p": str(folder)}, training[0], SEQ, training[1])["p"]
  assert isinstance(got, ChainedWindows)
  own = load_dataset(DataConfig(path=str(folder)), SEQ)
  assert len(got) == len(own.train) + len(own.eval)
  rows = all_rows(got)
  want = [all_rows(own.train), all_rows(own.eval)]
  for key in ("inputs", "targets", "loss_mask"):
    np.testing.assert_array_equal(rows[key], np.concatenate([w[key] for w in want]))
  targets = sum(s["targets"] for s in manifest["splits"].values())
  assert rows["loss_mask"].sum() == targets  # every document's every target, once
  # eval_batches reads it as it reads a split: the same windows, the last batch padded
  batches = list(eval_batches(got, 7, TOK.PAD))
  assert len(batches) == -(-len(got) // 7)
  joined = np.concatenate([b["inputs"] for b in batches])
  np.testing.assert_array_equal(joined[: len(got)], rows["inputs"])
  assert not np.concatenate([b["loss_mask"] for b in batches])[len(got) :].any()


def test_chained_windows_rows_in_any_order(tmp_path, training):
  folder = tmp_path / "prepared"
  docs = [f"doc {i} " * 3 for i in range(30)]
  prepare(
    [text_file(tmp_path / "p.txt", docs)], folder, fmt="txt", eval_fraction=0.5, progress=False
  )
  got = load_eval_sets({"p": str(folder)}, training[0], SEQ, training[1])["p"]
  every = all_rows(got)
  index = np.random.default_rng(0).permutation(len(got))[:5]
  some = got.rows(index, 8, TOK.PAD)
  np.testing.assert_array_equal(some["inputs"][:5], every["inputs"][index])
  assert (some["inputs"][5:] == TOK.PAD).all() and not some["loss_mask"][5:].any()


def test_prepared_set_of_another_tokenizer_is_refused_naming_it(tmp_path, training):
  folder = tmp_path / "bpe"
  text = text_file(tmp_path / "p.txt", [f"some words {i} and more" for i in range(50)])
  prepare([text], folder, fmt="txt", train_bpe_vocab=300, progress=False)
  with pytest.raises(DataError) as e:
    load_eval_sets({"wiki": str(folder)}, training[0], SEQ, training[1])
  message = str(e.value)
  assert "eval.sets.wiki" in message and "another tokenizer" in message and "\n" not in message
  assert "--tokenizer byte" in message


def test_raw_set_uses_a_prepared_training_folders_tokenizer(tmp_path):
  folder = tmp_path / "bpe"
  text = text_file(tmp_path / "p.txt", [f"some words {i} and more" for i in range(50)])
  prepare([text], folder, fmt="txt", train_bpe_vocab=300, progress=False)
  cfg = DataConfig(path=str(folder), format="txt")
  dataset = load_dataset(cfg, SEQ)
  assert training_tokenizer(cfg, dataset) == str(folder / "tokenizer.json")
  docs = ["some words and more words"]
  got = load_eval_sets({"raw": text_file(tmp_path / "raw.txt", docs)}, cfg, SEQ, dataset)["raw"]
  ids = dataset.tokenizer.encode(docs[0])
  tokens = all_rows(got)["inputs"].ravel()
  assert tokens[0] == dataset.tokenizer.BOS and tokens[1 : 1 + len(ids)].tolist() == ids.tolist()


def test_prepared_set_of_the_same_tokenizer_is_accepted(tmp_path, training):
  folder = tmp_path / "same"
  prepare([text_file(tmp_path / "p.txt", ["abc", "def"])], folder, fmt="txt", progress=False)
  got = load_eval_sets({"same": str(folder)}, training[0], SEQ, training[1])
  assert len(got["same"]) == len(expected_windows(["abc", "def"], SEQ)["inputs"])


def test_missing_set_names_it(tmp_path, training):
  with pytest.raises(DataError, match=r"^eval\.sets\.gone '.*nowhere\.txt' does not exist$"):
    load_eval_sets({"gone": str(tmp_path / "nowhere.txt")}, training[0], SEQ, training[1])


def test_set_without_targets_names_it(tmp_path, training):
  chat = tmp_path / "users.jsonl"
  chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
  with pytest.raises(DataError) as e:
    load_eval_sets({"users": str(chat)}, training[0], SEQ, training[1])
  assert "eval.sets.users" in str(e.value) and "loss-masked target" in str(e.value)
  assert "\n" not in str(e.value)


def test_damaged_prepared_set_names_it(tmp_path, training):
  folder = tmp_path / "p"
  prepare([text_file(tmp_path / "p.txt", ["abc"])], folder, fmt="txt", progress=False)
  (folder / MANIFEST).write_text("{")
  with pytest.raises(DataError, match=r"^eval\.sets\.p \(.*\): .*not valid JSON"):
    load_eval_sets({"p": str(folder)}, training[0], SEQ, training[1])


def test_no_sets_is_no_windows(training):
  assert load_eval_sets({}, training[0], SEQ, training[1]) == {}


def test_check_sets_returns_a_plain_dict_in_order():
  sets = {"wiki": "a.txt", "code.v2": "b/", "B-1_x": "bundled:chat"}
  got = check_eval_sets(sets)
  assert got == sets and type(got) is dict and list(got) == list(sets)


@pytest.mark.parametrize(
  ("sets", "said"),
  [
    ({"bad name": "a.txt"}, "'bad name'"),
    ({"-lead": "a.txt"}, "'-lead'"),
    ({"": "a.txt"}, "''"),
    ({"a/b": "a.txt"}, "'a/b'"),
    ({HELDOUT: "a.txt"}, "'heldout'"),
    ({"harness": "a.txt"}, "'harness' is eval.harness_tasks' results"),
    ({"wiki": ""}, "eval.sets.wiki"),
    ({"wiki": "  "}, "eval.sets.wiki"),
    ({"wiki": 3}, "eval.sets.wiki"),
    ({f"s{i}": "a.txt" for i in range(MAX_EVAL_SETS + 1)}, f"at most {MAX_EVAL_SETS}"),
    (["a.txt"], "eval.sets must map"),
  ],
)
def test_check_sets_refuses_naming_the_entry(sets, said):
  with pytest.raises(ConfigError) as e:
    check_eval_sets(sets)
  assert "eval.sets" in str(e.value) and said in str(e.value) and "\n" not in str(e.value)
