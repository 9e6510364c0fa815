"""An RL run's prompts: a JSONL file whose rows hold a ``"prompt"`` — a string, or a message
list rendered with the tokenizer's chat template and its generation prompt — and any other
columns, which the reward functions receive by name (e.g. ``"answer"``).

A string prompt is encoded as a generation prompt is (``BOS`` + its tokens, no BOS for a
model folder whose texts start without one); a prompt longer than ``max_prompt_len`` tokens
keeps its last ones and is counted. The held-out share (``eval_fraction``) is chosen by a
fixed hash of each row's place, as for pairs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib

import numpy as np

from jaxstep.data import chat_template, readers, row_files
from jaxstep.data.tokenizer_loading import load_tokenizer
from jaxstep.errors import DataError

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """Prompts in file order: ``ids`` (int32 each), ``texts`` (what the rewards see: the
  string, or the rendered chat), the other ``columns`` by name (a list each)."""

  ids: list[np.ndarray]
  texts: list[str]
  columns: dict[str, list]
  truncated: int = 0

  def __len__(self) -> int:
    return len(self.ids)

  def take(self, index) -> PromptSet:
    index = [int(i) for i in index]
    columns = {k: [v[i] for i in index] for k, v in self.columns.items()}
    return PromptSet([self.ids[i] for i in index], [self.texts[i] for i in index], columns)


@dataclasses.dataclass(frozen=True)
class PromptDataset:
  """What an RL run reads: ``train`` and ``eval`` (None without held-out prompts)."""

  train: PromptSet
  eval: PromptSet | None
  fingerprint: str
  pad_id: int
  vocab_size: int
  tokenizer_spec: str
  tokenizer: object = dataclasses.field(repr=False, compare=False)
  kind: str = "prompts"
  source_evals: dict = dataclasses.field(default_factory=dict)

  def tokenizer_files(self) -> list[pathlib.Path]:
    """The files that carry the tokenizer: what a run dir keeps a copy of."""
    return row_files.tokenizer_files(self.tokenizer_spec)


def read_prompts(path: str, tok, *, max_prompt_len: int) -> PromptSet:
  """Every row of ``path`` (a JSONL file, folder, glob or bundled set), encoded.

  Raises:
    DataError: a malformed line, a row without a string or message-list ``"prompt"``,
      columns that differ between rows, conversational rows without a chat template.
  """
  prompts = _collect(_file_rows(path), tok, max_prompt_len)
  if not prompts.ids:
    raise DataError(f"{path} holds no prompts")
  return prompts


def prompt_set(rows, tok, *, max_prompt_len: int = 0) -> PromptSet:
  """Prompts from rows in memory, each a dict as a JSONL line holds (``"prompt"`` and the
  columns the rewards read), encoded with ``tok``; ``max_prompt_len`` 0: no truncation.

  Raises:
    DataError: as ``read_prompts``, naming the row by its index.
  """
  prompts = _collect(((f"row {i}", r) for i, r in enumerate(rows)), tok, max_prompt_len)
  if not prompts.ids:
    raise DataError("no prompts given")
  return prompts


def _file_rows(path: str):
  for file in readers.list_files(path, "jsonl"):
    for number, line in enumerate(file.read_text().splitlines(), 1):
      if not line.strip():
        continue
      where = f"{file.name}:{number}"
      try:
        yield where, json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg})") from None


def _collect(rows, tok, max_prompt_len: int) -> PromptSet:
  ids, texts, columns, truncated = [], [], None, 0
  for where, record in rows:
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str | list):
      raise DataError(f'{where}: a row needs a "prompt": a string or a list of messages')
    rest = {k: v for k, v in record.items() if k != "prompt"}
    if columns is None:
      columns = {k: [] for k in rest}
    if set(rest) != set(columns):
      raise DataError(f"{where}: columns {sorted(rest)}; earlier rows have {sorted(columns)}")
    text, encoded = _encode(record["prompt"], tok, where)
    if max_prompt_len and len(encoded) > max_prompt_len:
      encoded, truncated = encoded[len(encoded) - max_prompt_len :], truncated + 1
    ids.append(encoded)
    texts.append(text)
    for k, v in rest.items():
      columns[k].append(v)
  return PromptSet(ids, texts, columns or {}, truncated)


def _encode(prompt, tok, where: str) -> tuple[str, np.ndarray]:
  if isinstance(prompt, str):
    if not prompt:
      raise DataError(f'{where}: "prompt" is empty')
    body = tok.encode(prompt)
    start = [] if not getattr(tok, "has_bos", True) else [tok.BOS]
    return prompt, np.concatenate([start, body]).astype(np.int32)
  template = getattr(tok, "chat_template", None)
  if template is None:
    raise DataError(
      f"{where}: a conversational prompt is rendered with a model folder's chat template; "
      f"the tokenizer has none (use a model folder with one, or write the prompt as a string)"
    )
  try:
    text = chat_template.render_chat(
      template, prompt, add_generation_prompt=True, **tok.template_tokens
    )
  except DataError as e:
    raise DataError(f"{where}: {e}") from None
  return text, tok.encode_rendered(text).astype(np.int32)


def load_prompt_dataset(
  path: str, tokenizer: str, *, max_prompt_len: int, eval_fraction: float
) -> PromptDataset:
  """The prompts of ``path`` encoded with ``tokenizer``, ``eval_fraction`` held out."""
  tok = load_tokenizer(tokenizer)
  prompts = read_prompts(path, tok, max_prompt_len=max_prompt_len)
  held = row_files.held_out(len(prompts), eval_fraction)
  log.info(
    "RL prompts: %d read, %d held out, %d truncated to their last %d tokens",
    len(prompts),
    int(held.sum()),
    prompts.truncated,
    max_prompt_len,
  )
  settings = {"tokenizer": tok.describe(), "max_prompt_len": max_prompt_len}
  digest = row_files.fingerprint(path, tokenizer, {**settings, "eval_fraction": eval_fraction})
  return PromptDataset(
    train=prompts.take(np.flatnonzero(~held)),
    eval=prompts.take(np.flatnonzero(held)) if held.any() else None,
    fingerprint=digest,
    pad_id=tok.PAD,
    vocab_size=tok.vocab_size,
    tokenizer_spec=tokenizer,
    tokenizer=tok,
  )
