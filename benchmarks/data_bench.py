"""Data-path contenders: start-up against corpus size, prepare against its tokenizer, and
the loader alone.

Corpora are synthetic text of random words (bytes ≈ tokens with the byte tokenizer) made
in a temporary folder by ``make_corpus``; nothing is downloaded.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

WORDS = "the cat sat on a mat while seven quick foxes jumped over lazy dogs near rivers".split()


def make_corpus(path: pathlib.Path, num_bytes: int, seed: int = 0) -> pathlib.Path:
  """~``num_bytes`` of text: paragraphs of random words separated by blank lines."""
  rng = np.random.default_rng(seed)
  words = np.array(WORDS)
  written = 0
  with path.open("w") as f:
    while written < num_bytes:
      chunk = "\n\n".join(" ".join(rng.choice(words, 60)) for _ in range(2000)) + "\n\n"
      f.write(chunk)
      written += len(chunk)
  return path


def startup_contender(spec: dict):
  """Wall seconds and peak RSS (MiB) of ``jaxstep train`` on ``spec['data']`` through its
  first update step (``max_steps=1``, one eval batch, the final checkpoint only)."""
  root = pathlib.Path(tempfile.mkdtemp(prefix="jaxstep-startup-"))
  counter = iter(range(10**9))
  args = [
    sys.executable,
    "-m",
    "jaxstep.train",
    f"data.path={spec['data']}",
    "train.max_steps=1",
    "train.eval_every=0",
    "train.eval_batches=1",  # the one evaluation at the end reads one batch, whatever the size
    "checkpoint.every=0",
    "train.progress=false",
  ]

  def run_once() -> dict:
    t = time.perf_counter()
    proc = subprocess.Popen(
      [*args, f"run_dir={root / str(next(counter))}"],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status):
      raise RuntimeError(f"jaxstep train on {spec['data']} failed")
    return {"seconds": seconds, "rss_mib": usage.ru_maxrss / 1024}

  return {"data": spec["data"]}, run_once


def _documents(path: str) -> list[str]:
  from jaxstep.data.readers import read_documents

  return read_documents(path)[0]


def tokenizer_contender(spec: dict):
  """The tokenizer alone: ``encode_batch`` over the corpus in prepare's batch size."""
  from jaxstep.data.preparation import DOCS_PER_BATCH
  from jaxstep.data.tokenizer import load_tokenizer

  tok, docs = load_tokenizer(spec["tokenizer"]), _documents(spec["text"])

  def run_once() -> dict:
    t = time.perf_counter()
    tokens = sum(
      sum(len(x) for x in tok.encode_batch(docs[i : i + DOCS_PER_BATCH]))
      for i in range(0, len(docs), DOCS_PER_BATCH)
    )
    return {"tokens_per_s": tokens / (time.perf_counter() - t), "tokens": tokens}

  return {"documents": len(docs)}, run_once


def prepare_contender(spec: dict):
  """``prepare`` end to end (read, tokenize, write shards, hash) with one worker."""
  from jaxstep.data.preparation import prepare

  root = pathlib.Path(tempfile.mkdtemp(prefix="jaxstep-prepare-"))
  counter = iter(range(10**9))

  def run_once() -> dict:
    out = root / str(next(counter))
    t = time.perf_counter()
    manifest = prepare([spec["text"]], out, tokenizer=spec["tokenizer"], workers=1, progress=False)
    seconds = time.perf_counter() - t
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    tokens -= 2 * sum(s["documents"] for s in manifest["splits"].values())  # BOS, EOS
    return {"tokens_per_s": tokens / seconds, "tokens": tokens}

  return {}, run_once


def loader_contender(spec: dict):
  """``BatchLoader`` alone on ``spec['data']``: global batches of G × S per second."""
  from jaxstep.data import BatchLoader, DataConfig, load_dataset

  g, s, batches = spec["g"], spec["s"], spec["batches"]
  ds = load_dataset(DataConfig(path=spec["data"]), seq_len=s)
  loader = BatchLoader(ds.train, seed=0, global_batch_size=g, pad_id=ds.pad_id).start(0, 0)
  next(loader)

  def run_once() -> dict:
    t = time.perf_counter()
    for _ in range(batches):
      next(loader)
    return {"tokens_per_s": batches * g * s / (time.perf_counter() - t)}

  return {"windows": len(ds.train)}, run_once


CONTENDERS = {
  "startup": startup_contender,
  "tokenize_raw": tokenizer_contender,
  "prepare": prepare_contender,
  "loader": loader_contender,
}
