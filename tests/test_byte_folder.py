"""The byte tokenizer written as a Hugging Face tokenizer: jaxstep reads the folder with the
ids it trained on, transformers' ``AutoTokenizer`` encodes and decodes as the run did, and an
export of a run on bytes is a model folder a later run can start from."""

import numpy as np
import pytest
from conftest import make_cfg
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstep import trainer
from jaxstep.cli import run as run_command
from jaxstep.data.byte_folder import write_byte_tokenizer
from jaxstep.data.hf_folder import folder_tokenizer
from jaxstep.data.tokenizer import ByteTokenizer
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan.numbers import make_plan

BYTES = ByteTokenizer()


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp("bytes")
  write_byte_tokenizer(folder)
  (folder / "config.json").write_text("{}")
  return folder


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=40))
def test_the_folder_encodes_every_text_as_its_utf8_bytes(byte_folder, text):
  tok = folder_tokenizer(byte_folder)
  assert tok.encode(text).tolist() == list(text.encode("utf-8"))
  assert tok.decode(list(text.encode("utf-8"))) == text


def test_the_folder_keeps_the_byte_tokenizers_special_ids(byte_folder):
  tok = folder_tokenizer(byte_folder)
  assert (tok.PAD, tok.BOS, tok.EOS, tok.vocab_size) == (256, 257, 258, 259)
  assert tok.has_bos and tok.encode("<s>").tolist() == list(b"<s>")  # text stays text


def test_transformers_starts_a_text_with_bos_and_then_its_bytes(byte_folder):
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(str(byte_folder))
  text = "12 + 30 = 42\nhé 😀"
  ids = hf(text)["input_ids"]
  assert ids == [BYTES.BOS, *text.encode("utf-8")]
  assert hf.decode(ids, skip_special_tokens=True) == text
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (257, 258, 256)


@pytest.mark.slow
def test_an_export_of_a_byte_run_is_a_folder_a_run_starts_from(tmp_path):
  trainer.train(make_cfg(tmp_path, "train.max_steps=1", "train.global_batch_size=8"))
  out = tmp_path / "hf"
  assert run_command("export", [str(tmp_path / "run"), "--out", str(out)]) == 0
  assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
  cfg = config_lib.load(
    None, [f"model.init_from={out}", f"data.path={tmp_path / 'corpus.txt'}", "train.seq_len=16"]
  )
  plan = make_plan(cfg, read_data=True)
  assert plan.cfg.model.vocab_size == 264 and plan.dataset.tokenizer.vocab_size == 259
  first = plan.dataset.train.rows(np.arange(1), 1, plan.dataset.pad_id)
  assert first["inputs"][0, 0] == BYTES.BOS  # the same framing as the run on bytes
