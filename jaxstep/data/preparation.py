"""Prepare a corpus once: documents → tokens → shards on disk + ``manifest.json``.

``prepare(inputs, out)`` streams the inputs file by file and document by document,
tokenizes them (in ``workers`` processes, in order) and appends each document's tokens to
the current shard of its split; memory holds one batch of documents, never the corpus.

``out/`` then holds, per split (``train``, ``eval``):

- ``<split>-00000.bin`` …: the token stream, uint16 when the vocabulary fits, else uint32.
  A text document is ``BOS tokens EOS``; a chat document is rendered by the model folder's
  chat template when the tokenizer has one, else ``BOS`` then per message
  ``<|role|>\\n content EOS`` (``samples.encode_chat``).
- ``<split>-00000.flags.bin`` … (chat only): uint8, 1 where the token may be a target
  (the assistant's tokens, its end-of-turn token among them). Text needs none: every token
  but each document's first is a target.
- ``<split>.docs.bin``: uint64 offsets where each document starts in the stream.

and ``manifest.json``: the format version, the tokenizer (kind, file, size, special ids),
the token dtype, the settings, the source files (names, sizes), per split its token and
document counts and each file's size and sha256, and each file's modification time (ns) as
written, so that reading the folder hashes only a file whose time moved. Everything is
written into a temporary directory renamed to ``out`` at the end, so a killed prepare
leaves no manifest (and the next one starts clean); preparing the same inputs again is a
no-op. ``out`` is replaced as a whole, so only a new or empty folder or a prepared one (from
the same settings, or any with ``force``) is accepted.

Documents go to eval by a hash of their index (``eval_fraction`` of them on average), so the
split never needs the whole corpus in memory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time
from collections.abc import Iterable, Iterator

import numpy as np

from jaxstep.data import encoding, hf_folder, out_folder, readers
from jaxstep.data.manifest import FORMAT_VERSION, MANIFEST, file_times, read_manifest, sha256
from jaxstep.data.shard_writer import ShardWriter
from jaxstep.data.tokenizer import ByteTokenizer, Tokenizer, train_bpe
from jaxstep.data.tokenizer_loading import load_tokenizer
from jaxstep.errors import ConfigError, DataError, RunIOError

SHARD_TOKENS = 1 << 26  # tokens per shard file: 128 MiB of uint16
DOCS_PER_BATCH = 512  # documents tokenized together (one worker task)
SPLIT_SEED = 1234  # fixed: the held-out documents do not move when train.seed changes

log = logging.getLogger("jaxstep")


def eval_mask(first: int, count: int, eval_fraction: float) -> np.ndarray:
  """Which of documents ``first … first + count - 1`` go to eval: a fixed hash of each
  index (splitmix64) below the fraction, so the split needs no document counts ahead."""
  z = np.arange(first, first + count, dtype=np.uint64) + np.uint64(SPLIT_SEED)
  z = z * np.uint64(0x9E3779B97F4A7C15)
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  z = z ^ (z >> np.uint64(31))
  return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53 < eval_fraction


def _batches(listings: dict[str, list], fmt: str, bar) -> Iterator[tuple[str, list]]:
  """``(kind, documents)`` in batches of ``DOCS_PER_BATCH``, streamed; ``bar`` advances by
  each input file's size once that file has been read."""
  batch, kind, current = [], None, None
  for path, files in listings.items():
    for file, kind, doc in readers.iter_documents(path, fmt, files):
      if file is not current:
        if current is not None:
          bar.update(current.stat().st_size)
        current = file
      batch.append(doc)
      if len(batch) == DOCS_PER_BATCH:
        yield kind, batch
        batch = []
  if batch:
    yield kind, batch
  if current is not None:
    bar.update(current.stat().st_size)


def _list_inputs(inputs: list[str], fmt: str) -> dict[str, list[pathlib.Path]]:
  """Each input's files, listed once; what a walk left out is logged (counts by reason and
  a few names), so a skipped file is never a silent loss."""
  listings = {}
  for path in inputs:
    listing = readers.scan(path, fmt)
    if listing.skipped:
      total = len(listing.files) + sum(len(v) for v in listing.skipped.values())
      log.warning(
        "%s: skipped %d of %d entries (format %s): %s",
        path,
        total - len(listing.files),
        total,
        fmt,
        listing.skip_summary(),
      )
    if not listing.files:
      readers.list_files(path, fmt)  # raises, naming what was skipped
    listings[path] = listing.files
  return listings


