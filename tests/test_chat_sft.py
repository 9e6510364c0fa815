"""Chat data for a model folder's tokenizer: rendered with the folder's own chat template,
tokens equal to transformers' ``apply_chat_template``, targets exactly its assistant masks;
a template that does not render turns incrementally is refused."""

import json

import numpy as np
import pytest
import test_hf_folder
from test_hf_folder import CHATML_TEMPLATE, LLAMA3_TEMPLATE, MESSAGES, llama3, qwen

from jaxstep import data
from jaxstep.data import samples
from jaxstep.data.hf_folder import folder_tokenizer
from jaxstep.errors import DataError

tokenizer_files = test_hf_folder.tokenizer_files  # the fixture: a BPE with ChatML's tokens

# ChatML as Qwen2.5 writes it (no tools), and the same with each assistant turn's content and
# <|im_end|> in a generation block, its newline outside (transformers' own ChatML example):
# the same text, marked.
CHATML = (
  "{% for message in messages %}{% if loop.first and message.role != 'system' %}"
  "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
  "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
  "{%- endfor %}{% if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
)
MARKED = CHATML.replace(
  "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
  "{{- '<|im_start|>' + message.role + '\\n' }}{% if message.role == 'assistant' %}"
  "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
  "{% else %}{{- message.content + '<|im_end|>' }}{% endif %}{{- '\\n' }}",
)
CHATS = [
  MESSAGES,  # ends with a user turn
  [*MESSAGES, {"role": "assistant", "content": " 6, naïve café. "}],  # two assistant turns
  [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],  # empty reply
]


def theirs(folder, monkeypatch):
  transformers = pytest.importorskip("transformers")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return transformers.AutoTokenizer.from_pretrained(str(folder))


def expected(hf, messages, template=MARKED):
  """transformers' ids and assistant masks for ``messages`` under ``template``."""
  out = hf.apply_chat_template(
    messages,
    chat_template=template,
    tokenize=True,
    return_dict=True,
    return_assistant_tokens_mask=True,
  )
  return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("template", [MARKED, CHATML], ids=["marked", "unmarked"])
def test_chatml_tokens_and_flags_equal_transformers_assistant_masks(
  tmp_path, tokenizer_files, monkeypatch, messages, template
):
  folder = qwen(tmp_path, tokenizer_files, template=template)
  hf, tok = theirs(folder, monkeypatch), folder_tokenizer(folder)
  assert tok.chat_template == template
  rendered = hf.apply_chat_template(messages, tokenize=False)
  assert rendered == hf.apply_chat_template(messages, tokenize=False, chat_template=MARKED)
  ids, masks = expected(hf, messages)  # the marked template's masks, for both
  assert sum(masks) > 0 or messages[-1]["content"] == ""
  tokens, flags = samples.encode_chat(messages, tok)
  assert tokens.dtype == np.int32 and flags.dtype == np.int8
  assert tokens.tolist() == ids == list(hf.apply_chat_template(messages)["input_ids"])
  assert flags.tolist() == masks
  # the flagged text: each reply and its <|im_end|>, never the newline after it
  flagged = hf.decode([t for t, f in zip(ids, masks, strict=True) if f])
  replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
  assert flagged == "".join(replies)


def test_llama3_template_writes_its_one_bos_and_flags_reply_and_eot(
  tmp_path, tokenizer_files, monkeypatch
):
  folder = llama3(tmp_path, tokenizer_files, template=LLAMA3_TEMPLATE)
  hf, tok = theirs(folder, monkeypatch), folder_tokenizer(folder)
  assert tok.has_bos  # the tokenizer would prepend it; the template writes it itself
  messages = CHATS[1]
  tokens, flags = samples.encode_chat(messages, tok)
  assert tokens.tolist() == list(hf.apply_chat_template(messages)["input_ids"])
  assert tokens[0] == tok.BOS and tokens.tolist().count(tok.BOS) == 1
  assert flags[0] == 0
  flagged = hf.decode(tokens[flags == 1].tolist())
  assert flagged == "4.<|eot_id|>6, naïve café.<|eot_id|>"  # the template trims replies


def test_a_document_start_is_never_a_target(tmp_path, tokenizer_files):
  """A template that writes nothing before an opening assistant turn: its first token is
  still not flagged (packed, it would be predicted from the previous document's end)."""
  template = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
  tok = folder_tokenizer(qwen(tmp_path, tokenizer_files, template=template))
  tokens, flags = samples.encode_chat([{"role": "assistant", "content": "The cat sat."}], tok)
  assert len(tokens) > 1 and flags[0] == 0 and flags[1:].all()


