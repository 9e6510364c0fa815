"""Peak RSS of a whole LoRA run, jaxstep against PEFT + transformers and TRL (benchmark-only).

The job: a 135 M-parameter Llama folder of SmolLM2-135M's shape (``FOLDER``: d 576, 30
layers, 9 query / 3 key-value heads, SwiGLU 1536, vocabulary 49,152, tied embeddings),
random fp32 weights written by ``save_pretrained`` with a tiny byte-level BPE (``hf_load``'s
``make_folder``, kept under the temporary folder); LoRA rank 8, alpha 16 on every
projection (q, k, v, o, gate, up, down), fp32, 128 tokens per sequence, a global batch of 8
(K = 1), ``STEPS`` updates of AdamW.

- SFT: ``jaxstep train`` on a text file of random sentences (packed into 129-token windows)
  against transformers' ``Trainer`` on a PEFT model (``get_peft_model``), the same text
  tokenized with the folder's tokenizer and cut into 128-token blocks.
- DPO: ``jaxstep train preference.loss=dpo`` on a JSONL of string pairs (prompt ~55 tokens,
  completions ~60, nothing truncated) against TRL's ``DPOTrainer`` with ``peft_config``: in
  both the reference is the base with the adapters switched off.

Every run is its own process, started from nothing (interpreter, imports, reading the
folder, compiling or not, training, the final save, exit). Its peak RSS is the kernel's
``ru_maxrss`` of that one child (``os.wait4``); the parent also samples ``/proc/PID/status``
every 20 ms (``VmRSS``, ``RssAnon``, ``RssFile``) and stamps each line the child prints
with the RSS at that moment, which places the peak in a phase of the run. jaxstep runs as
the CLI does by default on this host (its CPU split into devices, trackers as configured),
plus the variants of ``JAX_VARIANTS`` that show where its memory goes.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import threading
import time

FOLDER = {  # transformers.LlamaConfig keys: SmolLM2-135M's shape
  "vocab_size": 49152,
  "hidden_size": 576,
  "intermediate_size": 1536,
  "num_hidden_layers": 30,
  "num_attention_heads": 9,
  "num_key_value_heads": 3,
  "max_position_embeddings": 2048,
  "tie_word_embeddings": True,
}
QUICK_FOLDER = {**FOLDER, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64}
QUICK_FOLDER |= {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
SEQ, BATCH, STEPS, RANK, ALPHA = 128, 8, 3, 8, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORDS = "the cat sat on the mat a quick fox jumped over it".split()  # the BPE's own words
# jaxstep settings that move its peak, each run as one more contender of both jobs (the
# default for a folder under LoRA: scanned blocks with remat)
JAX_VARIANTS = {
  "two_devices": ["mesh.cpu_devices=2"],  # the CPU split a frozen base no longer gets
  "no_remat": ["model.remat=none"],  # scanned, every activation kept
  "unrolled": ["model.scan_layers=false", "model.remat=none"],  # as a from-scratch run walks
}


def _sentence(rng: random.Random, words: int) -> str:
  return " ".join(rng.choice(WORDS) for _ in range(words))


def write_data(out: pathlib.Path, steps: int = STEPS) -> dict:
  """``{"text": path, "pairs": path, "steps": steps}``: documents of random words (separated
  by blank lines) for SFT, and string pairs (prompt 50 words, chosen and rejected 55 each)
  for DPO; enough for ``steps`` global batches of ``BATCH`` and then some."""
  rng = random.Random(0)
  text = out / "text.txt"
  text.write_text("\n\n".join(_sentence(rng, 200) for _ in range(4 * steps + 4)) + "\n")
  pairs = out / "pairs.jsonl"
  rows = [
    {"prompt": _sentence(rng, 50), "chosen": _sentence(rng, 55), "rejected": _sentence(rng, 55)}
    for _ in range(BATCH * steps)
  ]
  pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return {"text": str(text), "pairs": str(pairs), "steps": steps}


# ---------------------------------------------------------------------------- the runs


def jaxstep_command(
  folder: str, data: dict, job: str, run_dir: str, extra=(), lora: bool = True
) -> list[str]:
  """``python -m jaxstep train …`` of ``job`` (``sft`` or ``dpo``), LoRA on the folder (or
  every weight trained: ``lora=False``)."""
  args = [f"model.init_from={folder}"]
  args += [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}"] if lora else []
  args += [
    f"train.seq_len={SEQ}",
    f"train.global_batch_size={BATCH}",
    "train.grad_accum_steps=1",
    f"train.max_steps={data['steps']}",
    "train.log_every=1",
    "train.progress=false",
    "data.eval_fraction=0",
    "optim.warmup_steps=0",
    f"run_dir={run_dir}",
  ]
  if job == "dpo":
    args += [f"data.path={data['pairs']}", "preference.loss=dpo", "preference.beta=0.1"]
  else:
    args += [f"data.path={data['text']}"]
  return [sys.executable, "-m", "jaxstep", "train", *args, *extra]


def _lora_config():
  from peft import LoraConfig

  return LoraConfig(
    r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
  )


def peft_sft(folder: str, data: dict, out: str) -> None:
  """transformers ``Trainer`` on ``get_peft_model`` of the folder: the text tokenized with
  the folder's tokenizer, cut into ``SEQ``-token blocks, ``STEPS`` updates of ``BATCH``."""
  import torch
  from datasets import Dataset
  from peft import get_peft_model
  from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

  tok = AutoTokenizer.from_pretrained(folder)
  ids = tok(pathlib.Path(data["text"]).read_text())["input_ids"]
  blocks = [ids[i : i + SEQ] for i in range(0, len(ids) - SEQ, SEQ)][: BATCH * data["steps"]]
  rows = Dataset.from_dict({"input_ids": blocks, "labels": blocks})
  model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  model = get_peft_model(model, _lora_config())
  args = TrainingArguments(
    out, per_device_train_batch_size=BATCH, max_steps=data["steps"], **_common_args(out)
  )
  Trainer(model=model, args=args, train_dataset=rows).train()


