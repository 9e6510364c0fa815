"""The data suite (``suite_data``) and its contenders: start-up against corpus size, prepare
against its tokenizer, and the loader alone; and how the loader's and start-up's costs
scale with the corpus.

Corpora are synthetic text of random words (bytes ≈ tokens with the byte tokenizer) made
in a temporary folder by ``make_corpus``; nothing is downloaded. The scaling measurements
(``scale_suite``) read prepared folders of sparse shard files (``sparse_prepared``): a
100 G-token corpus that takes no disk space, read through the real manifest, memory maps,
permutation and window code.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.harness import scratch_dir

WORDS = "the cat sat on a mat while seven quick foxes jumped over lazy dogs near rivers".split()


def make_corpus(
  path: pathlib.Path, num_bytes: int, seed: int = 0, paragraphs: int = 2000
) -> pathlib.Path:
  """~``num_bytes`` of text (at least ``paragraphs`` of them, the ones written at a time):
  paragraphs of random words separated by blank lines."""
  rng = np.random.default_rng(seed)
  words = np.array(WORDS)
  written = 0
  with path.open("w") as f:
    while written < num_bytes:
      chunk = "\n\n".join(" ".join(rng.choice(words, 60)) for _ in range(paragraphs)) + "\n\n"
      f.write(chunk)
      written += len(chunk)
  return path


def startup_contender(spec: dict):
  """Wall seconds and peak RSS (MiB) of ``jaxstep train`` on ``spec['data']`` through its
  first update step (``max_steps=1``, one eval batch, the final checkpoint only), with
  ``spec['overrides']`` if any."""
  root = scratch_dir("jaxstep-startup-")
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
    *spec.get("overrides", []),
  ]

  def run_once() -> dict:
    t = time.perf_counter()
    proc = subprocess.Popen(
      [*args, f"run_dir={root / str(next(counter))}"],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "JAXSTEP_XLA_CACHE": "off"},  # compiles too
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
  from jaxstep.data.tokenizer_loading import load_tokenizer

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

  root = scratch_dir("jaxstep-prepare-")
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


@functools.lru_cache(maxsize=8)
def _zeros_sha256(num_bytes: int) -> str:
  """sha256 of ``num_bytes`` zero bytes (what a sparse shard holds), without reading it."""
  h, block = hashlib.sha256(), bytes(1 << 22)
  for _ in range(num_bytes // len(block)):
    h.update(block)
  h.update(bytes(num_bytes % len(block)))
  return h.hexdigest()


def sparse_prepared(folder: pathlib.Path, tokens: int, doc_tokens: int) -> pathlib.Path:
  """A prepared text folder (byte tokenizer, train split only) of ``tokens`` zero tokens in
  sparse shard files of ``SHARD_TOKENS`` (they take no disk space), one document every
  ``doc_tokens``, with a manifest as ``prepare`` writes it: true sizes, sha256s and times."""
  from jaxstep.data.manifest import FORMAT_VERSION, MANIFEST, file_times, sha256
  from jaxstep.data.preparation import SHARD_TOKENS
  from jaxstep.data.tokenizer import ByteTokenizer

  folder.mkdir(parents=True)
  shards = []
  for i, start in enumerate(range(0, tokens, SHARD_TOKENS)):
    n = min(SHARD_TOKENS, tokens - start)
    name = f"train-{i:05d}.bin"
    with (folder / name).open("wb") as f:
      f.truncate(2 * n)  # uint16: a hole of 2n bytes that reads as zeros
    shards.append({"file": name, "tokens": n, "bytes": 2 * n, "sha256": _zeros_sha256(2 * n)})
  starts = np.arange(0, tokens, doc_tokens, dtype=np.uint64)
  starts.tofile(folder / "train.docs.bin")
  split = {
    "tokens": tokens,
    "targets": tokens - len(starts),
    "documents": len(starts),
    "shards": shards,
    "flags": None,
    "docs": {"file": "train.docs.bin", "sha256": sha256(folder / "train.docs.bin")},
  }
  splits = {"train": split}
  manifest = {
    "format_version": FORMAT_VERSION,
    "kind": "text",
    "tokenizer": {**ByteTokenizer().describe(), "file": None},
    "dtype": "uint16",
    "splits": splits,
    "file_times": file_times(folder, splits),
  }
  (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
  return folder


def data_startup_contender(spec: dict):
  """Start-up alone: ``load_dataset`` on the prepared ``spec['data']`` (manifest, sizes and
  times, memory maps, document offsets), seconds."""
  from jaxstep.data import DataConfig, load_dataset

  cfg = DataConfig(path=spec["data"])
  load_dataset(cfg, seq_len=spec["s"])  # imports and first-touch costs out of the timing

  def run_once() -> dict:
    t = time.perf_counter()
    ds = load_dataset(cfg, seq_len=spec["s"])
    return {"seconds": time.perf_counter() - t, "windows": len(ds.train)}

  return {}, run_once


class MemoryStream:
  """A ``shards.TokenStream`` stand-in of ``tokens`` tokens held in 128 KiB of memory (the
  same block repeats), one document every ``doc_tokens``: ``Windows`` over it runs the real
  window, flag and row code of any corpus size without touching a disk."""

  def __init__(self, tokens: int, doc_tokens: int):
    self.tokens, self.block = tokens, np.arange(1 << 16, dtype=np.uint16) % 256
    self.doc_starts = np.arange(0, tokens, doc_tokens, dtype=np.int64)

  def __len__(self) -> int:
    return self.tokens

  def read(self, start: int, stop: int) -> tuple[np.ndarray, None]:
    at = start % (len(self.block) // 2)
    return self.block[at : at + stop - start].astype(np.int32), None


def global_batch_contender(spec: dict):
  """``global_batch`` alone over ``spec['windows']`` windows of S: seconds per global batch
  of G × S, over ``batches`` batches spread across an epoch (a fresh epoch each run: new
  positions). The windows are the real ``Windows`` over a ``MemoryStream``: what is timed
  is the order (the keyed permutation) and the G rows, not a disk."""
  from jaxstep.data import global_batch, steps_per_epoch
  from jaxstep.data.shards import Windows

  g, s, batches = spec["g"], spec["s"], spec["batches"]
  split = Windows(MemoryStream(spec["windows"] * s + 1, 1 << 20), s, pack=True, pad_id=256)
  spe = steps_per_epoch(len(split), g)
  epochs = iter(range(1, 10**9))
  global_batch(split, 0, 0, 0, g, 256)

  def run_once() -> dict:
    epoch = next(epochs)
    t = time.perf_counter()
    for b in range(batches):
      global_batch(split, 0, epoch, b * spe // batches, g, 256)
    return {"seconds_per_batch": (time.perf_counter() - t) / batches}

  return {"windows": len(split)}, run_once


# the scaling measurements' sizes: batch G × S, windows of the two loaders and tokens of the
# two prepared folders (quick: the same code on small ones)
FULL_SCALE = {"g": 256, "s": 1024, "windows": (10**6, 10**8), "tokens": (10**7, 2 * 10**9)}
QUICK_SCALE = {"g": 8, "s": 64, "windows": (10**4, 10**6), "tokens": (10**5, 10**7)}


def _count(n: int) -> str:
  """A token count as the labels write it: 2 G, 10 M, 48 k."""
  for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
    if n >= size:
      return f"{n / size:g} {unit}"
  return str(n)


def _power(n: int) -> str:
  """A window count as the labels write it: 10^8 (a power of ten), else the number."""
  exp = len(str(n)) - 1
  return f"10^{exp}" if n == 10**exp else f"{n:,}"


def scale_suite(quick: bool) -> dict:
  """Costs that must not grow with the corpus, on sparse prepared folders:

  - ``loader_batch_cost_ratio_100m_1m``: seconds per global batch (256 windows of 1024)
    at 10^8 ÷ at 10^6 windows (goal ≤ 1.2: O(G), not O(windows));
  - ``data_startup_delta_s_2b_10m``: ``load_dataset`` seconds at 2 G − at 10 M tokens
    (goal ≤ 1 s: sizes and times, not bytes).

  ``quick``: the same keys from smaller sizes (``QUICK_SCALE``), one batch a round.

  Paired per round (``harness.measure``); returns ``raw``, ``summary`` and ``rows`` for
  ``suite_data`` to merge.
  """
  from benchmarks.harness import fmt, measure, ratio_stats

  sizes = QUICK_SCALE if quick else FULL_SCALE
  g, s = sizes["g"], sizes["s"]
  windows, tokens = sizes["windows"], sizes["tokens"]
  root = pathlib.Path(tempfile.mkdtemp(prefix="jaxstep-data-scale-"))
  try:
    batch = {"kind": "global_batch", "g": g, "s": s, "batches": 1 if quick else 32}
    load = {"kind": "data_startup", "s": s}
    specs = {
      "batch_1m": {**batch, "windows": windows[0]},
      "batch_100m": {**batch, "windows": windows[1]},
      "startup_10m": {**load, "data": str(sparse_prepared(root / "t10m", tokens[0], 2 * s))},
      "startup_2b": {**load, "data": str(sparse_prepared(root / "t2b", tokens[1], 2 * s))},
    }
    res, info, _ = measure(specs, rounds=1 if quick else 15)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  cost = ratio_stats(
    [r["seconds_per_batch"] for r in res["batch_100m"]],
    [r["seconds_per_batch"] for r in res["batch_1m"]],
  )
  startup = ratio_stats(
    [
      b["seconds"] - a["seconds"]
      for a, b in zip(res["startup_10m"], res["startup_2b"], strict=True)
    ],
    1,
  )
  per_batch_ms = 1e3 * float(np.median([r["seconds_per_batch"] for r in res["batch_100m"]]))
  return {
    "raw": {**res, "windows": {k: v["windows"] for k, v in info.items() if "windows" in v}},
    "loader_batch_cost_ratio_100m_1m": cost,
    "data_startup_delta_s_2b_10m": startup,
    "summary": {
      "loader_batch_cost_ratio_100m_1m": cost["median"],
      "data_startup_delta_s_2b_10m": startup["median"],
    },
    "rows": [
      (
        f"one global batch ({g} × {s}) at {_power(windows[1])} ÷ at {_power(windows[0])} "
        f"windows ({per_batch_ms:.1f} ms at {_power(windows[1])})",
        fmt(cost),
        "≤ 1.2",
      ),
      (
        f"data start-up (load_dataset): {_count(tokens[1])} − {_count(tokens[0])} prepared "
        "tokens (s)",
        fmt(startup),
        "≤ +1",
      ),
    ],
  }


CONTENDERS = {
  "startup": startup_contender,
  "tokenize_raw": tokenizer_contender,
  "prepare": prepare_contender,
  "loader": loader_contender,
  "data_startup": data_startup_contender,
  "global_batch": global_batch_contender,
}


def suite_data(quick: bool) -> dict:
  """Start-up and peak RSS against corpus size, prepare against its tokenizer, the loader."""
  from benchmarks.harness import fmt, measure, ratio_stats
  from benchmarks.loop_suites import QUICK_TINY
  from jaxstep.data import prepare, train_bpe
  from jaxstep.data.readers import read_documents

  root = scratch_dir("jaxstep-data-bench-")
  # quick: a few dozen paragraphs (~12 and ~48 KB), prepared in this process
  sizes = {"small": 12_000, "big": 48_000} if quick else {"small": 10_000_000, "big": 200_000_000}
  folders = {}
  for name, size in sizes.items():
    make_corpus(root / f"{name}.txt", size, paragraphs=40 if quick else 2000)
    folders[name] = str(root / name)
    workers = 1 if quick else os.cpu_count()
    prepare([str(root / f"{name}.txt")], folders[name], workers=workers, progress=False)
  docs = read_documents(str(root / "small.txt"))[0]
  train_bpe(docs[:2000], 4096, root / "tokenizer.json")
  text, tok = str(root / "small.txt"), str(root / "tokenizer.json")
  train = {"kind": "startup"}
  if quick:  # the loop suites' quick model
    train["overrides"] = QUICK_TINY
  specs = {
    "startup_small": {**train, "data": folders["small"]},
    "startup_big": {**train, "data": folders["big"]},
    "tokenize_raw": {"kind": "tokenize_raw", "text": text, "tokenizer": tok},
    "prepare": {"kind": "prepare", "text": text, "tokenizer": tok},
  }
  res, _, _ = measure(specs, rounds=1 if quick else 5)
  small, big = res["startup_small"], res["startup_big"]
  startup = ratio_stats([b["seconds"] - a["seconds"] for a, b in zip(small, big, strict=True)], 1)
  rss = ratio_stats([b["rss_mib"] - a["rss_mib"] for a, b in zip(small, big, strict=True)], 1)
  prep = ratio_stats(
    [r["tokens_per_s"] for r in res["prepare"]], [r["tokens_per_s"] for r in res["tokenize_raw"]]
  )
  g, s, n = (8, 64, 1) if quick else (256, 1024, 8)
  loader_spec = {"kind": "loader", "data": folders["big"], "g": g, "s": s, "batches": n}
  loader_res, _, _ = measure({"loader": loader_spec}, rounds=1 if quick else 5)
  loader = ratio_stats([r["tokens_per_s"] for r in loader_res["loader"]], 1)
  shutil.rmtree(root, ignore_errors=True)
  scale = scale_suite(quick)  # per-batch and start-up costs at 10^8 windows / 2 G tokens
  return {
    "sizes_bytes": sizes,
    "raw": {**res, **loader_res, **scale["raw"]},
    "startup_delta_s": startup,
    "rss_delta_mib": rss,
    "prepare_over_tokenizers": prep,
    "loader_tokens_per_s": loader,
    "summary": {
      "data_startup_delta_s_200m_10m": startup["median"],
      "data_rss_delta_mib_200m_10m": rss["median"],
      "prepare_over_tokenizers": prep["median"],
      "loader_tokens_per_s": loader["median"],
      **scale["summary"],
    },
    "rows": [
      *scale["rows"],
      (
        f"start-up to the first update: {_count(sizes['big'])} − {_count(sizes['small'])} "
        "prepared tokens (s)",
        fmt(startup),
        "≤ +5",
      ),
      (
        f"peak RSS: {_count(sizes['big'])} − {_count(sizes['small'])} prepared tokens (MiB)",
        fmt(rss),
        "≤ +200",
      ),
      (
        "prepare tokens/s ÷ its tokenizer's encode_batch tokens/s (BPE 4096, 1 worker)",
        fmt(prep),
        "≥ 0.8",
      ),
      (
        f"loader alone, global batches of {g} × {s} (tokens/s)",
        f"{loader['median']:,.0f} ({loader['q1']:,.0f}–{loader['q3']:,.0f})",
        "≫ 262,144 per update",
      ),
    ],
  }
