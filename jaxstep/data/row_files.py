"""What the JSONL row sets of a preference or an RL run (pairs, prompts) share: which rows
are held out, the fingerprint a resume checks, and the files that carry their tokenizer."""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from jaxstep.data import hf_folder, readers
from jaxstep.data.preparation import eval_mask


def held_out(n: int, eval_fraction: float) -> np.ndarray:
  """bool[n]: ``eval_fraction`` of the rows held out by a fixed hash of each row's place
  (they do not move with ``train.seed``); a set too small to split keeps its first row to
  train on."""
  held = eval_mask(0, n, eval_fraction)
  if held.all():
    held[0] = False
  return held


def fingerprint(path: str, tokenizer_spec: str, settings: dict) -> str:
  """sha256 of what decides a row set's arrays: the JSONL files' names and bytes, the
  tokenizer's files, and ``settings`` (the tokenizer's description, the lengths, the
  held-out share). A resume checks it as it checks a corpus's."""
  h = hashlib.sha256()
  for file in readers.list_files(path, "jsonl"):
    h.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
  if tokenizer_spec != "byte":
    p = pathlib.Path(tokenizer_spec)
    h.update(hf_folder.folder_digest(p).encode() if p.is_dir() else p.read_bytes())
  h.update(json.dumps(settings, sort_keys=True, default=str).encode())
  return h.hexdigest()[:16]


def tokenizer_files(tokenizer_spec: str) -> list[pathlib.Path]:
  """The files that carry the tokenizer (none for bytes): what a run dir keeps a copy of."""
  if tokenizer_spec == "byte":
    return []
  path = pathlib.Path(tokenizer_spec)
  return hf_folder.tokenizer_files(path) if path.is_dir() else [path]
