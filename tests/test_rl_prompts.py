"""An RL run's prompts: string prompts encoded as generation prompts, conversational ones
rendered with the folder's template and its generation prompt, the other columns kept by
name for the rewards, long prompts cut from the left, bad rows named in one line."""

import json

import numpy as np
import pytest
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import folder  # noqa: F401 - fixture

from jaxstep.data import ByteTokenizer, load_prompt_dataset
from jaxstep.data.prompt_rows import read_prompts
from jaxstep.data.tokenizer_loading import load_tokenizer
from jaxstep.errors import DataError

TOK = ByteTokenizer()


def jsonl(tmp_path, rows, name="prompts.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_string_prompts_are_bos_and_their_bytes_with_their_columns(tmp_path):
  rows = [{"prompt": "1 + 2 = ", "answer": "3"}, {"prompt": "a long prompt here", "answer": "x"}]
  got = read_prompts(jsonl(tmp_path, rows), TOK, max_prompt_len=10)
  np.testing.assert_array_equal(got.ids[0], [TOK.BOS, *TOK.encode("1 + 2 = ")])
  assert got.texts == ["1 + 2 = ", "a long prompt here"] and got.columns == {"answer": ["3", "x"]}
  np.testing.assert_array_equal(got.ids[1], TOK.encode("a long prompt here")[-10:])  # its end
  assert got.truncated == 1


def test_a_conversational_prompt_is_rendered_with_the_generation_prompt(folder):  # noqa: F811
  path, _ = folder
  tok = load_tokenizer(str(path))
  rows = [{"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "answer": "3"}]
  got = read_prompts(jsonl(path.parent, rows), tok, max_prompt_len=200)
  assert got.texts[0].endswith("<|im_start|>assistant\n")  # the assistant's turn is next
  np.testing.assert_array_equal(got.ids[0], tok.encode_rendered(got.texts[0]))


@pytest.mark.parametrize(
  "rows, words",
  [
    ([{"answer": "3"}], 'needs a "prompt"'),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], "columns []; earlier rows have ['answer']"),
    ([{"prompt": ""}], '"prompt" is empty'),
    ([{"prompt": [{"role": "user", "content": "hi"}]}], "chat template"),
  ],
)
def test_bad_rows_are_one_line_naming_the_row(tmp_path, rows, words):
  with pytest.raises(DataError, match=words.replace("[", r"\[").replace("]", r"\]")) as e:
    read_prompts(jsonl(tmp_path, rows), TOK, max_prompt_len=10)
  assert "prompts.jsonl:" in str(e.value) and "\n" not in str(e.value)


def test_held_out_prompts_are_chosen_by_place_and_the_fingerprint_follows_the_data(tmp_path):
  rows = [{"prompt": f"{i} + 1 = ", "answer": str(i + 1)} for i in range(200)]
  a = load_prompt_dataset(jsonl(tmp_path, rows), "byte", max_prompt_len=12, eval_fraction=0.1)
  assert len(a.train) + len(a.eval) == 200 and 5 < len(a.eval) < 40
  b = load_prompt_dataset(jsonl(tmp_path, rows), "byte", max_prompt_len=12, eval_fraction=0.1)
  assert b.eval.texts == a.eval.texts and b.fingerprint == a.fingerprint
  c = load_prompt_dataset(jsonl(tmp_path, rows[:-1]), "byte", max_prompt_len=12, eval_fraction=0.1)
  assert c.fingerprint != a.fingerprint
