"""Evaluation: lm-evaluation-harness requests/s of ``--model jaxstep`` against the harness's
own ``--model hf`` on one local multiple-choice task and one model folder, and the
perplexity of a SmolLM2-shaped folder at its context, jaxstep ``evaluate`` against
transformers on the same windows.

Both harness contenders answer the same ``loglikelihood`` requests (the task's, built once by
the harness in each worker), at the same batch size, after a warm-up pass (jaxstep's compiles
happen there); a round times one pass over all of them. The task is HellaSwag-shaped: a
context of 30–60 words and four endings of 4–12 words each, so no request's continuation is
a single token (the HF model's one-token cache does not apply; nor does it to HellaSwag).

The folders are random-weight (no download here): the harness model is a 4-block Llama of
width 256; the perplexity one has SmolLM2-135M's shapes (30 blocks of width 576, 9 heads, 3
kv heads, 8192 positions, tied embeddings) with a BPE trained on the text scored, which is
the GNU GPL v3 (``/usr/share/common-licenses/GPL-3`` on Debian, else the bundled corpus).
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import shutil
import tempfile
import time

WORDS = (
  "the a man woman dog cat park ball runs walks throws picks up puts down then after "
  "before while slowly quickly into onto over under near far red blue green small large "
  "kitchen garden street table chair window door car bike river hill house"
).split()
HARNESS_SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                 "num_attention_heads": 8, "num_key_value_heads": 4}  # fmt: skip
QUICK_SHAPE = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
               "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3,
                 "max_position_embeddings": 8192, "tie_word_embeddings": True,
                 "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "vocab_size": 49152}  # fmt: skip
LICENCE = pathlib.Path("/usr/share/common-licenses/GPL-3")


def _tokenizer(texts, vocab: int):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|endoftext|>"]
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
  tok.train_from_iterator(texts, trainer=trainer)
  bos = (specials[0], tok.token_to_id(specials[0]))
  tok.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
  return tok, [tok.token_to_id(s) for s in specials]


def random_llama(path: pathlib.Path, texts, shape: dict, vocab: int) -> pathlib.Path:
  """A random-weight Llama folder at ``path`` with a BPE of ``vocab`` ids trained on
  ``texts`` (the model's vocabulary may be larger)."""
  import torch
  import transformers

  tok, (bos, eos, pad) = _tokenizer(texts, vocab)
  config = {"vocab_size": vocab, "max_position_embeddings": 512, **shape}  # shape may widen it
  cfg = transformers.LlamaConfig(**config, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.05)
  model.eval().save_pretrained(path)
  tok.save(str(path / "tokenizer.json"))
  specials = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "pad_token": "<|endoftext|>",
    "tokenizer_class": "PreTrainedTokenizerFast",
  }
  (path / "tokenizer_config.json").write_text(json.dumps(specials))
  return path


def mc_task(root: pathlib.Path, items: int) -> pathlib.Path:
  """``root/tasks/bench_mc.yaml`` over ``root/mc.jsonl``: HellaSwag-shaped items."""
  rng = random.Random(0)

  def words(lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

  rows = [{"ctx": words(30, 60), "endings": [words(4, 12) for _ in range(4)],
           "label": rng.randrange(4)} for _ in range(items)]  # fmt: skip
  (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  tasks = root / "tasks"
  tasks.mkdir(exist_ok=True)
  (tasks / "bench_mc.yaml").write_text(
    f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
    f"    test: {root / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
    "doc_to_text: '{{ctx}}'\ndoc_to_choice: '{{endings}}'\ndoc_to_target: label\n"
    "metric_list:\n  - metric: acc\n"
  )
  return tasks


def harness_contender(spec: dict):
  """One harness model over the task's requests: ``run`` times one pass over all of them."""
  import lm_eval
  from lm_eval.tasks import TaskManager

  if spec["which"] == "jaxstep":
    from jaxstep.trainer.saved_run.harness import saved_run_model

    model = saved_run_model()(path=spec["folder"], batch_size=spec["batch"])
    model.progress = False
  else:
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=spec["folder"], dtype="float32", device="cpu", batch_size=spec["batch"])
  captured = []
  original = model.loglikelihood

  def capture(requests, disable_tqdm=False):
    captured.extend(requests)
    return original(requests, disable_tqdm=True)

  model.loglikelihood = capture
  manager = TaskManager(include_path=spec["tasks"], include_defaults=False)
  lm_eval.simple_evaluate(model=model, tasks=["bench_mc"], task_manager=manager)  # warm-up
  model.loglikelihood = original

  def run_once() -> dict:
    t = time.perf_counter()
    model.loglikelihood(captured, disable_tqdm=True)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "requests_per_s": len(captured) / seconds}

  return {"requests": len(captured)}, run_once


