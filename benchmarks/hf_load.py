"""Loading a Hugging Face Llama folder, jaxstep against ``transformers`` (benchmark-only;
``hf_bench``'s first part): a ~124 M-parameter Llama folder (``FOLDER``: d 768, 12 layers,
12 query / 4 key-value heads, SwiGLU 2048, vocabulary 32,000, untied head), random weights
written by ``LlamaForCausalLM.save_pretrained`` in fp32, with a tiny BPE ``tokenizer.json``;
built once and kept under the temporary folder (``folder_path``). ``jaxstep.load_pretrained``
(fp32 params, each tensor ``jax.device_put`` as it is read, then ``block_until_ready``)
against ``AutoModelForCausalLM.from_pretrained`` (fp32); each load in a fresh process, timed
after the imports and the backend's start (both also reported), the two interleaved round
after round. ``load_pretrained`` is timed whole, tokenizer included (``tokenizer_s`` is its
share, timed again after the load). Peak RSS increase of the load (sampled every 2 ms and
``ru_maxrss``) ÷ the model's fp32 bytes.

The floors of any loader that copies the weights into memory of its own, since
``from_pretrained`` maps the file and copies nothing: ``fresh_memory``, a third fresh process
in every round that starts the same backend, then times allocating as many fresh bytes as
the folder's weights have and writing one byte per page, and then reading the weights' bytes
once from the page cache into a buffer it has already touched.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from benchmarks.rss import PeakRss

# transformers.LlamaConfig keys of the import folder (~124 M parameters)
FOLDER = {
  "vocab_size": 32000,
  "hidden_size": 768,
  "intermediate_size": 2048,
  "num_hidden_layers": 12,
  "num_attention_heads": 12,
  "num_key_value_heads": 4,
  "max_position_embeddings": 1024,
  "tie_word_embeddings": False,
}
QUICK_FOLDER = {  # ~2.3 M parameters
  **FOLDER,
  "vocab_size": 8000,
  "hidden_size": 128,
  "intermediate_size": 352,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "max_position_embeddings": 256,
}
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 of the folder's tokenizer


# ---------------------------------------------------------------------------- the folder


def folder_path(shape: dict) -> pathlib.Path:
  """Where the folder of ``shape`` is kept: the temporary folder, keyed by the shape and the
  transformers version that writes it."""
  from importlib.metadata import version

  key = json.dumps([shape, version("transformers")], sort_keys=True)
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  return pathlib.Path(tempfile.gettempdir()) / "jaxstep-bench-hf" / f"llama-{digest}"


def _write_tokenizer(folder: pathlib.Path) -> None:
  """A tiny byte-level BPE (``tokenizer.json``) and its ``tokenizer_config.json``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(["the cat sat on the mat", "a quick fox jumped over it"] * 8, trainer)
  tok.save(str(folder / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": SPECIALS[0]}
  config.update(bos_token=SPECIALS[1], eos_token=SPECIALS[2])
  (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_folder(shape: dict) -> dict:
  """The folder of ``shape``, built unless already kept: random fp32 weights written by
  ``save_pretrained``, the tokenizer files beside them. Returns ``folder_info``."""
  import torch
  import transformers

  path = folder_path(shape)
  if not (path / "complete").is_file():
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    config = transformers.LlamaConfig(**shape, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(tmp)
    _write_tokenizer(tmp)
    (tmp / "complete").write_text("")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
  return folder_info(path)


def folder_info(path: pathlib.Path) -> dict:
  """The folder's path, parameter count (from the safetensors headers), files and dtype."""
  from safetensors import safe_open

  params = 0
  sizes = {p.name: p.stat().st_size for p in sorted(path.iterdir())}
  for name in sizes:
    if name.endswith(".safetensors"):
      with safe_open(str(path / name), framework="np") as f:
        params += sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118
  saved = json.loads((path / "config.json").read_text())
  dtype = saved.get("dtype") or saved.get("torch_dtype")
  return {"path": str(path), "params": params, "files_bytes": sizes, "saved_dtype": dtype}


# ---------------------------------------------------------------------------- loading


def load_jax(path: str) -> dict:
  """One ``jaxstep.load_pretrained`` of ``path`` (fp32, each tensor ``jax.device_put``)."""
  t = time.perf_counter()
  import jax
  import tokenizers  # noqa: F401 -- the tokenizer's library, imported on first use

  from jaxstep import models  # noqa: F401 -- the import, not the load
  from jaxstep.data import hf_folder
  from jaxstep.models.pretrained import load_pretrained

  jax.block_until_ready(jax.device_put(np.zeros(1, np.float32)))  # start the backend
  import_s = time.perf_counter() - t
  with PeakRss() as rss:
    t = time.perf_counter()
    loaded = load_pretrained(path, dtype=np.float32, place=lambda _, a: jax.device_put(a))
    jax.block_until_ready(loaded.params)
    seconds = time.perf_counter() - t
  t = time.perf_counter()
  hf_folder.folder_tokenizer(path)
  tokenizer_s = time.perf_counter() - t
  leaves = jax.tree.leaves(loaded.params)
  return {
    "seconds": seconds,
    "import_s": import_s,
    "rss_before": rss.before,
    "rss_increase": rss.increase,
    "rss_anon_increase": rss.anon_increase,
    "rss_after_increase": rss.after - rss.before,
    "tokenizer_s": tokenizer_s,
    "params": sum(x.size for x in leaves),
    "dtype": str(leaves[0].dtype),
  }


def touch_fresh(path: str) -> dict:
  """The floors of a copying loader of ``path``, after the same imports and backend start
  as ``load_jax``: ``seconds``, allocating as many fresh bytes as its safetensors files hold
  and writing one byte per page; ``read_s``, reading those files' bytes once (``os.preadv``
  from the page cache) into one 64 MiB buffer whose pages are already touched, the cost of
  the bytes alone, with no fresh memory at all."""
  import jax

  jax.block_until_ready(jax.device_put(np.zeros(1, np.float32)))
  files = sorted(pathlib.Path(path).glob("*.safetensors"))
  nbytes = sum(p.stat().st_size for p in files)
  t = time.perf_counter()
  fresh = np.empty(nbytes, np.uint8)
  fresh[:: os.sysconf("SC_PAGE_SIZE")] = 1
  seconds = time.perf_counter() - t
  del fresh
  buffer = np.ones(64 << 20, np.uint8)
  t = time.perf_counter()
  for file in files:
    fd = os.open(file, os.O_RDONLY)
    try:
      offset = 0
      while n := os.preadv(fd, [memoryview(buffer)], offset):
        offset += n
    finally:
      os.close(fd)
    assert offset == file.stat().st_size, f"read {offset} of {file}'s bytes"
  return {"seconds": seconds, "read_s": time.perf_counter() - t, "bytes": nbytes}


def load_hf(path: str) -> dict:
  """One ``AutoModelForCausalLM.from_pretrained`` of ``path`` (the folder's fp32)."""
  t = time.perf_counter()
  import torch
  from transformers import AutoModelForCausalLM
  from transformers.models.llama import modeling_llama  # noqa: F401 -- imported on first use

  torch.zeros(1).sum()
  import_s = time.perf_counter() - t
  with PeakRss() as rss:
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path)
    seconds = time.perf_counter() - t
  # from_pretrained maps the file and reads nothing yet: read one float per 4 KiB page of
  # every weight, as a first forward pass would (timed apart, not in ``seconds``)
  with PeakRss() as touched:
    t = time.perf_counter()
    with torch.no_grad():
      for p in model.parameters():
        p.detach().reshape(-1)[::1024].sum()
    touch_s = time.perf_counter() - t
  return {
    "seconds": seconds,
    "touch_s": touch_s,
    "import_s": import_s,
    "rss_before": rss.before,
    "rss_increase": rss.increase,
    "rss_anon_increase": rss.anon_increase,
    "rss_after_increase": rss.after - rss.before,
    "touch_rss_increase": touched.increase,
    "params": sum(p.numel() for p in model.parameters()),
    "dtype": str(next(model.parameters()).dtype),
    "threads": torch.get_num_threads(),
  }


LOADERS = {"jaxstep": load_jax, "transformers": load_hf, "fresh_memory": touch_fresh}


def in_fresh_process(*args: str) -> dict:
  """``python -m benchmarks.hf_load ARGS…`` (nothing else imported): its JSON line, and
  ``process_s``, the interpreter's whole life from start to exit, timed from here."""
  import subprocess
  import sys

  t = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.hf_load", *args],
    capture_output=True,
    text=True,
    cwd=pathlib.Path(__file__).resolve().parent.parent,
    check=False,
  )
  process_s = time.perf_counter() - t
  if proc.returncode:
    raise RuntimeError(f"benchmarks.hf_load {args[0]} failed:\n{proc.stderr[-2000:]}")
  return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": process_s}


def fresh_rounds(path: str, rounds: int, seed: int = 0) -> dict[str, list]:
  """``harness.interleaved`` rounds of the loaders: in each, every loader loads ``path``
  once in a fresh interpreter, in a fresh random order."""
  from benchmarks.harness import interleaved

  loads = {n: SimpleNamespace(run=functools.partial(in_fresh_process, n, path)) for n in LOADERS}
  return interleaved(loads, rounds, seed)


# ---------------------------------------------------------------------------- the results


def load_results(load: dict, folder: dict) -> tuple[dict, list, dict]:
  """The ratios of ``fresh_rounds``' loads (``load``) of ``folder``: ``(ratios by name,
  table rows, summary keys)``."""
  from benchmarks.harness import fmt, ratio_stats

  out, summary = {}, {}
  jl, hl, fl = load["jaxstep"], load["transformers"], load["fresh_memory"]
  model_bytes = 4 * folder["params"]
  mb = f"{folder['params'] / 1e6:.0f} M params, {model_bytes / 2**20:.0f} MiB fp32"

  def per_round(runs, key):
    return [key(r) if callable(key) else r[key] for r in runs]

  ratios = {
    "import_over_transformers": (per_round(jl, "seconds"), per_round(hl, "seconds")),
    "import_over_transformers_paged_in": (
      per_round(jl, "seconds"),
      per_round(hl, lambda r: r["seconds"] + r["touch_s"]),
    ),
    "import_process_over_transformers": (per_round(jl, "process_s"), per_round(hl, "process_s")),
    "import_rss_over_model_bytes": (per_round(jl, "rss_increase"), model_bytes),
    "import_anon_rss_over_model_bytes": (per_round(jl, "rss_anon_increase"), model_bytes),
    "import_rss_after_over_model_bytes": (per_round(jl, "rss_after_increase"), model_bytes),
    "transformers_rss_over_model_bytes": (per_round(hl, "rss_increase"), model_bytes),
    "transformers_paged_in_rss_over_model_bytes": (
      per_round(hl, lambda r: r["rss_increase"] + r["touch_rss_increase"]),
      model_bytes,
    ),
    "tokenizer_share": (per_round(jl, "tokenizer_s"), per_round(jl, "seconds")),
    "import_over_fresh_memory": (per_round(jl, "seconds"), per_round(fl, "seconds")),
    "fresh_memory_over_transformers": (per_round(fl, "seconds"), per_round(hl, "seconds")),
    "read_over_transformers": (per_round(fl, "read_s"), per_round(hl, "seconds")),
  }
  for name, (num, den) in ratios.items():
    out[name] = ratio_stats(num, den)
  seconds = {n: ratio_stats(per_round(load[n], "seconds"), 1)["median"] for n in load}
  touch = ratio_stats(per_round(hl, "touch_s"), 1)["median"]
  summary["hf_import_over_transformers"] = out["import_over_transformers"]["median"]
  summary["hf_import_rss_over_model_bytes"] = out["import_rss_over_model_bytes"]["median"]
  summary["hf_import_anon_rss_over_model_bytes"] = out["import_anon_rss_over_model_bytes"]["median"]
  summary["hf_read_floor_over_transformers"] = out["read_over_transformers"]["median"]
  rows = [
    (
      f"load a Llama folder ({mb}; a fresh process each): jaxstep.load_pretrained (fp32, "
      f"device_put) ÷ AutoModelForCausalLM.from_pretrained ({seconds['jaxstep']:.2f} s vs "
      f"{seconds['transformers']:.2f} s)",
      fmt(out["import_over_transformers"]),
      "≤ 1.0",
    ),
    (
      f"the same ÷ from_pretrained + reading one float per page of every weight "
      f"(+{touch:.3f} s: from_pretrained maps the file and reads nothing)",
      fmt(out["import_over_transformers_paged_in"]),
      "",
    ),
    (
      "the same, each whole process (interpreter start, imports, load, exit)",
      fmt(out["import_process_over_transformers"]),
      "",
    ),
    ("load_pretrained's tokenizer ÷ the whole load", fmt(out["tokenizer_share"]), ""),
    (
      "the floor of a copying loader: first-touching as many fresh bytes as the model has "
      "÷ from_pretrained · load_pretrained ÷ that floor",
      f"{fmt(out['fresh_memory_over_transformers'])} · {fmt(out['import_over_fresh_memory'])}",
      "",
    ),
    (
      "the floor of any loader that reads the weights: reading the folder's bytes once from "
      "the page cache into memory already touched ÷ from_pretrained",
      fmt(out["read_over_transformers"]),
      "",
    ),
    (
      "peak RSS increase of load_pretrained ÷ fp32 model bytes",
      fmt(out["import_rss_over_model_bytes"]),
      "≤ 1.5",
    ),
    (
      "the same, anonymous memory only (not the mapped safetensors file's pages) · "
      "once loaded (all pages)",
      f"{fmt(out['import_anon_rss_over_model_bytes'])} · "
      f"{fmt(out['import_rss_after_over_model_bytes'])}",
      "",
    ),
    (
      "peak RSS increase of from_pretrained ÷ fp32 model bytes · after reading every page",
      f"{fmt(out['transformers_rss_over_model_bytes'])} · "
      f"{fmt(out['transformers_paged_in_rss_over_model_bytes'])}",
      "",
    ),
  ]
  return out, rows, summary


if (
  __name__ == "__main__"
):  # one load in this fresh interpreter: python -m benchmarks.hf_load NAME PATH
  import sys

  name, arg = sys.argv[1:]
  out = make_folder(json.loads(arg)) if name == "folder" else LOADERS[name](arg)
  print(json.dumps(out), flush=True)
