"""Hugging Face interop against ``transformers`` + PyTorch (CPU, benchmark-only): loading a
model folder, fine-tuning a Llama, decoding a Llama.

- Import: a ~124 M-parameter Llama folder (``FOLDER``: d 768, 12 layers, 12 query / 4
  key-value heads, SwiGLU 2048, vocabulary 32,000, untied head), random weights written by
  ``LlamaForCausalLM.save_pretrained`` in fp32, with a tiny BPE ``tokenizer.json``; built
  once and kept under the temporary folder (``folder_path``). ``jaxstep.load_pretrained``
  (fp32 params, each tensor ``jax.device_put`` as it is read, then ``block_until_ready``)
  against ``AutoModelForCausalLM.from_pretrained`` (fp32); each load in a fresh process,
  timed after the imports and the backend's start (both also reported), the two
  interleaved round after round. ``load_pretrained`` is timed whole, tokenizer included
  (``tokenizer_s`` is its share, timed again after the load). Peak RSS increase of the load
  (sampled every 2 ms and ``ru_maxrss``) ÷ the model's fp32 bytes.
- Fine-tuning: ``TRAIN_MODEL`` (d 256, 4 layers, 4 / 2 heads, SwiGLU 688, vocabulary 8,192,
  256 tokens), global batch 32 × 256 in K=8 micro-steps, AdamW + clip 1.0, fp32: jaxstep's
  train step (``step_bench``'s ``jaxstep`` contender, CPU defaults) against transformers'
  ``LlamaForCausalLM`` with the same math (``torch_bench``'s ``torch_llama``: eager and
  ``torch.compile``).
- Decode: the same Llama shape (512 positions), prompts of 64 random ids, 256 new tokens
  greedily, EOS never chosen: ``jaxstep.Generator`` (key/value cache, one CPU device) against
  ``LlamaForCausalLM.generate(use_cache=True)`` (all cores), 1 and 8 prompts.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import resource
import shutil
import tempfile
import threading
import time

import numpy as np

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
# jaxstep model keys (``model.family=llama``) of the fine-tuning and decode comparisons
TRAIN_MODEL = {
  "family": "llama",
  "vocab_size": 8192,
  "max_seq_len": 256,
  "d_model": 256,
  "n_layers": 4,
  "n_heads": 4,
  "n_kv_heads": 2,
  "intermediate_size": 688,
  "tie_embeddings": False,
}
QUICK_TRAIN_MODEL = {
  **TRAIN_MODEL,
  "vocab_size": 512,
  "max_seq_len": 32,
  "d_model": 32,
  "n_layers": 1,
  "n_heads": 2,
  "n_kv_heads": 1,
  "intermediate_size": 64,
}
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 of the folder's tokenizer


def hf_llama_kwargs(model: dict) -> dict:
  """``transformers.LlamaConfig`` keyword arguments of a jaxstep Llama model dict."""
  return {
    "vocab_size": model["vocab_size"],
    "hidden_size": model["d_model"],
    "intermediate_size": model["intermediate_size"],
    "num_hidden_layers": model["n_layers"],
    "num_attention_heads": model["n_heads"],
    "num_key_value_heads": model.get("n_kv_heads") or model["n_heads"],
    "max_position_embeddings": model["max_seq_len"],
    "tie_word_embeddings": model["tie_embeddings"],
    "rms_norm_eps": 1e-6,
    "attention_dropout": 0.0,
  }


def jax_llama_config(model: dict):
  from jaxstep import models

  return models.LlamaConfig(**{k: v for k, v in model.items() if k != "family"})


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


def _rss() -> tuple[int, int]:
  """This process's resident bytes now and those of them that are not file-backed
  (anonymous: ``/proc/self/statm``'s resident − shared); elsewhere the peak so far, twice."""
  try:
    with open("/proc/self/statm") as f:
      resident, shared = (int(x) for x in f.read().split()[1:3])
    page = os.sysconf("SC_PAGE_SIZE")
    return resident * page, (resident - shared) * page
  except OSError:
    return _max_rss(), _max_rss()


def _max_rss() -> int:
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak * 1024 if os.uname().sysname == "Linux" else peak  # kB on Linux, bytes on macOS


class PeakRss:
  """Peak resident bytes while the block runs, minus those just before it (``increase``):
  sampled every 2 ms, and ``ru_maxrss`` when the block raised the process's all-time peak.
  ``anon_increase``: the same for anonymous memory alone (sampled), leaving out the pages
  of memory-mapped files (e.g. a safetensors file being read), which the kernel can drop."""

  def __enter__(self):
    (self.before, self.anon_before), self.max_before = _rss(), _max_rss()
    self.sampled = self.anon_sampled = 0
    self._stop = threading.Event()

    def sample():
      while not self._stop.wait(0.002):
        total, anon = _rss()
        self.sampled, self.anon_sampled = max(self.sampled, total), max(self.anon_sampled, anon)

    self._thread = threading.Thread(target=sample, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    (total, anon), after = _rss(), _max_rss()
    peak = max(self.sampled, total, after if after > self.max_before else 0)
    self.increase = peak - self.before
    self.anon_increase = max(self.anon_sampled, anon) - self.anon_before
    self.after = total


def load_jax(path: str) -> dict:
  """One ``jaxstep.load_pretrained`` of ``path`` (fp32, each tensor ``jax.device_put``)."""
  t = time.perf_counter()
  import jax
  import tokenizers  # noqa: F401 -- the tokenizer's library, imported on first use

  from jaxstep import models  # noqa: F401 -- the import, not the load
  from jaxstep.data import hf_folder
  from jaxstep.trainer.pretrained import load_pretrained

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


LOADERS = {"jaxstep": load_jax, "transformers": load_hf}


def _in_fresh_process(*args: str) -> dict:
  """``python -m benchmarks.hf_bench ARGS…`` (nothing else imported): its JSON line, and
  ``process_s``, the interpreter's whole life from start to exit, timed from here."""
  import subprocess
  import sys

  t = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.hf_bench", *args],
    capture_output=True,
    text=True,
    cwd=pathlib.Path(__file__).resolve().parent.parent,
    check=False,
  )
  process_s = time.perf_counter() - t
  if proc.returncode:
    raise RuntimeError(f"benchmarks.hf_bench {args[0]} failed:\n{proc.stderr[-2000:]}")
  return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": process_s}


def _fresh_rounds(path: str, rounds: int, seed: int = 0) -> dict[str, list]:
  """``rounds`` rounds; in each, every loader loads ``path`` once in a fresh interpreter, in
  a fresh random order."""
  rng = random.Random(seed)
  results = {name: [] for name in LOADERS}
  for _ in range(rounds):
    order = list(LOADERS)
    rng.shuffle(order)
    for name in order:
      results[name].append(_in_fresh_process(name, path))
  return results


# ---------------------------------------------------------------------------- decoding


def decode_jax(spec: dict):
  """Worker: ``jaxstep.Generator`` with the key/value cache, greedy, EOS never chosen."""
  from benchmarks.generate_bench import timed_jax_decode

  cfg = jax_llama_config(spec["model"])
  # every id of the model may be chosen, as in transformers
  return timed_jax_decode(cfg, spec, vocab_size=cfg.vocab_size)


def decode_hf(spec: dict):
  """Worker: ``LlamaForCausalLM.generate(use_cache=True)``, greedy, the same shapes."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  from benchmarks.generate_bench import timed_hf_generate

  torch.manual_seed(0)
  config = LlamaConfig(**hf_llama_kwargs(spec["model"]), bos_token_id=257, eos_token_id=258)
  return timed_hf_generate(LlamaForCausalLM(config).eval(), spec)


CONTENDERS = {
  "llama_decode_jax": decode_jax,
  "llama_decode_hf": decode_hf,
}


# ---------------------------------------------------------------------------- the suite


def _load_then_measure(path: str, load_rounds: int, specs: dict, rounds: int, overlap: bool):
  """``_fresh_rounds`` of the loads, then ``harness.measure`` of ``specs``; ``overlap``: the
  loads run while the workers of ``specs`` build."""
  from benchmarks.harness import measure

  loads = {}

  def load():
    loads["load"] = _fresh_rounds(path, load_rounds)

  if not overlap:
    load()
  res, info, failed = measure(specs, rounds, while_building=load if overlap else None)
  return loads["load"], res, info, failed


def _skipped(why: str) -> dict:
  return {"skipped": why, "summary": {}, "rows": [("hf suite", f"skipped: {why}", "")]}


def suite_hf(quick: bool) -> dict:
  """Load time and peak RSS of a Hugging Face Llama folder, fine-tuning tokens/s and decode
  tokens/s, each against transformers + PyTorch on the same shapes."""
  import importlib.util

  from benchmarks.harness import fmt, ratio_stats

  if not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")):
    return _skipped("torch and transformers are not installed")
  shape = QUICK_FOLDER if quick else FOLDER
  model, g, k = (QUICK_TRAIN_MODEL, 8, 2) if quick else (TRAIN_MODEL, 32, 8)
  new, prompt_len = (8, 8) if quick else (256, 64)
  batches = (8,) if quick else (1, 8)
  load_rounds, rounds = (1, 1) if quick else (5, 10)

  phase_s, t, loadavg = {}, time.perf_counter(), [os.getloadavg()]
  kept = folder_path(shape)
  if (kept / "complete").is_file():
    folder = folder_info(kept)
  else:  # torch is imported only in processes of its own
    folder = _in_fresh_process("folder", json.dumps(shape))
  phase_s["folder"] = time.perf_counter() - t

  base = {"model": model, "g": g, "k": k}
  specs = {"jaxstep": {**base, "kind": "jaxstep"}, "torch_eager": {**base, "kind": "torch_llama"}}
  if not quick:  # compile starts slowly
    specs["torch_compile"] = {**base, "kind": "torch_llama", "compile": True}
  torch_names = [n for n in specs if n.startswith("torch")]
  decode_model = {**model, "max_seq_len": 512 if not quick else 64}
  for b in batches:
    spec = {"model": decode_model, "batch": b, "new_tokens": new, "prompt_len": prompt_len}
    specs[f"decode_jax_b{b}"] = {**spec, "kind": "llama_decode_jax"}
    specs[f"decode_hf_b{b}"] = {**spec, "kind": "llama_decode_hf"}
  # The loads run alone; quick (a smoke run, whose numbers are not measurements) runs them
  # while the other workers build, to be done sooner.
  load, res, info, failed = _load_then_measure(folder["path"], load_rounds, specs, rounds, quick)
  phase_s["load_train_decode"] = time.perf_counter() - phase_s["folder"] - t
  loadavg.append(os.getloadavg())  # others' work on these cores, before and after

  out = {
    "folder": {**folder, "shape": shape},
    "train": {**base, "seq_len": model["max_seq_len"]},
    "decode": {"model": decode_model, "new_tokens": new, "prompt_len": prompt_len},
    "raw": {"load": load, **res},
    "info": info,
    "failed": failed,
    "phase_s": phase_s,
    "loadavg_before_after": loadavg,
  }
  rows, summary = [], {}

  # loading
  jl, hl = load["jaxstep"], load["transformers"]
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
  }
  for name, (num, den) in ratios.items():
    out[name] = ratio_stats(num, den)
  seconds = {n: ratio_stats(per_round(load[n], "seconds"), 1)["median"] for n in load}
  touch = ratio_stats(per_round(hl, "touch_s"), 1)["median"]
  summary["hf_import_over_transformers"] = out["import_over_transformers"]["median"]
  summary["hf_import_rss_over_model_bytes"] = out["import_rss_over_model_bytes"]["median"]
  summary["hf_import_anon_rss_over_model_bytes"] = out["import_anon_rss_over_model_bytes"]["median"]
  rows += [
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

  # fine-tuning
  sec = {n: [r["seconds"] for r in rounds_] for n, rounds_ in res.items()}
  live_torch = [n for n in torch_names if n in sec]
  tokens = g * model["max_seq_len"]
  shape_txt = (
    f"d {model['d_model']}, {model['n_layers']} layers, vocab {model['vocab_size']}, "
    f"G={g} × {model['max_seq_len']}, K={k}"
  )
  if "jaxstep" in sec and live_torch:
    best = [min(vals) for vals in zip(*(sec[n] for n in live_torch), strict=True)]
    out["llama_tokens_vs_pytorch"] = ratio_stats(best, sec["jaxstep"])
    out["llama_tokens_per_s"] = ratio_stats([tokens / s for s in sec["jaxstep"]], 1)
    for n in live_torch:
      out[f"llama_tokens_vs_{n}"] = ratio_stats(sec[n], sec["jaxstep"])
      rows.append(
        (
          f"Llama fine-tuning tokens/s ÷ transformers LlamaForCausalLM, {n[6:]}",
          fmt(out[f"llama_tokens_vs_{n}"]),
          "",
        )
      )
    rows.append(
      (
        f"Llama fine-tuning tokens/s ÷ fastest PyTorch each round ({shape_txt}; jaxstep "
        f"{out['llama_tokens_per_s']['median']:,.0f} tokens/s)",
        fmt(out["llama_tokens_vs_pytorch"]),
        "≥ 1.3",
      )
    )
    summary["llama_tokens_vs_pytorch"] = out["llama_tokens_vs_pytorch"]["median"]

  # decoding
  rate = {
    n: [r["new_tokens_per_s"] for r in rounds_]
    for n, rounds_ in res.items()
    if n.startswith("decode")
  }
  for b in batches:
    jax_name, hf_name = f"decode_jax_b{b}", f"decode_hf_b{b}"
    if jax_name in rate and hf_name in rate:
      vs = ratio_stats(rate[jax_name], rate[hf_name])
      out[f"llama_decode_vs_hf_b{b}"] = vs
      summary[f"llama_decode_vs_hf_b{b}"] = vs["median"]
      tps = {n: ratio_stats(rate[n], 1)["median"] for n in (jax_name, hf_name)}
      rows.append(
        (
          f"Llama new tokens/s ÷ transformers generate ({b} prompt(s) of {prompt_len}, {new} new; "
          f"{tps[jax_name]:,.0f} vs {tps[hf_name]:,.0f} tokens/s)",
          fmt(vs),
          "≥ 1.5",
        )
      )
  per_b = [
    summary[f"llama_decode_vs_hf_b{b}"] for b in batches if f"llama_decode_vs_hf_b{b}" in summary
  ]
  if per_b:
    summary["llama_decode_vs_hf"] = min(per_b)
  for name in failed:
    rows.append((name, "did not run here (see `failed` in hf.json)", ""))
  return {**out, "summary": summary, "rows": rows}


if (
  __name__ == "__main__"
):  # one load in this fresh interpreter: python -m benchmarks.hf_bench NAME PATH
  import sys

  name, arg = sys.argv[1:]
  out = make_folder(json.loads(arg)) if name == "folder" else LOADERS[name](arg)
  print(json.dumps(out), flush=True)