CONTENDERS = {"harness_model": harness_contender}


def perplexity_parity(root: pathlib.Path, quick: bool) -> dict:
  """jaxstep ``evaluate`` (one text, windows of the model's context, side by side) against
  transformers' NLL on the same windows, on a SmolLM2-shaped random folder."""
  import numpy as np
  import torch
  import transformers

  from jaxstep.trainer.saved_run import evaluate as evaluation
  from jaxstep.trainer.saved_run.load import load_run

  bundled = pathlib.Path(__file__).resolve().parent.parent / "jaxstep/data/corpus/text.txt"
  text = (LICENCE if LICENCE.is_file() else bundled).read_text()
  text = text[:4000] if quick else text
  shape = QUICK_SHAPE if quick else SMOLLM2_SHAPE
  window = 64 if quick else 2048
  shape = {
    **shape,
    "max_position_embeddings": window * 4,
    "vocab_size": shape.get("vocab_size", 512),
  }
  folder = random_llama(root / "smollm2", [text], shape, 512 if quick else 4096)
  (root / "text.txt").write_text(text)
  saved = load_run(folder)
  t = time.perf_counter()
  dataset = evaluation.load_data(saved, folder, str(root / "text.txt"), "file", window)
  ours = evaluation.evaluate(saved, dataset, batch_size=1)
  ours_s = time.perf_counter() - t
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  ids = np.asarray(dataset.train.stream.read(0, len(dataset.train.stream))[0])
  nll, count, t = 0.0, 0, time.perf_counter()
  with torch.no_grad():
    for start in range(0, len(ids) - 1, window):
      chunk = torch.tensor(ids[start : start + window + 1], dtype=torch.long)[None]
      logits = model(chunk[:, :-1]).logits.double()
      nll += float(torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum"))
      count += chunk.shape[1] - 1
  theirs_s = time.perf_counter() - t
  ppl_ours, ppl_theirs = ours["ppl"], math.exp(nll / count)
  return {
    "tokens": ours["tokens"], "hf_tokens": count, "window": window,
    "ppl_jaxstep": ppl_ours, "ppl_transformers": ppl_theirs,
    "relative_difference": abs(ppl_ours / ppl_theirs - 1),
    "seconds_jaxstep": ours_s, "seconds_transformers": theirs_s,
  }  # fmt: skip


def suite_eval(quick: bool) -> dict:
  """Harness requests/s against ``--model hf``; a SmolLM2-shaped folder's perplexity against
  transformers."""
  from benchmarks.harness import fmt, measure, ratio_stats

  root = pathlib.Path(tempfile.mkdtemp(prefix="jaxstep-eval-bench-"))
  try:
    texts = [" ".join(WORDS)] * 8
    shape = QUICK_SHAPE if quick else HARNESS_SHAPE
    folder = random_llama(root / "llama", texts, shape, 320)
    tasks = mc_task(root, 8 if quick else 100)
    base = {"kind": "harness_model", "folder": str(folder), "tasks": str(tasks), "batch": 16}
    specs = {w: {**base, "which": w} for w in ("jaxstep", "hf")}
    res, info, failed = measure(specs, rounds=1 if quick else 5)
    rate = {n: [r["requests_per_s"] for r in rounds] for n, rounds in res.items()}
    vs = ratio_stats(rate["jaxstep"], rate["hf"])
    parity = perplexity_parity(root, quick)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  requests = info["jaxstep"]["requests"]
  rows = [
    (f"lm-evaluation-harness loglikelihood requests/s, jaxstep ÷ --model hf ({requests} "
     f"requests, batch 16, CPU)", fmt(vs), "≥ 1.5"),
    (f"perplexity of a SmolLM2-shaped folder at {parity['window']} tokens, jaxstep ÷ "
     f"transformers, distance from 1", f"{parity['relative_difference']:.2e}", "≤ 0.005"),
  ]  # fmt: skip
  summary = {
    "harness_vs_hf_requests_per_s": vs["median"],
    "harness_requests_per_s": float(sorted(rate["jaxstep"])[len(rate["jaxstep"]) // 2]),
    "folder_ppl_vs_transformers_rel_diff": parity["relative_difference"],
  }
  return {"raw": res, "info": info, "failed": failed, "harness_vs_hf": vs,
          "perplexity": parity, "rows": rows, "summary": summary}  # fmt: skip
