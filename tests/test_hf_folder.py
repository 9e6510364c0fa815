"""A pretrained model folder's tokenizer, special ids and chat template, on folders built
here (a small BPE trained on a few sentences, configs written in the layouts found on the
Hub), checked against transformers where it is installed."""

import json
import re
import shutil

import pytest

from jaxstep.data.hf_folder import chat_template, folder_tokenizer, render_chat
from jaxstep.errors import DataError

SPECIALS = [
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eot_id|>",
  "<|im_start|>",
  "<|im_end|>",
  "<|endoftext|>",
]
SENTENCES = [
  "The cat sat on the mat.",
  "A dog ran in the park, and the cat watched it.",
  "Héllo wörld: naïve café, 12 + 30 = 42!",
  "  leading spaces\tand tabs\nand new lines",
]
LLAMA3_TEMPLATE = (
  "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
  "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
  "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
  "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
  "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# ChatML as Qwen writes it, with indented block tags (trim_blocks/lstrip_blocks matter),
# a namespace, tojson and raise_exception.
CHATML_TEMPLATE = """{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {% endif %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message.role) }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    <|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{% if meta is defined %}{{ meta | tojson }}
{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
MESSAGES = [
  {"role": "system", "content": "You are terse."},
  {"role": "user", "content": "  What is 2 + 2? <b>bold</b> "},
  {"role": "assistant", "content": "4."},
  {"role": "user", "content": "And naïve 3 + 3?"},
]


def random_chat_folder(path, config_class: str, settings: dict, tokenizer_file):
  """A tiny random transformers model (``config_class`` with ``settings``; every weight
  drawn at random, norms too) saved at ``path`` with ``tokenizer_file`` (a
  ``tokenizer_files`` entry), ChatML's special tokens and template. Returns ``path``."""
  import torch
  import transformers

  cfg = getattr(transformers, config_class)(**settings)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  model.eval().save_pretrained(path)
  shutil.copy(tokenizer_file, path / "tokenizer.json")
  specials = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
  (path / "tokenizer_config.json").write_text(json.dumps(specials))
  (path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
  return path


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
  """``{"plain", "llama3"}`` → a tokenizer.json: a byte-level BPE with the special tokens;
  ``llama3``'s post-processor prepends ``<|begin_of_text|>``, as Llama 3's does."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=320,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
  out = tmp_path_factory.mktemp("tokenizers")
  tok.save(str(out / "plain.json"))
  bos = ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))
  tok.post_processor = processors.TemplateProcessing(
    single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[bos]
  )
  tok.save(str(out / "llama3.json"))
  return {"plain": out / "plain.json", "llama3": out / "llama3.json"}


def make_folder(path, tokenizer_file, config, generation=None, template=None, layout="jinja"):
  """A model folder: tokenizer.json, tokenizer_config.json, maybe generation_config.json and
  a chat template (``chat_template.jinja``, or inside the config: ``"string"``/``"list"``)."""
  path.mkdir(parents=True, exist_ok=True)
  shutil.copy(tokenizer_file, path / "tokenizer.json")
  config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
  if template is not None and layout == "jinja":
    (path / "chat_template.jinja").write_text(template)
  elif template is not None:
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    config["chat_template"] = template if layout == "string" else named
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  if generation is not None:
    (path / "generation_config.json").write_text(json.dumps(generation))
  return path


def llama3(tmp_path, files, **kw):
  config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
  return make_folder(tmp_path / "llama3", files["llama3"], config, {"eos_token_id": [1, 4]}, **kw)


def qwen(tmp_path, files, **kw):
  config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
  return make_folder(tmp_path / "qwen", files["plain"], config, {"eos_token_id": [6, 7]}, **kw)


def test_llama3_like_folder_starts_with_its_bos_and_pads_with_eos(tmp_path, tokenizer_files):
  tok = folder_tokenizer(llama3(tmp_path, tokenizer_files))
  ids = {t: tok._tok.token_to_id(t) for t in SPECIALS}
  assert (tok.bos_id, tok.BOS, tok.EOS) == (ids["<|begin_of_text|>"], 0, ids["<|eot_id|>"])
  assert tok.has_bos and tok.PAD == tok.EOS  # no pad_token declared
  assert tok.stop_ids == [ids["<|eot_id|>"], ids["<|end_of_text|>"]]
  assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)  # nothing added
  assert 0 not in tok.encode("The cat sat.")  # encode adds no BOS of its own
  entry = tok.describe()
  assert entry["kind"] == "hf-folder tokenizer.json" and entry["file"] == "tokenizer.json"
  assert sorted(entry["folder_files"]) == [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
  ]
  assert json.loads(json.dumps(entry)) == entry  # a manifest entry read back compares equal


def test_qwen_like_folder_has_no_bos_and_starts_documents_with_eos(tmp_path, tokenizer_files):
  tok = folder_tokenizer(qwen(tmp_path, tokenizer_files))
  assert tok.bos_id is None and not tok.has_bos and tok.BOS == tok.EOS == 6  # <|im_end|>
  assert tok.PAD == 7 and tok.stop_ids == [6, 7]  # <|endoftext|>
  assert tok.template_tokens["bos_token"] is None


@pytest.mark.parametrize("add_bos, has_bos", [(None, False), (True, True)])
def test_smollm_like_folder_with_bos_equal_to_eos(tmp_path, tokenizer_files, add_bos, has_bos):
  """bos = eos = ``<|endoftext|>`` (as AddedToken dicts); the tokenizer prepends it only
  when the config's ``add_bos_token`` says so."""
  added = {"content": "<|endoftext|>", "lstrip": False, "special": True}
  config = {"bos_token": added, "eos_token": added, "add_bos_token": add_bos}
  tok = folder_tokenizer(make_folder(tmp_path / "smol", tokenizer_files["plain"], config))
  assert (tok.bos_id, tok.BOS, tok.EOS, tok.PAD, tok.has_bos) == (7, 7, 7, 7, has_bos)
  assert tok.stop_ids == [7]


def test_pad_falls_back_to_eos_and_eos_to_generation_config(tmp_path, tokenizer_files):
  folder = make_folder(tmp_path / "f", tokenizer_files["plain"], {}, {"eos_token_id": 4})
  tok = folder_tokenizer(folder)
  assert tok.EOS == tok.PAD == tok.BOS == 4 and tok.bos_id is None


@pytest.mark.parametrize(
  "config, generation, named",
  [
    ({"eos_token": "<|missing|>"}, None, "'<|missing|>'"),
    ({"bos_token": {"content": "<bos>"}, "eos_token": "<|im_end|>"}, None, "'<bos>'"),
    ({"eos_token": "<|im_end|>", "pad_token": "<pad>"}, None, "'<pad>'"),
    ({"eos_token": "<|im_end|>"}, {"eos_token_id": [6, 100000]}, "100000"),
    ({}, None, "declares no eos_token"),
  ],
)
def test_a_token_the_vocabulary_lacks_is_refused_by_name(
  tmp_path, tokenizer_files, config, generation, named
):
  folder = make_folder(tmp_path / "f", tokenizer_files["plain"], config, generation)
  with pytest.raises(DataError, match=re.escape(named)):
    folder_tokenizer(folder)


def test_a_folder_without_a_tokenizer_is_a_clear_error(tmp_path):
  with pytest.raises(DataError, match="neither tokenizer.json nor tokenizer.model"):
    folder_tokenizer(tmp_path)


def test_sentencepiece_folder_uses_its_pieces_and_adds_none(tmp_path):
  import sentencepiece

  (tmp_path / "corpus.txt").write_text("\n".join(SENTENCES * 20))
  sentencepiece.SentencePieceTrainer.train(
    input=str(tmp_path / "corpus.txt"),
    model_prefix=str(tmp_path / "tokenizer"),
    vocab_size=50,
    minloglevel=2,
  )
  config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tok = folder_tokenizer(tmp_path)
  assert (tok.BOS, tok.EOS, tok.PAD, tok.has_bos, tok.vocab_size) == (1, 2, 2, True, 50)
  assert tok.decode(tok.encode("the cat sat")) == "the cat sat"
  rendered = tok.encode_rendered("<s>the cat</s>sat</s>").tolist()
  assert rendered == [1, *tok.encode("the cat").tolist(), 2, *tok.encode("sat").tolist(), 2]
  assert 2 not in tok.encode("the cat</s>").tolist()  # plain encode: text stays text
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  with pytest.raises(DataError, match=re.escape("<|im_end|>")):
    folder_tokenizer(tmp_path)


def test_both_template_layouts_give_the_same_template(tmp_path, tokenizer_files):
  found = {
    layout: chat_template(
      qwen(tmp_path / layout, tokenizer_files, template=CHATML_TEMPLATE, layout=layout)
    )  # fmt: skip
    for layout in ("jinja", "string", "list")
  }
  assert found == dict.fromkeys(found, CHATML_TEMPLATE)
  assert chat_template(qwen(tmp_path / "none", tokenizer_files)) is None


def test_render_chat_refusals_are_data_errors():
  with pytest.raises(DataError, match="unknown role tool"):
    render_chat(CHATML_TEMPLATE, [{"role": "tool", "content": "x"}], bos_token=None, eos_token="")
  with pytest.raises(DataError, match="TemplateSyntaxError"):
    render_chat("{% if %}", [], bos_token=None, eos_token="")


CHAT = [
  {"role": "user", "content": "hi"},
  {"role": "assistant", "content": "hello"},
  {"role": "tool", "content": "42"},
]


@pytest.mark.parametrize(
  "template, named",
  [
    (CHATML_TEMPLATE, "TemplateError: unknown role tool (at message 2, role 'tool')"),
    ("{{ 1 // 0 }}", "ZeroDivisionError: integer division or modulo by zero"),
    (
      "{{ messages | no_such_filter }}",
      "TemplateAssertionError: No filter named 'no_such_filter'.",
    ),
    (
      "{% for m in messages %}{{ m.content / 2 }}{% endfor %}",
      "TypeError: unsupported operand type(s) for /: 'str' and 'int' (at message 0, role 'user')",
    ),
  ],
)
def test_a_template_that_fails_while_rendering_says_why_and_where(template, named):
  """Whatever the template raises is one DataError: its own message, and the first message
  at which the conversation fails to render (none for a template broken without one)."""
  with pytest.raises(DataError) as refused:
    render_chat(template, CHAT, bos_token=None, eos_token="")
  assert str(refused.value) == f"chat template: {named}"


def test_render_chat_leaves_unset_tokens_undefined_and_supports_generation_tags():
  template = "{{ bos_token }}|{{ pad_token is defined }}|{% generation %}{{ x }}{% endgeneration %}"
  assert render_chat(template, [], bos_token=None, eos_token="e", pad_token=None, x=3) == "|False|3"


def transformers_tokenizer(folder, monkeypatch):
  transformers = pytest.importorskip("transformers")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


@pytest.mark.parametrize("make, template", [(llama3, LLAMA3_TEMPLATE), (qwen, CHATML_TEMPLATE)])
@pytest.mark.parametrize("layout", ["jinja", "list"])
def test_render_chat_equals_transformers_apply_chat_template(
  tmp_path, tokenizer_files, monkeypatch, make, template, layout
):
  folder = make(tmp_path, tokenizer_files, template=template, layout=layout)
  theirs = transformers_tokenizer(folder, monkeypatch)
  tok = folder_tokenizer(folder)
  assert (theirs.bos_token_id, theirs.eos_token_id) == (tok.bos_id, tok.EOS)
  for messages in (MESSAGES, MESSAGES[1:]):
    for prompt in (False, True):
      ours = render_chat(
        chat_template(folder), messages, add_generation_prompt=prompt, **tok.template_tokens
      )
      expected = theirs.apply_chat_template(
        messages, tokenize=False, chat_template=template, add_generation_prompt=prompt
      )
      assert ours == expected
      tokens = theirs.apply_chat_template(
        messages, tokenize=True, chat_template=template, add_generation_prompt=prompt
      )
      tokens = tokens if isinstance(tokens, list) else tokens["input_ids"]
      assert tok.encode_rendered(ours).tolist() == list(tokens)
  extra = {"meta": {"q": "<naïve & 'x'>"}}
  ours = render_chat(template, MESSAGES, **tok.template_tokens, **extra)
  assert ours == theirs.apply_chat_template(MESSAGES, tokenize=False, **extra)


@pytest.mark.parametrize("make", [llama3, qwen])
def test_encode_equals_transformers_without_special_tokens(
  tmp_path, tokenizer_files, monkeypatch, make
):
  folder = make(tmp_path, tokenizer_files)
  theirs, tok = transformers_tokenizer(folder, monkeypatch), folder_tokenizer(folder)
  texts = [*SENTENCES, "unseen words: zebra quux 日本語 🙂", ""]
  for text in texts:
    assert tok.encode(text).tolist() == theirs(text, add_special_tokens=False).input_ids
  assert [t.tolist() for t in tok.encode_batch(texts)] == [
    theirs(t, add_special_tokens=False).input_ids for t in texts
  ]
  assert len(theirs) == tok.vocab_size
