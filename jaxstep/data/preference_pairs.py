"""Preference pairs (DPO-style): a JSONL file of ``(prompt, chosen, rejected)`` rows → the
batch fields ``jaxstep.core.preference`` documents, one row per pair.

**Rows**, in the two shapes TRL's preference datasets have (other columns are ignored):

- strings: ``{"prompt": str, "chosen": str, "rejected": str}``;
- conversations: ``"prompt"`` a list of ``{"role", "content"}`` messages, ``"chosen"`` and
  ``"rejected"`` lists of the assistant's messages (the reply only).

**Tokens.** The prompt is encoded once and shared by both sides, so the two sequences of a
pair differ only where their completions do. Strings are framed as ``samples.encode_text``
frames a document: prompt ``BOS + encode(prompt)``, completion ``encode(completion) + EOS``
(the end is learned). Conversations are rendered with the tokenizer's chat template
(``chat_template.render_chat``, transformers' ``apply_chat_template``): the prompt with the
generation prompt, the completion the text the whole chat's rendering adds after it (its
end-of-turn token included, as TRL takes it), each read by ``encode_rendered`` (special
tokens as their ids, the template's own BOS if it writes one, and no other).

**Lengths**, explicit: ``max_prompt_len`` keeps a prompt's LAST tokens (the most recent
context); ``seq_len`` is the input length S, so prompt + completion ≤ S + 1 tokens, the
completion cut at its end. A pair whose chosen or rejected completion keeps no token is
dropped (a real pair needs a completion token on each side), and counted; so is a pair
whose chosen and rejected keep the same tokens: it states no preference (its loss is ln 2
whatever the model, its gradient 0), and a file of them would train on nothing.

**Arrays.** Per side, a window of S + 1 tokens right-padded with PAD (as ``shards.Windows``
cuts them): ``inputs = window[:-1]``, ``targets = window[1:]``, ``mask`` 1 where the target
is a completion token, so the first completion token is predicted from the last prompt
token. Both sides have S columns, so a batch stacks them into one forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np

from jaxstep.data import chat_template, readers
from jaxstep.errors import BatchError, ConfigError, DataError

KEYS = ("prompt", "chosen", "rejected")
SIDES = ("chosen", "rejected")
# the same names and order as jaxstep.core.preference.PAIR_FIELDS (data may not import core)
FIELDS = tuple(f"{side}_{part}" for side in SIDES for part in ("inputs", "targets", "mask"))
SHAPES = 'each row is {"prompt", "chosen", "rejected"}: all strings, or all lists of messages'


@dataclasses.dataclass(frozen=True)
class PairRow:
  """One JSONL row: where it is (``file``, 1-based ``line``) and its three values, all
  strings or all message lists (``conversational``)."""

  file: pathlib.Path
  line: int
  prompt: str | list[dict]
  chosen: str | list[dict]
  rejected: str | list[dict]

  @property
  def where(self) -> str:
    """``file:line``, how every error about the row starts."""
    return f"{self.file}:{self.line}"

  @property
  def conversational(self) -> bool:
    return isinstance(self.prompt, list)


@dataclasses.dataclass(frozen=True)
class PairCounts:
  """What reading did: ``rows`` read; of the pairs kept, ``prompt_truncated`` (the prompt
  lost its oldest tokens) and ``completion_truncated`` (chosen or rejected lost its end);
  ``dropped``: pairs left out, because a completion kept no token or, ``identical`` of
  them, because chosen and rejected kept the same tokens."""

  rows: int
  prompt_truncated: int
  completion_truncated: int
  dropped: int
  identical: int = 0


@dataclasses.dataclass(frozen=True)
class PairSet:
  """The kept pairs: ``arrays`` maps each of ``FIELDS`` to ``int32[N, seq_len]``; and the
  ``counts`` that say what truncation did to them."""

  arrays: dict[str, np.ndarray]
  counts: PairCounts
  seq_len: int
  # the reference's summed log-probs of each pair's (chosen, rejected): float32[N, 2], when
  # precomputed (``preference.reference: precompute``); batches then carry them
  ref_logps: np.ndarray | None = None

  def __len__(self) -> int:
    return len(self.arrays[FIELDS[0]])


# -- reading ------------------------------------------------------------------------------


def read_pairs(path: str) -> list[PairRow]:
  """Every row of the JSONL file ``path`` (or of a folder's or glob's ``.jsonl`` files, as
  ``readers.list_files`` finds them), checked.

  Raises:
    DataError: a missing path, an empty file, a malformed line or a row of the wrong shape,
      naming the file and line and what to change.
  """
  rows = []
  for file in readers.list_files(path, "jsonl"):
    with contextlib.closing(_records(file)) as records:  # a bad row closes the file too
      rows += [pair_row(record, file, number) for number, record in records]
  if not rows:
    raise DataError(f"{path} holds no preference pairs (it is empty); {SHAPES}, one a line")
  return rows


def _records(file: pathlib.Path) -> Iterator[tuple[int, object]]:
  """``(line number, parsed JSON)`` per non-blank line; each line decoded on its own, so a
  bad byte is reported at its line."""
  with file.open("rb") as f:
    for number, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{file}:{number}: not UTF-8 text ({e.reason})") from None
      if not line.strip():
        continue
      try:
        yield number, json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{file}:{number}: malformed JSON ({e.msg})") from None


def pair_row(record, file: pathlib.Path, number: int) -> PairRow:
  """``record`` (a parsed line) as a ``PairRow``, its shape checked; other keys ignored.

  Raises:
    DataError: not an object, a key missing, mixed or wrong types, a bad message.
  """
  where = f"{file}:{number}"
  if not isinstance(record, dict):
    raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}; {SHAPES}")
  missing = [key for key in KEYS if key not in record]
  if missing:
    raise DataError(f"{where}: no {' or '.join(map(repr, missing))} field; {SHAPES}")
  values = [record[key] for key in KEYS]
  if all(isinstance(v, list) for v in values):
    for key, value in zip(KEYS, values, strict=True):
      _check_messages(key, value, where)
  elif not all(isinstance(v, str) for v in values):
    types = ", ".join(f"{k} {type(v).__name__}" for k, v in zip(KEYS, values, strict=True))
    raise DataError(f"{where}: got {types}; {SHAPES}")
  return PairRow(file, number, *values)


def _check_messages(key: str, messages: list, where: str) -> None:
  """A non-empty list of ``{"role", "content": str}``; chosen and rejected hold the
  assistant's reply only (the conversation before it belongs in the prompt)."""
  if not messages:
    raise DataError(f'{where}: "{key}" is an empty list; it needs at least one message')
  roles = readers.ROLES if key == "prompt" else ("assistant",)
  for m in messages:
    if not isinstance(m, dict) or not isinstance(m.get("content"), str):
      raise DataError(
        f'{where}: each message of "{key}" needs a string "content" (and a "role"), got {m!r:.80}'
      )
    if m.get("role") not in roles:
      hint = ' (put the turns before the reply in "prompt")' if key != "prompt" else ""
      raise DataError(
        f'{where}: "{key}" messages take a role in {roles}, got {m.get("role")!r}{hint}'
      )


