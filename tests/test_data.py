"""Data: mask rules on hand-made examples, batching arithmetic, order, bad input."""

import json

import numpy as np
import pytest

from jaxstep import DataError
from jaxstep.data import (
  ByteTokenizer,
  DataConfig,
  Split,
  epoch_order,
  global_batch,
  load_dataset,
  steps_per_epoch,
)
from jaxstep.data.readers import read_documents
from jaxstep.data.samples import cut_windows, encode_chat, encode_text, make_samples

TOK = ByteTokenizer()
B, E, P = TOK.BOS, TOK.EOS, TOK.PAD


def ids(text):
  return [int(i) for i in TOK.encode(text)]


def test_document_boundary_masks_only_the_target_across_eos():
  s = make_samples(["ab", "cd"], "text", seq_len=7, tok=TOK, pack=True)
  assert s["inputs"].tolist() == [[B, *ids("ab"), E, B, *ids("cd")]]
  assert s["targets"].tolist() == [[*ids("ab"), E, B, *ids("cd"), E]]
  # predicting EOS is learned; predicting the next document's BOS from EOS is not
  assert s["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 1]]


def test_windows_overlap_by_one_so_each_target_counts_once():
  tokens, flags = encode_text("abcdefghij", TOK)  # 12 tokens: BOS + 10 + EOS
  w = cut_windows(tokens, flags, seq_len=4, pad_id=P)
  assert w["inputs"].shape == (3, 4)  # ceil(11 / 4)
  assert w["inputs"][1, 0] == w["targets"][0, -1]  # window k+1 starts where k's targets end
  assert w["loss_mask"].sum() == flags[1:].sum() == 11
  assert w["targets"][-1].tolist() == [*ids("ij"), E, P]
  assert w["loss_mask"][-1].tolist() == [1, 1, 1, 0]  # padding never counts


def test_chat_loss_only_on_assistant_content_and_its_end_token():
  messages = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi?"},
    {"role": "assistant", "content": "yo."},
    {"role": "user", "content": "ok"},
  ]
  tokens, flags = encode_chat(messages, TOK)
  w = cut_windows(tokens, flags, seq_len=len(tokens) - 1, pad_id=P)
  counted = w["targets"][0][w["loss_mask"][0] == 1].tolist()
  assert counted == [*ids("yo."), E]
  assert (
    TOK.decode(w["inputs"][0]) == "<|system|>\nbe brief<|user|>\nhi?<|assistant|>\nyo.<|user|>\nok"
  )


def test_mask_count_equals_hf_shifted_label_count():
  # Independent count with the HF convention: labels = tokens where trainable else -100,
  # and the loss counts labels[..., 1:] != -100.
  rng = np.random.default_rng(0)
  docs = ["".join(rng.choice(list("xyz "), size=rng.integers(1, 30))) for _ in range(20)]
  s = make_samples(docs, "text", seq_len=16, tok=TOK, pack=True)
  stream_tokens, stream_flags = zip(*(encode_text(d, TOK) for d in docs), strict=True)
  labels = np.where(np.concatenate(stream_flags) == 1, np.concatenate(stream_tokens), -100)
  assert s["loss_mask"].sum() == (labels[1:] != -100).sum()


def split_of(n, s=3):
  rows = np.arange(n * s, dtype=np.int32).reshape(n, s)
  return Split(inputs=rows, targets=rows + 1, loss_mask=np.ones((n, s), np.int32))


@pytest.mark.parametrize("n, expected", [(8, 1), (9, 2), (15, 2), (16, 2), (17, 3)])
def test_steps_per_epoch_is_ceil(n, expected):
  assert steps_per_epoch(n, 8) == expected


def test_global_batch_holds_g_samples_and_pads_the_tail():
  split = split_of(9)
  first = global_batch(split, seed=0, epoch=0, step_in_epoch=0, global_batch_size=8, pad_id=P)
  tail = global_batch(split, seed=0, epoch=0, step_in_epoch=1, global_batch_size=8, pad_id=P)
  assert first["inputs"].shape == tail["inputs"].shape == (8, 3)
  assert first["loss_mask"].sum() == 24
  assert tail["loss_mask"].sum() == 3 and (tail["inputs"][1:] == P).all()


def test_no_sample_twice_within_an_epoch_and_order_depends_on_seed_and_epoch():
  split = split_of(17)
  seen = np.concatenate(
    [global_batch(split, 0, 0, s, 8, P)["inputs"][:, 0] for s in range(steps_per_epoch(17, 8))]
  )
  seen = seen[seen != P] // 3
  assert sorted(seen.tolist()) == list(range(17))
  np.testing.assert_array_equal(epoch_order(0, 0, 17), epoch_order(0, 0, 17))
  assert not np.array_equal(epoch_order(0, 0, 17), epoch_order(0, 1, 17))
  assert not np.array_equal(epoch_order(0, 0, 17), epoch_order(1, 0, 17))


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
  (tmp_path / "a.txt").write_text("one\nline two\n\n\nthree\n")
  (tmp_path / "b.txt").write_text("four")
  docs, kind = read_documents(str(tmp_path))
  assert docs == ["one\nline two", "three", "four"] and kind == "text"


def test_jsonl_text_and_chat_are_detected(tmp_path):
  (tmp_path / "t.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
  assert read_documents(str(tmp_path / "t.jsonl")) == (["hello"], "text")
  chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
  (tmp_path / "c.jsonl").write_text(json.dumps(chat) + "\n")
  assert read_documents(str(tmp_path / "c.jsonl"))[1] == "chat"


def test_malformed_jsonl_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"text": "ok"}\n\n{"text": oops}\n')
  with pytest.raises(DataError, match=r"bad.jsonl:3: malformed JSON"):
    read_documents(str(path))


def test_chat_record_without_valid_roles_is_rejected(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
  with pytest.raises(DataError, match=r"c.jsonl:1: each message needs a role"):
    read_documents(str(path), "chat")


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda p: p / "missing.txt", "does not exist"),
    (lambda p: (p / "empty.txt").write_text("\n\n") and p / "empty.txt", "holds no documents"),
    (lambda p: p, "matches no .txt or .jsonl files"),
  ],
)
def test_missing_or_empty_data_is_a_clear_error(tmp_path, make, match):
  with pytest.raises(DataError, match=match):
    load_dataset(DataConfig(path=str(make(tmp_path))), seq_len=8, vocab_size=264)


def test_token_ids_outside_the_vocabulary_are_rejected():
  with pytest.raises(DataError, match=r"token id 258 is outside.*model.vocab_size 200"):
    load_dataset(DataConfig(), seq_len=32, vocab_size=200)


def test_chat_without_assistant_turns_has_no_trainable_tokens(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
  with pytest.raises(DataError, match="no trainable tokens"):
    load_dataset(DataConfig(path=str(path), eval_fraction=0.0), seq_len=8, vocab_size=264)


def test_bundled_corpus_splits_documents_and_has_a_stable_fingerprint():
  a = load_dataset(DataConfig(), seq_len=64, vocab_size=264)
  b = load_dataset(DataConfig(), seq_len=64, vocab_size=264)
  assert len(a.train) > 1000 and len(a.eval) > 10
  assert a.fingerprint == b.fingerprint
  assert a.fingerprint != load_dataset(DataConfig(), seq_len=32, vocab_size=264).fingerprint