def trl_dpo(folder: str, data: dict, out: str, peft: bool = True) -> None:
  """TRL's ``DPOTrainer`` with ``peft_config`` (the reference: the base, adapters off) on the
  same pairs, ``STEPS`` updates of ``BATCH`` pairs; ``peft=False``: every weight trained,
  against the frozen copy of the start that TRL makes as its reference model."""
  import torch
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoTokenizer
  from trl import DPOConfig, DPOTrainer

  tok = AutoTokenizer.from_pretrained(folder)
  rows = [json.loads(line) for line in pathlib.Path(data["pairs"]).read_text().splitlines()]
  model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  args = DPOConfig(
    out,
    per_device_train_batch_size=BATCH,
    max_steps=data["steps"],
    beta=0.1,
    **_common_args(out),
  )
  DPOTrainer(
    model=model,
    args=args,
    train_dataset=Dataset.from_list(rows),
    processing_class=tok,
    peft_config=_lora_config() if peft else None,
  ).train()


def _common_args(out: str) -> dict:
  """The Trainer arguments of both torch runs: fp32 on the CPU, no reporting, no saves
  until the end, one log line per step (as jaxstep's ``train.log_every=1``)."""
  return dict(
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    logging_steps=1,
    learning_rate=1e-3,
    warmup_steps=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
  )


RUNNERS = {
  "peft_sft": peft_sft,
  "trl_dpo": trl_dpo,
  "trl_dpo_full": lambda folder, data, out: trl_dpo(folder, data, out, peft=False),
}


# ---------------------------------------------------------------------------- measuring