def test_bundled_tokenizers_keep_the_role_format(tmp_path, tokenizer_files):
  tok = folder_tokenizer(qwen(tmp_path, tokenizer_files))  # a folder without a template
  assert tok.chat_template is None
  tokens, flags = samples.encode_chat(MESSAGES[:3], tok)
  assert tokens[0] == tok.BOS and tok.decode(tokens[flags == 1]) == "4."
  assert tokens[flags == 1][-1] == tok.EOS


def test_prepared_chat_data_masks_exactly_the_assistant_tokens(
  tmp_path, tokenizer_files, monkeypatch
):
  folder = qwen(tmp_path, tokenizer_files, template=CHATML)
  hf = theirs(folder, monkeypatch)
  chat = tmp_path / "chat.jsonl"
  chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS[:2]))
  out = tmp_path / "prepared"
  data.prepare([str(chat)], out, tokenizer=str(folder), fmt="chat", eval_fraction=0.0)
  assert (out / "tokenizer" / "chat_template.jinja").is_file()
  ids, masks = expected(hf, CHATS[0])
  cfg = data.DataConfig(path=str(out), format="chat", pack=False)
  first = data.load_dataset(cfg, seq_len=len(ids) + 7).train.rows(np.array([0]), 1, 0)
  assert first["inputs"][0, : len(ids)].tolist() == ids
  assert first["loss_mask"][0].tolist() == [*masks[1:], *[0] * 8]  # flags[1:], then padding


@pytest.mark.parametrize("template", [CHATML, MARKED], ids=["unmarked", "marked"])
def test_a_template_refusing_a_chat_is_a_data_error(tmp_path, tokenizer_files, template):
  refuse = "{% if messages[0].role == 'assistant' %}{{ raise_exception('starts with a reply') }}"
  folder = qwen(tmp_path, tokenizer_files, template=refuse + "{% endif %}" + template)
  with pytest.raises(DataError, match="chat template: TemplateError: starts with a reply"):
    samples.encode_chat([{"role": "assistant", "content": "x"}], folder_tokenizer(folder))


# As Qwen3 drops the reasoning of assistant turns before the last user message.
DROPS_PAST_REASONING = (
  "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}"
  "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
  "<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.index0 > ns.last %}"
  "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
  "template",
  [DROPS_PAST_REASONING, CHATML_TEMPLATE],  # the latter indents turns, not its prompt
  ids=["rewrites-past-turns", "prompt-unlike-turn"],
)
def test_a_template_that_does_not_render_incrementally_is_one_data_error(
  tmp_path, tokenizer_files, template
):
  """The rendering before an assistant turn (with the generation prompt) or through it is
  not a prefix of the whole chat's: its tokens cannot be told, and nothing is guessed."""
  tok = folder_tokenizer(qwen(tmp_path, tokenizer_files, template=template))
  reply = {"role": "assistant", "content": "4.", "reasoning_content": "2 + 2"}
  messages = [*MESSAGES[:2], reply, MESSAGES[3]]
  with pytest.raises(DataError, match="does not render turns incrementally") as e:
    samples.encode_chat(messages, tok)
  assert "\n" not in str(e.value) and "before message 3 " in str(e.value)
  if template is DROPS_PAST_REASONING:
    samples.encode_chat(messages[:3], tok)  # ending on that turn, it renders incrementally


def test_a_sentencepiece_folder_flags_the_pieces_of_its_replies(tmp_path):
  """A folder with only a ``tokenizer.model``: the rendering is encoded as
  ``encode_rendered`` encodes it, and SentencePiece's byte offsets map the replies' text to
  pieces."""
  import sentencepiece

  (tmp_path / "corpus.txt").write_text("\n".join(test_hf_folder.SENTENCES * 20))
  sentencepiece.SentencePieceTrainer.train(
    input=str(tmp_path / "corpus.txt"),
    model_prefix=str(tmp_path / "tokenizer"),
    vocab_size=50,
    minloglevel=2,
  )
  template = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} "
    "[/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
  )
  config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tok = folder_tokenizer(tmp_path)
  messages = [
    {"role": "user", "content": "Héllo, the cat"},
    {"role": "assistant", "content": "naïve café"},
    {"role": "user", "content": "dog"},
    {"role": "assistant", "content": "the park"},
  ]
  tokens, flags = samples.encode_chat(messages, tok)
  rendered = "<s>[INST] Héllo, the cat [/INST]naïve café</s>[INST] dog [/INST]the park</s>"
  assert tokens.tolist() == tok.encode_rendered(rendered).tolist()
  replies = np.split(tokens, np.flatnonzero(np.diff(flags)) + 1)[1::2]
  assert [tok.decode(r) for r in replies] == ["naïve café", "the park"]
  assert [r[-1] for r in replies] == [tok.EOS, tok.EOS]