# -- encoding -----------------------------------------------------------------------------


def encode_pair(row: PairRow, tok) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The row's prompt, chosen and rejected tokens (int32), untruncated (module docstring).

  Raises:
    DataError: conversational rows and a tokenizer without a chat template, a template
      that fails or does not render the prompt as the start of the whole chat.
  """
  if row.conversational:
    return _encode_chat(row, tok)
  prompt = np.concatenate([[tok.BOS], tok.encode(row.prompt)]).astype(np.int32)
  chosen, rejected = (
    np.concatenate([tok.encode(text), [tok.EOS]]).astype(np.int32)
    for text in (row.chosen, row.rejected)
  )
  return prompt, chosen, rejected


def _encode_chat(row: PairRow, tok) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Prompt: the rendering with the generation prompt; each completion: what the rendering
  of prompt + reply adds after it, which must therefore start with it."""
  template = getattr(tok, "chat_template", None)
  if template is None:
    raise DataError(_no_template(row, tok))
  prompt = _render(row, tok, row.prompt, add_generation_prompt=True)
  completions = []
  for side in SIDES:
    whole = _render(row, tok, row.prompt + getattr(row, side))
    if not whole.startswith(prompt):
      raise DataError(
        f"{row.where}: the chat template renders the prompt (with the generation prompt) as "
        f"something other than the start of prompt + {side}, so the {side} reply cannot be "
        f"told apart; use a template that renders turns incrementally"
      )
    completions.append(tok.encode_rendered(whole[len(prompt) :]).astype(np.int32))
  return tok.encode_rendered(prompt).astype(np.int32), *completions


