"""The byte tokenizer written as a Hugging Face tokenizer: what an export of a run on bytes
puts beside its weights, so that the folder is a model folder like any other — transformers'
``AutoTokenizer`` and jaxstep's ``model.init_from`` read the same ids the run trained on.

``tokenizer.json`` (the ``tokenizers`` library's format): byte-level, each byte one token
with the byte's value as its id (a BPE without merges over GPT-2's byte-to-character
table), then ``<pad>`` 256, ``<s>`` 257 (BOS) and ``</s>`` 258 (EOS), and a post-processor
that starts every text with ``<s>``, as the run's documents start. ``tokenizer_config.json``
names the three special tokens and ``add_bos_token``.
"""

from __future__ import annotations

import json
import pathlib

from jaxstep.data.tokenizer import ByteTokenizer

SPECIALS = {"<pad>": ByteTokenizer.PAD, "<s>": ByteTokenizer.BOS, "</s>": ByteTokenizer.EOS}


def byte_to_char() -> dict[int, str]:
  """GPT-2's table from each byte to a printable character (what ``ByteLevel`` maps bytes
  to before a vocabulary is looked up): printable Latin-1 bytes keep their character, the
  others get 256 + n in order."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
  keep += range(ord("®"), ord("ÿ") + 1)
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def write_byte_tokenizer(folder: str | pathlib.Path) -> list[pathlib.Path]:
  """Writes ``tokenizer.json`` and ``tokenizer_config.json`` of the byte tokenizer into
  ``folder``; returns their paths."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

  vocab = {char: b for b, char in byte_to_char().items()}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(name, special=True) for name in SPECIALS])
  tok.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ByteTokenizer.BOS)]
  )
  folder = pathlib.Path(folder)
  tok.save(str(folder / "tokenizer.json"))
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "add_bos_token": True,
    "clean_up_tokenization_spaces": False,
  }
  (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return [folder / "tokenizer.json", folder / "tokenizer_config.json"]