def _sources(listings: dict[str, list[pathlib.Path]]) -> list[dict]:
  return [
    {"name": str(f), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
    for files in listings.values()
    for f in files
  ]


def _texts_for_bpe(listings: dict[str, list], fmt: str) -> Iterable[str]:
  for path, files in listings.items():
    for _, kind, doc in readers.iter_documents(path, fmt, files):
      yield doc if kind == "text" else "\n".join(m["content"] for m in doc)


def _digest(**parts) -> str:
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _tokenizer_source(tokenizer: str, train_bpe_vocab: int) -> str:
  """What decides the tokens: a BPE size to train, ``byte``, or a file's content."""
  if train_bpe_vocab:
    return f"train-bpe:{train_bpe_vocab}"
  if tokenizer == "byte":
    return "byte"
  if pathlib.Path(tokenizer).is_dir():
    return f"folder:{hf_folder.folder_digest(tokenizer)}"
  return f"file:{sha256(pathlib.Path(tokenizer))}"


def prepare(
  inputs: list[str],
  out: str | pathlib.Path,
  *,
  tokenizer: str = "byte",
  train_bpe_vocab: int = 0,
  fmt: str = "auto",
  eval_fraction: float = 0.05,
  workers: int = 1,
  shard_tokens: int = SHARD_TOKENS,
  progress: bool = True,
  force: bool = False,
) -> dict:
  """Prepares ``inputs`` (files, directories, globs) into ``out``; returns the manifest.

  ``out`` must be new, empty, or a prepared folder: it is replaced as a whole, so a folder
  holding anything else is refused (never emptied), and so is an ``out`` inside a
  directory being read. A prepared ``out`` from the same inputs and settings is returned
  as it is; from other ones it is replaced only with ``force``, since a run trained on it
  would no longer resume.

  Args:
    tokenizer: ``byte``, a ``tokenizer.json``, a SentencePiece ``.model`` or a model folder;
      a file is copied into ``out`` (a folder's tokenizer files into ``out/tokenizer/``)
      so the prepared set is self-contained.
    train_bpe_vocab: if > 0, first train a byte-level BPE of this size on the inputs
      (``out/tokenizer.json``); ``tokenizer`` is then ignored.
    fmt: ``auto``, ``txt``, ``file``, ``jsonl`` or ``chat`` (as ``data.format``).
    eval_fraction: share of documents held out for eval, in [0, 1).
    workers: tokenizer processes (1: tokenize in this process).
    shard_tokens: tokens per shard file.
    force: replace a prepared ``out`` made from other inputs or settings.

  Raises:
    DataError / ConfigError: bad inputs, settings or ``out``; ``out`` is left as it was.
  """
  if not 0 <= eval_fraction < 1:
    raise ConfigError(f"eval fraction must be in [0, 1), got {eval_fraction}")
  if workers < 1:
    raise ConfigError(f"--workers must be >= 1, got {workers}")
  if shard_tokens < 1:
    raise ConfigError(f"--shard-tokens must be >= 1 (tokens per shard file), got {shard_tokens}")
  if train_bpe_vocab == 0 and tokenizer != "byte":
    load_tokenizer(tokenizer)  # a bad tokenizer fails before any work
  out = pathlib.Path(out)
  out_folder.refuse_unsafe_out(out, inputs)
  listings = _list_inputs(inputs, fmt)
  sources = _sources(listings)
  out_folder.refuse_input_inside_out(out, sources)
  settings = {"format": fmt, "eval_fraction": eval_fraction, "shard_tokens": shard_tokens}
  tokenizer_source = _tokenizer_source(tokenizer, train_bpe_vocab)
  inputs_digest = _digest(sources=sources, settings=settings, tokenizer=tokenizer_source)
  current = {"settings": settings, "tokenizer_source": tokenizer_source, "sources": sources}
  if not force:
    out_folder.refuse_other_settings(out, inputs_digest, current)  # before anything is written
  done = _up_to_date(out, inputs_digest)  # reads only: a prepared out on a read-only disk is used
  if done is not None:
    return done
  with _writes_into(out):
    out.parent.mkdir(parents=True, exist_ok=True)
    # one prepare of ``out`` at a time: the others wait, then find it done
    with out_folder.exclusive(out):
      done = _up_to_date(out, inputs_digest)
      if done is not None:
        return done
      if not force:  # another prepare may have got there first
        out_folder.refuse_other_settings(out, inputs_digest, current)
      tmp = _fresh_tmp(out)
      try:
        tok, spec = _tokenizer_into(tmp, listings, fmt, tokenizer, train_bpe_vocab)
        total = sum(s["bytes"] for s in sources)
        kind, splits = _tokenize(
          listings, fmt, tok, spec, tmp, eval_fraction, workers, shard_tokens, progress, total
        )
        manifest = _manifest(kind, tok, spec, splits, current, inputs_digest, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        out_folder.replace(out, tmp)
        return manifest
      finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fresh_tmp(out: pathlib.Path) -> pathlib.Path:
  """A new temporary folder next to ``out``, after removing what killed prepares left."""
  for stale in out_folder.stale(out):
    shutil.rmtree(stale, ignore_errors=True)
  tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
  tmp.mkdir()
  return tmp


def _manifest(kind, tok, spec, splits, current, inputs_digest, tmp) -> dict:
  sources = current["sources"]
  return {
    "format_version": FORMAT_VERSION,
    "kind": kind,
    "tokenizer": {**tok.describe(), "file": None if spec == "byte" else pathlib.Path(spec).name},
    "dtype": _dtype(tok),
    "splits": splits,
    "sources": [{"name": s["name"], "bytes": s["bytes"]} for s in sources],
    "source_times": [s["mtime_ns"] for s in sources],
    "settings": current["settings"],
    "tokenizer_source": current["tokenizer_source"],
    "inputs_digest": inputs_digest,
    "file_times": file_times(tmp, splits),
  }


# out of space, or a read-only disk: a write failed wherever it happened
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


@contextlib.contextmanager
def _writes_into(out: pathlib.Path):
  """A failed write of ``out`` (disk full or read-only, no permission) as one
  ``RunIOError`` naming it; any other error (reading an input) passes as it is."""
  try:
    yield
  except RunIOError:
    raise
  except OSError as e:
    if not _write_failure(e, out):
      raise
    raise RunIOError(
      f"--out {out}: a write failed ({e.strerror or e}); free space there or choose a "
      f"writable --out (it was left as it was)"
    ) from e


def _write_failure(e: OSError, out: pathlib.Path) -> bool:
  """Out of space or a read-only disk, or an error on a path of ``out``'s own: itself, a
  folder above it, its lock, temporary or old folder (inputs are never among them)."""
  if e.errno in WRITE_ERRNOS:
    return True
  own = (f"{out}{os.sep}", f"{out.parent / ('.' + out.name)}.")
  names = [str(n) for n in (e.filename, e.filename2) if n is not None]
  return any(n == str(out) or n.startswith(own) or pathlib.Path(n) in out.parents for n in names)


def _up_to_date(out: pathlib.Path, inputs_digest: str) -> dict | None:
  """The manifest of ``out`` if it was prepared from these inputs and is intact."""
  try:
    if json.loads((out / MANIFEST).read_text()).get("inputs_digest") == inputs_digest:
      return read_manifest(out)
  except (FileNotFoundError, json.JSONDecodeError, DataError):
    pass  # not there, from other inputs, or damaged: prepare again
  return None


def _dtype(tok) -> str:
  return "uint16" if tok.vocab_size <= 2**16 else "uint32"


def _tokenizer_into(tmp, listings, fmt, tokenizer, train_bpe_vocab) -> tuple[Tokenizer, str]:
  """The tokenizer, saved or copied into ``tmp``; and how a worker loads it."""
  if train_bpe_vocab:
    tok = train_bpe(_texts_for_bpe(listings, fmt), train_bpe_vocab, tmp / "tokenizer.json")
    return tok, str(tmp / "tokenizer.json")
  if tokenizer == "byte":
    return ByteTokenizer(), "byte"
  if pathlib.Path(tokenizer).is_dir():  # the folder's tokenizer files, in a folder of their own
    (tmp / "tokenizer").mkdir()
    for file in hf_folder.tokenizer_files(tokenizer):
      shutil.copyfile(file, tmp / "tokenizer" / file.name)
    return load_tokenizer(str(tmp / "tokenizer")), str(tmp / "tokenizer")
  name = "tokenizer.json" if tokenizer.endswith(".json") else "tokenizer.model"
  shutil.copyfile(tokenizer, tmp / name)
  return load_tokenizer(str(tmp / name)), str(tmp / name)


def _tokenize(
  listings, fmt, tok, spec, tmp, eval_fraction, workers, shard_tokens, progress, total
) -> tuple[str, dict]:
  """Streams every document through the tokenizer into the split writers."""
  import tqdm  # the progress bar: only when preparing

  bar = tqdm.tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="prepare")
  writers: dict[str, ShardWriter] = {}
  kind, index, start = "text", 0, time.perf_counter()
  try:
    with encoding.encoder(workers, spec) as encode:
      for kind, tokens, flags, lengths in encode(_batches(listings, fmt, bar)):
        held_out = eval_mask(index, len(lengths), eval_fraction)
        in_eval = np.repeat(held_out, lengths)
        for split, docs, rows in (("train", ~held_out, ~in_eval), ("eval", held_out, in_eval)):
          if docs.any():
            if split not in writers:
              chat = kind == "chat"
              writers[split] = ShardWriter(tmp, split, _dtype(tok), shard_tokens, chat)
            writers[split].add(tokens[rows], flags[rows], lengths[docs])
        index += len(lengths)
        rate = sum(w.tokens for w in writers.values()) / (time.perf_counter() - start)
        bar.set_postfix(tokens_per_s=f"{rate:,.0f}", refresh=False)
  except BaseException:
    for writer in writers.values():
      writer.abort()
    raise
  finally:
    bar.close()
  if "train" not in writers:
    raise DataError(f"{' '.join(listings)}: no documents to train on")
  return kind, {split: w.finish() for split, w in writers.items()}