def _render(row: PairRow, tok, messages: list[dict], add_generation_prompt: bool = False) -> str:
  """``render_chat`` with the tokenizer's template and special tokens; its errors name the row."""
  try:
    return chat_template.render_chat(
      tok.chat_template,
      messages,
      add_generation_prompt=add_generation_prompt,
      **tok.template_tokens,
    )
  except DataError as e:
    raise DataError(f"{row.where}: {e}") from None


def _no_template(row: PairRow, tok) -> str:
  """The one-line error for conversational rows and a tokenizer with no chat template."""
  if hasattr(tok, "chat_template"):  # a model folder's tokenizer, whose folder has none
    return (
      f"{row.where}: conversational rows are rendered with the tokenizer's chat template, but "
      f"the model folder {tok.path.parent} has none (no chat_template.jinja, no chat_template "
      f"in tokenizer_config.json); add the model's template there, or write the rows as strings"
    )
  name = getattr(tok, "path", tok.kind)
  return (
    f"{row.where}: conversational rows are rendered with a model folder's chat template, but "
    f"tokenizer {name} has none; use a model folder with a chat template as the tokenizer, or "
    f"write the rows as strings"
  )


# -- lengths and arrays -------------------------------------------------------------------


def fit_pair(
  prompt: np.ndarray,
  completions: Sequence[np.ndarray],
  seq_len: int,
  max_prompt_len: int | None = None,
) -> tuple[np.ndarray, list[np.ndarray], bool, bool]:
  """``(prompt, completions, prompt_cut, completion_cut)``: the prompt's last
  ``max_prompt_len`` tokens, each completion cut so that prompt + completion ≤ ``seq_len``
  + 1 tokens (empty when the prompt leaves no room), and whether each cut anything."""
  prompt_cut = max_prompt_len is not None and len(prompt) > max_prompt_len
  if prompt_cut:
    prompt = prompt[len(prompt) - max_prompt_len :]
  room = max(0, seq_len + 1 - len(prompt))
  completion_cut = any(len(c) > room for c in completions)
  return prompt, [c[:room] for c in completions], prompt_cut, completion_cut


def pair_set(
  rows: Sequence[PairRow], tok, *, seq_len: int, max_prompt_len: int | None = None
) -> PairSet:
  """The rows encoded, fitted to the lengths and stacked (``PairSet``).

  Raises:
    ConfigError: ``seq_len`` < 1, or ``max_prompt_len`` outside ``[1, seq_len]``.
    DataError: a row that does not encode, or every pair dropped.
  """
  _check_lengths(seq_len, max_prompt_len)
  kept, prompt_cuts, completion_cuts, identical = [], 0, 0, 0
  for row in rows:
    prompt, *completions = encode_pair(row, tok)
    if not len(prompt):
      raise DataError(f"{row.where}: the prompt renders to no token; it needs at least one")
    prompt, completions, prompt_cut, completion_cut = fit_pair(
      prompt, completions, seq_len, max_prompt_len
    )
    if not all(len(c) for c in completions):
      continue
    if np.array_equal(*completions):
      identical += 1
      continue
    kept.append((prompt, completions))
    prompt_cuts, completion_cuts = prompt_cuts + prompt_cut, completion_cuts + completion_cut
  if not kept:
    raise DataError(_all_dropped(rows, seq_len, max_prompt_len, identical))
  dropped = len(rows) - len(kept)
  counts = PairCounts(len(rows), prompt_cuts, completion_cuts, dropped, identical)
  return PairSet(_stack(kept, seq_len, tok.PAD), counts, seq_len)


def load_pairs(path: str, tok, *, seq_len: int, max_prompt_len: int | None = None) -> PairSet:
  """``pair_set(read_pairs(path), tok, ...)``: a JSONL file of pairs as arrays."""
  return pair_set(read_pairs(path), tok, seq_len=seq_len, max_prompt_len=max_prompt_len)


