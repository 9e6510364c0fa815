"""Preference pairs from JSONL: string and conversational rows encoded as hand-computed here
(bytes, and a model folder's tokenizer read by the ``tokenizers`` library itself), explicit
truncation and its counts, one-line errors naming the row, and batches the preference loss
takes."""

import json

import numpy as np
import pytest
import test_hf_folder
from test_chat_sft import CHATML
from test_hf_folder import CHATML_TEMPLATE, LLAMA3_TEMPLATE, llama3, qwen

from jaxstep.data import preference_pairs as pp
from jaxstep.data.hf_folder import folder_tokenizer
from jaxstep.data.tokenizer import ByteTokenizer
from jaxstep.errors import BatchError, ConfigError, DataError

tokenizer_files = test_hf_folder.tokenizer_files  # the fixture: a BPE with ChatML's tokens
BYTES = ByteTokenizer()  # PAD 256, BOS 257, EOS 258
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
YO, NO = [{"role": "assistant", "content": "Yo"}], [{"role": "assistant", "content": "No way"}]


def write(tmp_path, rows, name="pairs.jsonl"):
  path = tmp_path / name
  path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
  return str(path)


def pair(prompt, chosen, rejected, **extra):
  return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **extra}


def window(tokens, prompt_len, seq_len, pad):
  """What one side's row must be, from its S + 1 tokens written out: inputs, targets, mask."""
  assert len(tokens) <= seq_len + 1, "the test's own lengths"
  full = list(tokens) + [pad] * (seq_len + 1 - len(tokens))
  mask = [int(prompt_len <= t + 1 < len(tokens)) for t in range(seq_len)]
  return full[:-1], full[1:], mask


def rows_of(pairs, i, side):
  return [pairs.arrays[f"{side}_{part}"][i].tolist() for part in ("inputs", "targets", "mask")]


def test_a_string_pair_on_bytes_is_bos_prompt_then_completion_eos(tmp_path):
  path = write(tmp_path, [pair("Hi", "Yo", "No!", score=3)])  # other columns are ignored
  pairs = pp.load_pairs(path, BYTES, seq_len=8)
  H, i, Y, o, N, bang = 72, 105, 89, 111, 78, 33
  assert rows_of(pairs, 0, "chosen") == [
    [257, H, i, Y, o, 258, 256, 256],  # EOS is an input too, followed by PAD
    [H, i, Y, o, 258, 256, 256, 256],
    [0, 0, 1, 1, 1, 0, 0, 0],  # the first completion token is predicted from the prompt's last
  ]
  assert rows_of(pairs, 0, "rejected") == [
    [257, H, i, N, o, bang, 258, 256],
    [H, i, N, o, bang, 258, 256, 256],
    [0, 0, 1, 1, 1, 1, 0, 0],
  ]
  assert pairs.counts == pp.PairCounts(
    rows=1, prompt_truncated=0, completion_truncated=0, dropped=0
  )
  assert all(a.dtype == np.int32 and a.shape == (1, 8) for a in pairs.arrays.values())


def test_a_string_pair_on_a_folder_tokenizer_uses_its_bos_and_eos(tmp_path, tokenizer_files):
  from tokenizers import Tokenizer

  folder = llama3(tmp_path, tokenizer_files)
  theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
  ids = lambda text: theirs.encode(text, add_special_tokens=False).ids  # noqa: E731
  bos, eot = theirs.token_to_id("<|begin_of_text|>"), theirs.token_to_id("<|eot_id|>")
  path = write(tmp_path, [pair("The cat sat", " on the mat.", " in the park.")])
  pairs = pp.load_pairs(path, folder_tokenizer(folder), seq_len=24)
  prompt = [bos, *ids("The cat sat")]
  for side, text in (("chosen", " on the mat."), ("rejected", " in the park.")):
    expected = window([*prompt, *ids(text), eot], len(prompt), 24, pad=eot)  # pads with EOS
    assert rows_of(pairs, 0, side) == list(expected), side


@pytest.mark.parametrize(
  "maker,template,prompt_text,completions",
  [
    (
      qwen,
      CHATML,
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\n",
      ("Yo<|im_end|>\n", "No way<|im_end|>\n"),
    ),
    (
      llama3,
      LLAMA3_TEMPLATE,
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n",
      ("Yo<|eot_id|>", "No way<|eot_id|>"),
    ),
  ],
  ids=["chatml", "llama3"],
)
def test_a_conversation_is_the_templates_prompt_and_what_each_reply_adds(
  tmp_path, tokenizer_files, maker, template, prompt_text, completions
):
  from tokenizers import Tokenizer

  folder = maker(tmp_path, tokenizer_files, template=template)
  theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
  ids = lambda text: theirs.encode(text, add_special_tokens=False).ids  # noqa: E731 - specials as ids
  tok = folder_tokenizer(folder)
  pairs = pp.load_pairs(write(tmp_path, [pair(PROMPT, YO, NO)]), tok, seq_len=64)
  prompt = ids(prompt_text)
  for side, text in zip(pp.SIDES, completions, strict=True):
    tokens = [*prompt, *ids(text)]  # no EOS added: the template's end of turn ends the reply
    assert rows_of(pairs, 0, side) == list(window(tokens, len(prompt), 64, tok.PAD)), side
  assert pairs.arrays["chosen_inputs"][0].tolist().count(tok.bos_id) <= 1  # the template's only


