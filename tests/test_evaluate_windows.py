"""``evaluate --seq-len/--stride``: sliding windows that score every token once with up to
``seq_len − stride`` tokens of context (the transformers perplexity guide's method), a
model folder scored at its own context, and one plain-text file read as one text."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import folder  # noqa: F401 - fixture
from tolerance import assert_close

import jaxstep
from jaxstep.cli import run as run_command
from jaxstep.data.shards import Windows
from jaxstep.data.strided import StridedWindows
from jaxstep.trainer.saved_run import evaluate as evaluation

PAD = 0
TEXT = "The cat sat on the mat.\n\nA dog ran in the park, and the cat watched it.\n\n" * 6


class Stream:
  """A token stream of documents, as ``TokenStream`` shows one to the windows."""

  def __init__(self, lengths):
    self.doc_starts = np.cumsum([0, *lengths[:-1]]).astype(np.int64)
    self.tokens = np.arange(1, sum(lengths) + 1, dtype=np.int32)  # token = its position + 1

  def __len__(self):
    return len(self.tokens)

  def read(self, start, stop):
    return self.tokens[start:stop], None


@settings(max_examples=60, deadline=None)
@given(
  lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
  seq_len=st.integers(1, 12),
  data=st.data(),
  pack=st.booleans(),
)
def test_every_target_is_scored_once_with_the_context_the_stride_leaves(
  lengths, seq_len, data, pack
):
  stride = data.draw(st.integers(1, seq_len))
  stream = Stream(lengths)
  w = StridedWindows(stream, seq_len, stride, pack, PAD)
  rows = w.rows(np.arange(len(w)), len(w), PAD)
  scored = []  # (target's stream position, tokens of context before it in its window)
  for r in range(len(w)):
    start = int(w.starts[r])
    for t in np.flatnonzero(rows["loss_mask"][r]):
      assert rows["targets"][r, t] == start + t + 2  # the token at position start + 1 + t
      scored.append((start + 1 + t, t + 1))
  positions = [p for p, _ in scored]
  starts = stream.doc_starts.tolist()
  expected = [p for p in range(len(stream)) if p not in starts]  # every token but a BOS
  assert sorted(positions) == expected and len(set(positions)) == len(positions)
  for p, context in scored:  # all the context there is, up to seq_len − stride tokens
    first = 0 if pack else max(s for s in starts if s <= p)  # packed: across documents
    assert context >= min(seq_len - stride + 1, p - first)


def test_a_stride_of_the_whole_window_is_the_plain_windows():
  stream = Stream([30, 7, 19])
  plain, strided = Windows(stream, 8, False, PAD), StridedWindows(stream, 8, 8, False, PAD)
  a = plain.rows(np.arange(len(plain)), len(plain), PAD)
  b = strided.rows(np.arange(len(strided)), len(strided), PAD)
  assert len(plain) == len(strided)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])


def hf_sliding_nll(model, ids: np.ndarray, window: int, stride: int) -> float:
  """The transformers perplexity guide's loop: windows of ``window`` ids ``stride`` apart,
  labels masked but for the ids no earlier window scored; the summed NLL."""
  import torch  # the reference implementation, imported by the tests that use it

  total, prev_end = 0.0, 0
  for begin in range(0, len(ids), stride):
    end = min(begin + window, len(ids))
    chunk = torch.tensor(ids[begin:end][None], dtype=torch.long)
    labels = chunk.clone()
    labels[:, : -(end - prev_end)] = -100
    with torch.no_grad():
      logits = model(chunk).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(
      logits, labels[0, 1:], reduction="sum", ignore_index=-100
    )
    total, prev_end = total + float(nll), end
    if end == len(ids):
      break
  return total


def test_a_folder_with_a_stride_is_the_transformers_sliding_window_nll(folder, tmp_path, capsys):  # noqa: F811
  path, model = folder
  text = tmp_path / "held_out.txt"
  text.write_text(TEXT)
  code = run_command(
    "evaluate", [str(path), "--data", str(text), "--seq-len", "32", "--stride", "8", "--json"]
  )
  out, err = capsys.readouterr()
  assert code == 0, err
  got = json.loads(out)
  assert (got["format"], got["seq_len"], got["stride"]) == ("file", 32, 8)
  saved = jaxstep.load_run(path)
  dataset = evaluation.load_data(saved, path, str(text), "file", 32)
  ids, _ = dataset.train.stream.read(0, len(dataset.train.stream))  # the one text, whole
  assert got["tokens"] == len(ids) - 1  # every token but the first, once
  nll = hf_sliding_nll(model, np.asarray(ids), 33, 8)
  assert_close(got["loss"] * got["tokens"], nll, terms=saved.cfg.model.vocab_size * len(ids))
  assert run_command("evaluate", [str(path), "--data", str(text), "--seq-len", "32", "--json"]) == 0
  plain = json.loads(capsys.readouterr().out)
  assert plain["tokens"] == got["tokens"] and plain["windows"] < got["windows"]


def test_a_folder_is_scored_at_its_own_context_and_a_text_file_is_one_text(
  folder,  # noqa: F811
  tmp_path,
  capsys,
):
  path, _ = folder
  text = tmp_path / "held_out.txt"
  text.write_text(TEXT)
  code = run_command("evaluate", [str(path), "--data", str(text)])
  out, err = capsys.readouterr()
  assert code == 0, err
  assert "(format file, windows of 64 tokens, stride 64)" in out  # the folder's 64 positions
  assert run_command("evaluate", [str(path), "--data", str(text), "--json"]) == 0
  one_text = json.loads(capsys.readouterr().out)
  code = run_command("evaluate", [str(path), "--data", str(text), "--format", "txt", "--json"])
  as_paragraphs = json.loads(capsys.readouterr().out)
  assert code == 0 and as_paragraphs["format"] == "txt" and one_text["format"] == "file"
  # 12 paragraphs, each its own document (its blank lines gone, its own start): not one text
  assert as_paragraphs["bytes"] < one_text["bytes"] and as_paragraphs["loss"] != one_text["loss"]


@pytest.mark.parametrize(
  ("args", "words"),
  [
    (["--seq-len", "65"], "--seq-len 65 is longer than the 64 positions the model takes"),
    (["--seq-len", "16", "--stride", "17"], "--stride 17 must be between 1 and the window, 16"),
  ],
)
def test_a_window_or_stride_that_cannot_be_is_one_line(folder, tmp_path, capsys, args, words):  # noqa: F811
  path, _ = folder
  text = tmp_path / "t.txt"
  text.write_text(TEXT)
  assert run_command("evaluate", [str(path), "--data", str(text), *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error:") and words in err and err.count("\n") == 1