def _check_lengths(seq_len: int, max_prompt_len: int | None) -> None:
  if not isinstance(seq_len, int) or seq_len < 1:
    raise ConfigError(f"seq_len={seq_len!r} must be a positive integer")
  if max_prompt_len is not None and not (
    isinstance(max_prompt_len, int) and 1 <= max_prompt_len <= seq_len
  ):
    raise ConfigError(
      f"max_prompt_len={max_prompt_len!r} must be an integer in [1, seq_len={seq_len}]: a "
      f"prompt needs a token, and one at most seq_len leaves a completion token room"
    )


def _all_dropped(
  rows: Sequence[PairRow], seq_len: int, max_prompt_len: int | None, identical: int
) -> str:
  files = ", ".join(sorted({str(row.file) for row in rows}))
  if identical:
    short = len(rows) - identical
    also = f"; {short} kept no completion token on one side" if short else ""
    return (
      f"{files}: all {len(rows)} pairs were dropped: in {identical} the chosen and rejected "
      f"completions are the same tokens (after truncation to seq_len={seq_len}), which states "
      f"no preference{also}; a pair needs a chosen and a rejected completion that differ"
    )
  return (
    f"{files}: all {len(rows)} pairs were dropped: with seq_len={seq_len} and "
    f"max_prompt_len={max_prompt_len}, no pair keeps a completion token on both sides "
    f"(prompt + completion ≤ seq_len + 1 tokens); raise seq_len, or set max_prompt_len "
    f"below it to leave the completions room"
  )


def _stack(kept: list, seq_len: int, pad: int) -> dict[str, np.ndarray]:
  """``FIELDS`` → ``int32[N, seq_len]`` from ``(prompt, [chosen, rejected])`` per pair."""
  arrays = {}
  for s, side in enumerate(SIDES):
    windows = np.full((len(kept), seq_len + 1), pad, np.int32)
    flags = np.zeros((len(kept), seq_len + 1), np.int32)
    for i, (prompt, completions) in enumerate(kept):
      n = len(prompt) + len(completions[s])
      windows[i, :n] = np.concatenate([prompt, completions[s]])
      flags[i, len(prompt) : n] = 1
    arrays[f"{side}_inputs"] = windows[:, :-1]
    arrays[f"{side}_targets"] = windows[:, 1:]
    arrays[f"{side}_mask"] = flags[:, 1:]
  return arrays


def used_length(pairs: PairSet, indices) -> int:
  """How many leading positions the pairs at ``indices`` use: one past the last target
  either completion's loss mask marks (0 for no pair). Nothing after it enters a loss."""
  indices = np.asarray(indices, np.int64).reshape(-1)
  if not len(indices):
    return 0
  marked = np.zeros(pairs.seq_len, bool)
  for side in SIDES:
    marked |= pairs.arrays[f"{side}_mask"][indices].any(axis=0) > 0
  hits = np.flatnonzero(marked)
  return int(hits[-1]) + 1 if len(hits) else 0


def pair_batch(pairs: PairSet, indices, batch_size: int) -> dict[str, np.ndarray]:
  """A global batch: the pairs at ``indices`` (at most ``batch_size``) as ``FIELDS`` of
  ``int32[batch_size, seq_len]`` and ``pair_mask`` ``int32[batch_size]``, the rows past
  the pairs all zeros with ``pair_mask`` 0 (the last, partial batch of an epoch).

  Raises:
    BatchError: more indices than ``batch_size``, or an index outside the set.
  """
  indices = np.asarray(indices, np.int64).reshape(-1)
  n = len(indices)
  if n > batch_size:
    raise BatchError(f"{n} pair indices do not fit a batch of {batch_size}")
  if n and (indices.min() < 0 or indices.max() >= len(pairs)):
    raise BatchError(f"pair indices must lie in [0, {len(pairs)}), got {indices.tolist()}")
  batch = {}
  for name, values in pairs.arrays.items():
    batch[name] = np.zeros((batch_size, pairs.seq_len), np.int32)
    batch[name][:n] = values[indices]
  batch["pair_mask"] = (np.arange(batch_size) < n).astype(np.int32)
  if pairs.ref_logps is not None:
    ref = np.zeros((batch_size, 2), np.float32)
    ref[:n] = pairs.ref_logps[indices]
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref[:, 0], ref[:, 1]
  return batch
