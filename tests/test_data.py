"""Data: mask rules on hand-made examples, prepared windows equal to an independent
in-memory cut, batching arithmetic, order, bad input."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxstep import DataError
from jaxstep.data import (
  ByteTokenizer,
  DataConfig,
  epoch_order,
  global_batch,
  load_dataset,
  steps_per_epoch,
)
from jaxstep.data.readers import read_documents
from jaxstep.data.samples import encode_chat, encode_text

TOK = ByteTokenizer()
B, E, P = TOK.BOS, TOK.EOS, TOK.PAD


def ids(text):
  return [int(i) for i in TOK.encode(text)]


# --- the reference: windows cut from whole streams in memory --------------------------


def cut_windows(
  tokens: np.ndarray, flags: np.ndarray, seq_len: int, pad_id: int
) -> dict[str, np.ndarray]:
  """Cuts one stream into ``{"inputs", "targets", "loss_mask"}``, each ``int32[n, seq_len]``."""
  n = max(0, -(-(len(tokens) - 1) // seq_len))  # ceil((len − 1) / seq_len)
  total = n * seq_len + 1
  tokens = np.concatenate([tokens, np.full(total - len(tokens), pad_id, np.int32)])
  flags = np.concatenate([flags, np.zeros(total - len(flags), np.int8)])
  idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]  # [n, S+1]
  windows, wflags = tokens[idx], flags[idx]
  return {
    "inputs": windows[:, :-1].astype(np.int32),
    "targets": windows[:, 1:].astype(np.int32),
    "loss_mask": wflags[:, 1:].astype(np.int32),
  }


def make_samples(docs: list, kind: str, seq_len: int, tok, pack: bool) -> dict[str, np.ndarray]:
  """All windows of ``docs``: one packed stream, or each document on its own windows."""
  encode = encode_chat if kind == "chat" else encode_text
  streams = [encode(d, tok) for d in docs]
  if pack:
    streams = [(np.concatenate([s[0] for s in streams]), np.concatenate([s[1] for s in streams]))]
  parts = [cut_windows(t, f, seq_len, tok.PAD) for t, f in streams]
  return {
    k: np.concatenate([p[k] for p in parts]) if parts else np.zeros((0, seq_len), np.int32)
    for k in ("inputs", "targets", "loss_mask")
  }


def windows_of(tmp_path, docs, kind="text", seq_len=8, pack=True):
  """Every window of ``docs`` through the real path: prepare to shards, read back."""
  path = tmp_path / "c.jsonl"
  lines = [json.dumps({"messages": d} if kind == "chat" else {"text": d}) for d in docs]
  path.write_text("\n".join(lines) + "\n")
  fmt = "chat" if kind == "chat" else "jsonl"
  ds = load_dataset(
    DataConfig(path=str(path), format=fmt, pack=pack, eval_fraction=0.0), seq_len=seq_len
  )
  return ds.train.rows(np.arange(len(ds.train)), len(ds.train), P)


def test_document_boundary_masks_only_the_target_across_eos(tmp_path):
  s = windows_of(tmp_path, ["ab", "cd"], seq_len=7)
  assert s["inputs"].tolist() == [[B, *ids("ab"), E, B, *ids("cd")]]
  assert s["targets"].tolist() == [[*ids("ab"), E, B, *ids("cd"), E]]
  # predicting EOS is learned; predicting the next document's BOS from EOS is not
  assert s["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 1]]


def test_windows_overlap_by_one_so_each_target_counts_once(tmp_path):
  w = windows_of(tmp_path, ["abcdefghij"], seq_len=4)  # 12 tokens: BOS + 10 + EOS
  assert w["inputs"].shape == (3, 4)  # ceil(11 / 4)
  assert w["inputs"][1, 0] == w["targets"][0, -1]  # window k+1 starts where k's targets end
  assert w["loss_mask"].sum() == 11
  assert w["targets"][-1].tolist() == [*ids("ij"), E, P]
  assert w["loss_mask"][-1].tolist() == [1, 1, 1, 0]  # padding never counts


def test_chat_loss_only_on_assistant_content_and_its_end_token(tmp_path):
  messages = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi?"},
    {"role": "assistant", "content": "yo."},
    {"role": "user", "content": "ok"},
  ]
  tokens, _ = encode_chat(messages, TOK)
  w = windows_of(tmp_path, [messages], kind="chat", seq_len=len(tokens) - 1, pack=False)
  counted = w["targets"][0][w["loss_mask"][0] == 1].tolist()
  assert counted == [*ids("yo."), E]
  assert (
    TOK.decode(w["inputs"][0]) == "<|system|>\nbe brief<|user|>\nhi?<|assistant|>\nyo.<|user|>\nok"
  )


def test_mask_count_equals_hf_shifted_label_count(tmp_path):
  # Independent count with the HF convention: labels = tokens where trainable else -100,
  # and the loss counts labels[..., 1:] != -100.
  rng = np.random.default_rng(0)
  docs = ["".join(rng.choice(list("xyz "), size=rng.integers(1, 30))) for _ in range(20)]
  s = windows_of(tmp_path, docs, seq_len=16)
  stream_tokens, stream_flags = zip(*(encode_text(d, TOK) for d in docs), strict=True)
  labels = np.where(np.concatenate(stream_flags) == 1, np.concatenate(stream_tokens), -100)
  assert s["loss_mask"].sum() == (labels[1:] != -100).sum()


TEXT_DOCS = st.lists(st.text(alphabet="ab é\n", min_size=0, max_size=40), min_size=1, max_size=12)
CHAT_DOCS = st.lists(
  st.lists(
    st.fixed_dictionaries(
      {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.text("xy ", max_size=9),
      }
    ),
    min_size=1,
    max_size=4,
  ),
  min_size=1,
  max_size=6,
)


@settings(
  max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
  docs=st.one_of(TEXT_DOCS.map(lambda d: ("text", d)), CHAT_DOCS.map(lambda d: ("chat", d))),
  seq_len=st.integers(1, 9),
  pack=st.booleans(),
)
def test_prepared_windows_equal_the_in_memory_cut(tmp_path_factory, docs, seq_len, pack):
  kind, docs = docs
  reference = make_samples(docs, kind, seq_len, TOK, pack)
  if reference["loss_mask"].sum() == 0:
    return  # no trainable token: the loader refuses such data (tested below)
  got = windows_of(tmp_path_factory.mktemp("w"), docs, kind, seq_len, pack)
  for key in ("inputs", "targets", "loss_mask"):
    np.testing.assert_array_equal(got[key], reference[key], err_msg=key)


class ArraySplit:
  """A split held in arrays: enough for the batching arithmetic."""

  def __init__(self, n, s=3):
    self.inputs = np.arange(n * s, dtype=np.int32).reshape(n, s)

  def __len__(self):
    return len(self.inputs)

  def rows(self, index, num_rows, pad_id):
    inputs = np.full((num_rows, self.inputs.shape[1]), pad_id, np.int32)
    inputs[: len(index)] = self.inputs[index]
    mask = np.zeros_like(inputs)
    mask[: len(index)] = 1
    return {"inputs": inputs, "targets": inputs + 1, "loss_mask": mask}


def split_of(n, s=3):
  return ArraySplit(n, s)


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


def test_rows_read_only_this_processs_part_of_the_global_batch():
  split = split_of(9)
  full = global_batch(split, 0, 0, 1, 8, P)  # the tail batch: 1 real row + 7 padding
  part = global_batch(split, 0, 0, 1, 8, P, rows=np.array([0, 4, 5]))
  np.testing.assert_array_equal(part["inputs"], full["inputs"][[0, 4, 5]])
  np.testing.assert_array_equal(part["loss_mask"], full["loss_mask"][[0, 4, 5]])


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


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
@pytest.mark.parametrize("bad_line", [3, 20_000])  # in the first chunk read, and far past it
def test_a_byte_that_is_not_utf8_is_reported_at_its_own_line(tmp_path, fmt, bad_line):
  good = json.dumps({"text": "fine"}) if fmt == "jsonl" else "fine text"
  path = tmp_path / f"c.{fmt}"
  lines = [good.encode()] * (bad_line - 1) + [b"caf\xe9 " + good.encode(), good.encode()]
  path.write_bytes(b"\n".join(lines) + b"\n")
  with pytest.raises(DataError, match=rf"c\.{fmt}:{bad_line}: not UTF-8") as e:
    read_documents(str(path), fmt)
  assert str(path) in str(e.value)


def test_chat_record_without_valid_roles_is_rejected(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
  with pytest.raises(DataError, match=r"c.jsonl:1: each message needs a role"):
    read_documents(str(path), "chat")


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda p: p / "missing.txt", "does not exist"),
    (lambda p: (p / "empty.txt").write_text("\n\n") and p / "empty.txt", "no documents"),
    (lambda p: p, "holds no readable files"),
  ],
)
def test_missing_or_empty_data_is_a_clear_error(tmp_path, make, match):
  with pytest.raises(DataError, match=match):
    load_dataset(DataConfig(path=str(make(tmp_path))), seq_len=8)


def test_chat_without_assistant_turns_has_no_trainable_tokens(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
  with pytest.raises(DataError, match="no trainable tokens"):
    load_dataset(DataConfig(path=str(path), eval_fraction=0.0), seq_len=8)


def test_bundled_corpus_splits_documents_and_has_a_stable_fingerprint():
  a = load_dataset(DataConfig(), seq_len=64)
  b = load_dataset(DataConfig(), seq_len=64)
  assert len(a.train) > 1000 and len(a.eval) > 10
  assert a.fingerprint == b.fingerprint and a.vocab_size == 259
  assert a.fingerprint != load_dataset(DataConfig(), seq_len=32).fingerprint
  assert a.fingerprint != load_dataset(DataConfig(pack=False), seq_len=64).fingerprint


def test_a_prepared_folder_is_read_in_place(tmp_path):
  from jaxstep.data.preparation import prepare

  prepare(["bundled:chat"], tmp_path / "p", progress=False)
  ds = load_dataset(DataConfig(path=str(tmp_path / "p"), pack=False), seq_len=96)
  assert ds.folder == tmp_path / "p" and ds.kind == "chat"


def docs_folder(root):
  """A documentation tree: Markdown, reST, an extensionless README, plain text, a binary
  file with NUL bytes, a Latin-1 file and a hidden folder."""
  (root / "guide").mkdir(parents=True)
  (root / "index.md").write_text("# Title\n\nmarkdown body\n")
  (root / "guide" / "usage.rst").write_text("Usage\n=====\n\nrest body\n")
  (root / "README").write_text("readme body\n")
  (root / "notes.txt").write_text("plain notes\n")
  (root / "logo.bin").write_bytes(b"\x89PNG\x00\x00\x01binary")
  (root / "old.txt").write_bytes("caf\xe9 latin-1".encode("latin-1"))
  (root / ".git").mkdir()
  (root / ".git" / "config").write_text("[core]\n")
  return root


def test_a_directory_reads_every_utf8_text_file_and_says_what_it_skipped(tmp_path, caplog):
  import logging

  from jaxstep.data.readers import list_files, scan

  root = docs_folder(tmp_path / "docs")
  docs, kind = read_documents(str(root))
  assert kind == "text" and sorted(docs) == sorted(
    ["# Title", "markdown body", "Usage\n=====", "rest body", "readme body", "plain notes"]
  )
  listing = scan(str(root))
  assert [f.name for f in listing.files] == ["README", "usage.rst", "index.md", "notes.txt"]
  assert {reason: len(names) for reason, names in listing.skipped.items()} == {
    "binary (NUL bytes)": 1,
    "not UTF-8": 1,
    "hidden": 1,
  }
  with caplog.at_level(logging.INFO, logger="jaxstep"):
    ds = load_dataset(DataConfig(path=str(root), eval_fraction=0.0), seq_len=8)
  assert len(ds.manifest["sources"]) == 4
  said = " ".join(r.getMessage() for r in caplog.records)
  assert "skipped 3 of 7" in said and "1 binary (NUL bytes): logo.bin" in said
  assert "1 not UTF-8: old.txt" in said and "1 hidden: .git" in said
  jsonl = scan(str(root), "jsonl")
  assert jsonl.files == [] and len(jsonl.skipped["not .jsonl"]) == 6
  with pytest.raises(DataError, match="holds no readable files.*6 not .jsonl"):
    list_files(str(root), "jsonl")