def test_the_prompt_is_one_encoding_shared_by_both_sides(tmp_path, tokenizer_files):
  tok = folder_tokenizer(qwen(tmp_path, tokenizer_files, template=CHATML))
  rows = [pair(PROMPT, YO, NO), pair("A dog ran", " in the park.", " on the mat.")]
  pairs = pp.load_pairs(write(tmp_path, rows), tok, seq_len=48)
  for i, row in enumerate(pp.read_pairs(write(tmp_path, rows))):
    prompt = pp.encode_pair(row, tok)[0]
    for side in pp.SIDES:
      assert pairs.arrays[f"{side}_inputs"][i, : len(prompt)].tolist() == prompt.tolist()
      assert pairs.arrays[f"{side}_mask"][i, : len(prompt) - 1].sum() == 0
      assert pairs.arrays[f"{side}_mask"][i, len(prompt) - 1] == 1


def test_truncation_keeps_the_latest_prompt_and_the_start_of_completions(tmp_path):
  rows = [
    pair("abcdef", "xyz", "q"),  # prompt 7 tokens -> its last 3; chosen 4 -> 3 (no EOS)
    pair("", "x", "y"),  # BOS alone: nothing cut
  ]
  pairs = pp.load_pairs(write(tmp_path, rows), BYTES, seq_len=5, max_prompt_len=3)
  d, e, f, x, y, z, q = b"defxyzq"
  assert rows_of(pairs, 0, "chosen") == [[d, e, f, x, y], [e, f, x, y, z], [0, 0, 1, 1, 1]]
  assert rows_of(pairs, 0, "rejected") == [[d, e, f, q, 258], [e, f, q, 258, 256], [0, 0, 1, 1, 0]]
  assert rows_of(pairs, 1, "chosen") == [[257, x, 258, 256, 256], [x, 258, 256, 256, 256],
                                         [1, 1, 0, 0, 0]]  # fmt: skip
  assert pairs.counts == pp.PairCounts(
    rows=2, prompt_truncated=1, completion_truncated=1, dropped=0
  )


def test_a_pair_whose_completion_keeps_no_token_is_dropped_and_counted(tmp_path):
  rows = [
    pair("hello", "a", "b"),  # prompt 6 tokens = seq_len + 1: no room left
    pair("hi", "long answer", "c"),  # prompt 3: the chosen is cut to 3 tokens
    pair("", "a", "b"),
  ]
  pairs = pp.load_pairs(write(tmp_path, rows), BYTES, seq_len=5)
  assert len(pairs) == 2
  assert pairs.counts == pp.PairCounts(
    rows=3, prompt_truncated=0, completion_truncated=1, dropped=1
  )
  assert pairs.arrays["chosen_inputs"][0].tolist() == [257, *b"hilo"]
  assert pairs.arrays["chosen_targets"][1].tolist() == [*b"a", 258, 256, 256, 256]


def test_a_reply_that_renders_to_nothing_drops_its_pair(tmp_path, tokenizer_files):
  template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # an empty reply adds nothing
  tok = folder_tokenizer(qwen(tmp_path, tokenizer_files, template=template))
  empty = [{"role": "assistant", "content": ""}]
  rows = [pair(PROMPT, YO, empty), pair(PROMPT, YO, NO)]
  pairs = pp.load_pairs(write(tmp_path, rows), tok, seq_len=16)
  assert len(pairs) == 1 and pairs.counts.dropped == 1
  assert pairs.arrays["rejected_mask"][0].sum() == len(tok.encode_rendered("No way"))


def test_a_pair_whose_chosen_equals_its_rejected_is_dropped_and_counted(tmp_path):
  """Same text, or the same tokens once cut to seq_len: no preference (loss ln 2, grad 0)."""
  rows = [pair("hey", "same", "same"), pair("hey", "abX", "abY"), pair("hey", "yes", "no")]
  pairs = pp.load_pairs(write(tmp_path, rows), BYTES, seq_len=5)  # completions keep 2 tokens
  assert len(pairs) == 1 and pairs.arrays["chosen_targets"][0].tolist() == [*b"heyye"]
  assert pairs.counts == pp.PairCounts(
    rows=3, prompt_truncated=0, completion_truncated=1, dropped=2, identical=2
  )
  with pytest.raises(DataError, match=r"all 2 pairs were dropped: in 2 the chosen and rejected"):
    pp.load_pairs(write(tmp_path, rows[:2], "same.jsonl"), BYTES, seq_len=5)