def _rss_kib(pid: int) -> tuple[int, int, int] | None:
  """``(VmRSS, RssAnon, RssFile)`` of ``pid`` in KiB, or None once it is gone."""
  try:
    with open(f"/proc/{pid}/status") as f:
      fields = dict(line.split(":", 1) for line in f if ":" in line)
    return tuple(int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssFile"))
  except (OSError, KeyError, ValueError):
    return None


def measured(cmd: list[str], env: dict | None = None, every_s: float = 0.02) -> dict:
  """Runs ``cmd`` to its end and returns its peak RSS: ``peak_bytes`` from the kernel
  (``ru_maxrss`` of this one child, ``os.wait4``), ``sampled_peak_bytes`` and
  ``anon_peak_bytes`` from ``/proc`` every ``every_s``, ``seconds``, and ``lines``: each
  line it printed with the seconds since the start and the sampled RSS then (MiB)."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(
    cmd,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env={**os.environ, **(env or {})},
    cwd=pathlib.Path(__file__).resolve().parent.parent,
  )
  now = {"rss": (0, 0, 0)}
  peaks = {"rss": 0, "anon": 0, "rss_at": 0.0}
  lines, timeline = [], []  # timeline: [seconds, VmRSS MiB] at most every 0.25 s
  stop = threading.Event()

  def sample():
    while not stop.wait(every_s):
      got = _rss_kib(proc.pid)
      if got:
        now["rss"] = got
        if got[0] > peaks["rss"]:
          peaks.update(rss=got[0], rss_at=time.perf_counter() - t0)
        peaks["anon"] = max(peaks["anon"], got[1])
        at = time.perf_counter() - t0
        if not timeline or at - timeline[-1][0] >= 0.25:
          timeline.append([round(at, 2), got[0] >> 10])

  def read():
    for line in proc.stdout:
      rss = now["rss"]
      lines.append([round(time.perf_counter() - t0, 2), rss[0] >> 10, rss[1] >> 10, line.rstrip()])

  threads = [threading.Thread(target=f, daemon=True) for f in (sample, read)]
  for th in threads:
    th.start()
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  seconds = time.perf_counter() - t0
  stop.set()
  for th in threads:
    th.join()
  if proc.returncode:
    tail = "\n".join(line[-1] for line in lines[-30:])
    raise RuntimeError(f"{' '.join(cmd[:4])} … exited with {proc.returncode}:\n{tail}")
  return {
    "peak_bytes": usage.ru_maxrss * 1024,
    "sampled_peak_bytes": peaks["rss"] * 1024,
    "sampled_peak_at_s": peaks["rss_at"],
    "anon_peak_bytes": peaks["anon"] * 1024,
    "seconds": seconds,
    "lines": lines,
    "timeline": timeline,
  }


def run_all(
  folder: str, names: list[str], rounds: int, steps: int = STEPS, seed: int = 0
) -> dict[str, list]:
  """``rounds`` rounds of every run named (``jax_sft``, ``jax_dpo``, ``jax_<job>_<variant>``
  of ``JAX_VARIANTS``, ``peft_sft``, ``trl_dpo``) of ``steps`` updates, each in a fresh
  process, in a fresh random order each round."""
  rng = random.Random(seed)
  results = {name: [] for name in names}
  with tempfile.TemporaryDirectory(prefix="jaxstep-bench-rss-") as tmp:
    data = write_data(pathlib.Path(tmp), steps)
    for r in range(rounds):
      order = list(names)
      rng.shuffle(order)
      for name in order:
        out = str(pathlib.Path(tmp) / f"{name}-{r}")
        if name.startswith("jax_"):  # jax_JOB[_VARIANT]; the variant "full": no LoRA
          job, _, variant = name[4:].partition("_")
          extra, lora = JAX_VARIANTS.get(variant, ()), variant != "full"
          cmd = jaxstep_command(folder, data, job, out, extra, lora=lora)
        else:
          cmd = [sys.executable, "-m", "benchmarks.preference_rss", name, folder, json.dumps(data)]
          cmd.append(out)
        results[name].append(measured(cmd))
  return results


if __name__ == "__main__":  # one torch run in this fresh interpreter: NAME FOLDER DATA OUT
  name, folder, data, out = sys.argv[1:]
  RUNNERS[name](folder, json.loads(data), out)
