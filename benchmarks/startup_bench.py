"""Starting again: a second identical command against the first, each a whole process, with
the commands' persistent compilation cache (``jaxstep.cli.compile_cache``) empty before the
first and kept for the second.

Three commands, each round in a fresh cache folder (``JAXSTEP_XLA_CACHE``): ``jaxstep
harness`` on three small local tasks (20 documents each) of a SmolLM2-shaped random-weight
folder (``eval_bench.SMOLLM2_SHAPE``: 30 blocks of width 576; no download here), ``jaxstep
evaluate`` of that folder on a text, and ``jaxstep train`` of the bundled tiny config for S
update steps and then resumed for S more. A round's ratio is the second process's wall
seconds over the first's; the suite reports the median over rounds. The smoke run
(``--quick``) leaves ``evaluate`` out.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.eval_bench import QUICK_SHAPE, SMOLLM2_SHAPE, WORDS, random_llama

TASKS = ("startup_a", "startup_b", "startup_c")


def local_tasks(root: pathlib.Path, documents: int) -> pathlib.Path:
  """``root/tasks``: three multiple-choice tasks over ``documents`` rows each (a context of
  20-40 words, four endings of 3-8), local files only."""
  tasks = root / "tasks"
  tasks.mkdir()
  for seed, name in enumerate(TASKS):
    rng = random.Random(seed)
    words = lambda lo, hi, rng=rng: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    rows = [{"ctx": words(20, 40), "endings": [words(3, 8) for _ in range(4)],
             "label": rng.randrange(4)} for _ in range(documents)]  # fmt: skip
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / f"{name}.yaml").write_text(
      f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
      "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{ctx}}'\n"
      "doc_to_choice: '{{endings}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
  return tasks


def _seconds(argv: list[str], cache: pathlib.Path) -> float:
  """Wall seconds of ``python -m jaxstep ARGV`` with its compilation cache in ``cache``."""
  drop = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT", "JAX_ENABLE_COMPILATION_CACHE")
  env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
  env.update(JAXSTEP_XLA_CACHE=str(cache), JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1")
  t = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "jaxstep", *argv], env=env, capture_output=True)
  seconds = time.perf_counter() - t
  if proc.returncode:
    raise RuntimeError(f"jaxstep {argv[0]} failed: {proc.stderr.decode()[-2000:]}")
  return seconds


def commands(root: pathlib.Path, quick: bool) -> dict[str, list[list[str]]]:
  """Each measured command as its two invocations (the first, then the second start)."""
  text = " ".join(WORDS)
  shape = QUICK_SHAPE if quick else SMOLLM2_SHAPE
  shape = {**shape, "max_position_embeddings": 512, "vocab_size": shape.get("vocab_size", 512)}
  folder = random_llama(root / "smollm2", [text] * 8, shape, 512)
  tasks = local_tasks(root, 20)
  (root / "text.txt").write_text((text + "\n") * (8 if quick else 200))
  harness = ["harness", "--model_args", f"path={folder}", "--tasks", ",".join(TASKS),
             "--include_path", str(tasks)]  # fmt: skip
  evaluate = ["evaluate", str(folder), "--data", str(root / "text.txt"), "--seq-len", "256"]
  steps = 10 if quick else 100
  run = root / "run"
  train = ["train", "--config", "tiny", f"run_dir={run}", "train.progress=false",
           f"train.schedule_steps={2 * steps}"]  # fmt: skip
  plan = {
    "harness": [harness, harness],
    "evaluate": [evaluate, evaluate],
    "train": [[*train, f"train.max_steps={steps}"], [*train, f"train.max_steps={2 * steps}"]],
  }
  if quick:  # the smoke run: evaluate's pair times what harness's does, a process twice
    del plan["evaluate"]
  return plan


def suite_startup(quick: bool) -> dict:
  """``second_start_over_first`` for the harness, evaluate, and a resumed train."""
  import numpy as np

  root = pathlib.Path(tempfile.mkdtemp(prefix="jaxstep-startup-bench-"))
  raw: dict[str, list[dict]] = {}
  try:
    plan = commands(root, quick)
    for r in range(1 if quick else 3):
      for name, (first, second) in plan.items():  # interleaved: each round every command
        cache = root / f"cache-{r}-{name}"
        shutil.rmtree(root / "run", ignore_errors=True)
        a, b = _seconds(first, cache), _seconds(second, cache)
        raw.setdefault(name, []).append({"first_s": a, "second_s": b, "ratio": b / a})
  finally:
    shutil.rmtree(root, ignore_errors=True)
  median = {n: float(np.median([x["ratio"] for x in rounds])) for n, rounds in raw.items()}
  what = {"harness": "jaxstep harness, 3 local tasks × 20 documents, SmolLM2-shaped folder",
          "evaluate": "jaxstep evaluate of that folder on a text",
          "train": "jaxstep train of the tiny config, resumed for as many steps again"}  # fmt: skip
  rows = [(f"{what[n]}: second start ÷ first, whole process", f"{median[n]:.2f}",
           "≤ 0.5" if n == "harness" else "< 1") for n in raw]  # fmt: skip
  keys = {"harness": "second_start_over_first", "evaluate": "evaluate_second_start_over_first",
          "train": "train_resume_over_first"}  # fmt: skip
  summary = {keys[n]: median[n] for n in raw}
  return {"raw": raw, "rows": rows, "summary": summary, "failed": {}}
