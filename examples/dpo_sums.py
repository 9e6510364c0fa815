"""Preference tuning end to end on the bundled sums, a few minutes on 2 CPU cores.

1. the default config's supervised run (``configs/tiny.yaml``, the bundled corpus);
2. its export as a GPT-2 folder, which a preference run starts from (``model.init_from``);
3. a LoRA DPO run on ``bundled:pairs`` (``"a + b = "``, the sum chosen, a near miss
   rejected), the exported model with its adapters off as the reference, with the chosen
   answer's NLL added (``preference.rpo_alpha``);
4. before (the exported model) and after (the DPO run), on the pairs the DPO run held out:
   the share whose chosen completion has the higher log-probability, and the share of their
   sums the greedy decode gets right.

Run: ``python examples/dpo_sums.py [OUT]`` (default ``runs/dpo-sums``); prints the report
as JSON and writes it to ``OUT/report.json``. Every step is a ``jaxstep`` command.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep import data, load_run, models
from jaxstep.cli import run as command
from jaxstep.core.preference import sequence_logps
from jaxstep.generation import Generator

SEQ_LEN, MAX_PROMPT_LEN, EVAL_FRACTION = 16, 12, 0.2  # "99 + 99 = " and BOS: 11 tokens
DPO = [
  "--config",
  "tiny",
  "data.path=bundled:pairs",
  f"data.eval_fraction={EVAL_FRACTION}",
  "preference.loss=dpo",
  "preference.beta=0.1",
  "preference.rpo_alpha=2.0",  # the chosen answer's NLL: without it DPO unlearns the format
  f"preference.max_prompt_len={MAX_PROMPT_LEN}",
  "model.lora.rank=16",
  "model.lora.alpha=32",
  f"train.seq_len={SEQ_LEN}",
  "train.global_batch_size=32",
  "train.grad_accum_steps=2",
  "train.eval_every=100",
  "train.sample_every=0",
  "optim.lr=0.003",
  "optim.warmup_steps=5",
]


def held_out_pairs(tokenizer_spec: str) -> tuple[dict, list[dict]]:
  """The pairs the DPO run holds out (the same file, tokenizer and settings it reads): one
  batch of them, and their rows."""
  from jaxstep.data.readers import BUNDLED_PATHS

  pairs = data.load_pair_dataset(
    "bundled:pairs",
    tokenizer_spec,
    seq_len=SEQ_LEN,
    max_prompt_len=MAX_PROMPT_LEN,
    eval_fraction=EVAL_FRACTION,
  )
  assert pairs.counts.dropped == 0  # kept pairs are the file's rows
  lines = BUNDLED_PATHS["bundled:pairs"].read_text().splitlines()
  held = pairs.eval
  return held.rows(np.arange(len(held)), len(held), 0), [json.loads(lines[i]) for i in held.index]


def scores(path: pathlib.Path, batch: dict, rows: list[dict]) -> dict:
  """The model at ``path`` (a run dir or a model folder) on the held-out pairs."""
  saved = load_run(path)
  apply_fn, _ = models.build(saved.cfg.model, jax.random.PRNGKey(0), abstract=True)

  def logps(side: str) -> np.ndarray:
    logits = apply_fn(saved.params, jnp.asarray(batch[f"{side}_inputs"]))
    return np.asarray(sequence_logps(logits, batch[f"{side}_targets"], batch[f"{side}_mask"])[0])

  generator = Generator(saved.cfg.model, saved.params, saved.tokenizer)
  samples = generator.generate([r["prompt"] for r in rows], max_new_tokens=4, temperature=0.0)
  right = [s.text.split("\n")[0].strip() == r["chosen"] for s, r in zip(samples, rows, strict=True)]
  return {
    "chosen_more_likely": float(np.mean(logps("chosen") > logps("rejected"))),
    "greedy_sum_right": float(np.mean(right)),
  }


def main(out: str = "runs/dpo-sums", sft_steps: int = 300, dpo_steps: int = 300) -> dict:
  out_dir = pathlib.Path(out)
  sft, folder, dpo = out_dir / "sft", out_dir / "sft-hf", out_dir / "dpo"
  assert (
    command("train", ["--config", "tiny", f"train.max_steps={sft_steps}", f"run_dir={sft}"]) == 0
  )
  if not folder.is_dir():
    assert command("export", [str(sft), "--out", str(folder)]) == 0
  args = [*DPO, f"train.max_steps={dpo_steps}", f"model.init_from={folder}", f"run_dir={dpo}"]
  assert command("train", args) == 0
  batch, rows = held_out_pairs(str(folder))
  last_eval = [json.loads(line) for line in (dpo / "eval.jsonl").read_text().splitlines()][-1]
  report = {
    "held_out_pairs": len(rows),
    "before": scores(folder, batch, rows),
    "after": scores(dpo, batch, rows),
    "after_reward_accuracy": last_eval["eval_rewards/accuracies"],
    "after_eval_loss": last_eval["eval_loss"],
  }
  (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
  print(json.dumps(report, indent=2))
  return report


if __name__ == "__main__":
  main(*sys.argv[1:])