def test_every_pair_dropped_is_an_error_naming_the_settings(tmp_path):
  path = write(tmp_path, [pair("hello", "a", "b"), pair("world!", "c", "d")])
  with pytest.raises(DataError, match=r"all 2 pairs were dropped.*raise seq_len") as e:
    pp.load_pairs(path, BYTES, seq_len=4)
  assert path in str(e.value) and "\n" not in str(e.value)
  assert len(pp.load_pairs(path, BYTES, seq_len=4, max_prompt_len=2)) == 2  # the way out


@pytest.mark.parametrize(
  "line,says",
  [
    ('{"prompt": "p", "chosen": "c"}', "no 'rejected' field"),
    ('{"chosen": "c", "rejected": "r"}', "no 'prompt' field"),
    ('{"prompt": 3, "chosen": "c", "rejected": "r"}', "prompt int"),
    ('{"prompt": [{"role": "user", "content": "p"}], "chosen": "c", "rejected": "r"}', "list"),
    ('{"prompt": [{"role": "user"}], "chosen": [], "rejected": []}', 'string "content"'),
    ('{"prompt": [{"role": "bot", "content": "p"}], "chosen": [], "rejected": []}', "'bot'"),
    ('{"prompt": [{"role": "user", "content": "p"}], "chosen": [], "rejected": []}', "empty list"),
    (
      '{"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "user", "content": '
      '"c"}], "rejected": [{"role": "assistant", "content": "r"}]}',
      'turns before the reply in "prompt"',
    ),
    ('["p", "c", "r"]', "expected a JSON object, got list"),
    ('{"prompt": "p", ', "malformed JSON"),
  ],
)
def test_a_bad_row_is_one_line_naming_its_file_and_line(tmp_path, line, says):
  path = write(tmp_path, [pair("p", "c", "r"), "\n", line + "\n"])  # line 3, after a blank
  with pytest.raises(DataError) as e:
    pp.read_pairs(path)
  assert str(e.value).startswith(f"{path}:3: ") and says in str(e.value), str(e.value)
  assert "\n" not in str(e.value)


def test_an_empty_file_and_bad_bytes_are_errors_naming_the_file(tmp_path):
  empty = write(tmp_path, ["\n"])
  with pytest.raises(DataError, match="holds no preference pairs") as e:
    pp.read_pairs(empty)
  assert empty in str(e.value)
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(json.dumps(pair("p", "c", "r")).encode() + b'\n{"prompt": "\xff"}\n')
  with pytest.raises(DataError, match=f"^{bad}:2: not UTF-8"):
    pp.read_pairs(str(bad))


def test_conversations_without_a_chat_template_say_what_to_do(tmp_path, tokenizer_files):
  path = write(tmp_path, [pair("p", "c", "r"), pair(PROMPT, YO, NO)])
  folder = qwen(tmp_path, tokenizer_files)  # no template
  with pytest.raises(DataError) as e:
    pp.load_pairs(path, folder_tokenizer(folder), seq_len=32)
  message = str(e.value)
  assert message.startswith(f"{path}:2: ") and f"model folder {folder} has none" in message
  assert "chat_template.jinja" in message and "as strings" in message and "\n" not in message
  with pytest.raises(DataError, match=f"^{path}:2: .*tokenizer byte has none"):
    pp.load_pairs(path, BYTES, seq_len=32)


def test_a_template_whose_prompt_is_not_a_prefix_is_refused_naming_the_row(
  tmp_path, tokenizer_files
):
  # this ChatML indents each turn, but not the generation prompt: the prompt's rendering is
  # not the start of the whole chat's
  tok = folder_tokenizer(qwen(tmp_path, tokenizer_files, template=CHATML_TEMPLATE))
  path = write(tmp_path, [pair(PROMPT, YO, NO)])
  with pytest.raises(DataError, match=f"^{path}:1: .*prompt \\+ chosen"):
    pp.load_pairs(path, tok, seq_len=64)


def test_lengths_are_checked():
  with pytest.raises(ConfigError, match="max_prompt_len"):
    pp.pair_set([], BYTES, seq_len=4, max_prompt_len=5)
  with pytest.raises(ConfigError, match="seq_len"):
    pp.pair_set([], BYTES, seq_len=0)


@pytest.fixture
def three(tmp_path):
  rows = [pair("a", "b", "c"), pair("dd", "e", "ff"), pair("g", "hhh", "i")]
  return pp.load_pairs(write(tmp_path, rows), BYTES, seq_len=6)


def test_pair_batch_pads_the_last_batch_with_zero_rows(three):
  batch = pp.pair_batch(three, [2, 0], batch_size=4)
  assert sorted(batch) == sorted([*pp.FIELDS, "pair_mask"])
  assert batch["pair_mask"].tolist() == [1, 1, 0, 0] and batch["pair_mask"].dtype == np.int32
  for name in pp.FIELDS:
    assert batch[name].shape == (4, 6) and batch[name].dtype == np.int32
    assert batch[name][:2].tolist() == three.arrays[name][[2, 0]].tolist()
    assert not batch[name][2:].any()
  with pytest.raises(BatchError, match="do not fit"):
    pp.pair_batch(three, [0, 1, 2], batch_size=2)
  with pytest.raises(BatchError, match="must lie in"):
    pp.pair_batch(three, [-1], batch_size=2)


def test_the_preference_loss_takes_a_batch(three):
  import jax
  import jax.numpy as jnp

  from jaxstep.core import preference

  assert pp.FIELDS == preference.PAIR_FIELDS
  batch = {k: jnp.asarray(v) for k, v in pp.pair_batch(three, [0, 1, 2], batch_size=4).items()}
  assert preference.check_pair_batch(batch, "simpo", has_reference=False) is False
  table = jax.random.normal(jax.random.key(0), (BYTES.vocab_size, BYTES.vocab_size))
  apply_fn = lambda params, inputs, *, rng, train: params[inputs]  # noqa: E731 - a bigram model
  loss_fn = preference.preference_loss(apply_fn, loss="simpo")
  total, aux = jax.jit(loss_fn)(table, batch, jax.random.key(1))
  assert np.isfinite(float(total)) and float(jax.jit(preference.pair_units)(batch)) == 3

  @jax.jit
  def chosen_logps(table, batch):
    logits = apply_fn(table, batch["chosen_inputs"], rng=None, train=False)
    return preference.sequence_logps(logits, batch["chosen_targets"], batch["chosen_mask"])

  # the summed log-probs cover exactly the completion tokens: chosen of pair 2 is "hhh" + EOS
  _, counts = chosen_logps(table, batch)
  assert counts.tolist() == [2, 2, 4, 0]


def test_a_global_batch_of_pairs_is_cut_to_the_bucket_that_holds_its_pairs(tmp_path):
  """``preference.length_buckets``: a global batch is cut to the shortest of ``seq_len·i/B``
  that holds every target its pairs mark; every masked target stays, only padding goes, and
  a process reading some rows of the batch cuts them to the whole batch's length."""
  from jaxstep import data
  from jaxstep.data.pair_dataset import PairSplit

  rows = [pair("q", "a" * n, "b" * (n + 1)) for n in (1, 2, 3, 30)]  # the last one is long
  pairs = pp.load_pairs(write(tmp_path, rows), BYTES, seq_len=64, max_prompt_len=4)
  whole = PairSplit(pairs, np.arange(4), buckets=1)
  cut = PairSplit(pairs, np.arange(4), buckets=4)
  for at, want in (([0, 1, 2], 16), ([0, 3], 48), ([3], 48), ([], 16)):
    index = np.asarray(at, np.int64)
    batch = data.dataset._cut(cut, index, cut.rows(index, 3, 0))
    full = whole.rows(index, 3, 0)
    assert batch["chosen_mask"].shape == (3, want)
    for name in pp.FIELDS:
      np.testing.assert_array_equal(batch[name], full[name][:, :want])
      if name.endswith("_mask"):  # nothing a loss reads is cut
        assert batch[name].sum() == full[name].sum()
    assert pp.used_length(pairs, index) <= want
  one = data.global_batch(cut, 0, 0, 0, 4, 0)
  two = data.global_batch(cut, 0, 0, 0, 4, 0, rows=np.array([0, 1]))
  assert one["chosen_mask"].shape[1] == two["chosen_mask"].shape[1] == 48


def test_the_cut_lengths_are_multiples_that_a_sequence_split_and_an_moe_capacity_allow():
  """Each length a multiple of 8 (of the tensor size too under sequence parallelism), and
  no cut at all for an MoE model whose experts' capacity counts the batch's positions."""
  from jaxstep.trainer.config import loading as config_lib
  from jaxstep.trainer.plan.preference_plan import cut_settings

  base = ["preference.loss=dpo", "train.seq_len=96"]
  assert cut_settings(config_lib.load(None, base)) == {
    "length_buckets": 4,
    "length_multiple": 8,
  }
  split = ["mesh.tensor=3", "mesh.sequence_parallel=true", "model.n_heads=3", "model.d_model=48"]
  assert cut_settings(config_lib.load(None, [*base, *split]))["length_multiple"] == 24
  moe = ["model.family=llama", "model.num_experts=4", "model.capacity_factor=1.0"]
  assert cut_settings(config_lib.load(None, [*base, *moe]))["length_buckets"] == 1
