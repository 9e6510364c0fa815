"""Expert specialization at toy scale: the global against the per-micro-batch
load-balancing loss, on a mixture of two very different bundled corpora.

``python -m benchmarks.moe_specialization [--quick]`` trains the same small MoE (byte-level,
8 experts top-2 in each of 2 layers) on sums (``12 + 5 = 17``) and prose (``the cat sees
the dog.``) from the bundled corpus, every micro-batch drawn from ONE domain (micro-batches
0 and 2 of an update sums, 1 and 3 prose: what a data loader that does not shuffle across
sources hands a step), with ``lbl_scope`` global and micro_batch, 3 seeds each, and reports
on held-out windows of each domain:

- the held-out loss (nats per byte, mean of the two domains);
- the mutual information between the domain and the routed expert (bits, per MoE layer,
  averaged over layers; 0: both domains use the experts alike, 1: each domain has experts
  of its own), from the top-k assignments of every held-out token.

The per-micro-batch loss asks each one-domain micro-batch to spread over every expert; the
global one asks it of the update's whole batch only, so experts may specialize by domain.
Writes ``benchmarks/results/moe_specialization.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"
CORPUS = pathlib.Path(__file__).parents[1] / "jaxstep" / "data" / "corpus" / "text.txt"
SUM = re.compile(r"^\d+ [+-] \d+ = -?\d+$")


def domains(seq_len: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """``{domain: (train windows, held-out windows)}`` of ``seq_len + 1`` bytes each."""
  lines = CORPUS.read_text().splitlines()
  out = {}
  for name, keep in (("sums", SUM.match), ("prose", lambda s: s and not SUM.match(s))):
    stream = np.frombuffer(("\n".join(x for x in lines if keep(x)) + "\n").encode(), np.uint8)
    n = len(stream) // (seq_len + 1)
    windows = stream[: n * (seq_len + 1)].reshape(n, seq_len + 1).astype(np.int32)
    cut = int(n * 0.9)
    out[name] = (windows[:cut], windows[cut:])
  return out


def batch(windows: dict, rng, g: int, k: int) -> dict:
  """G rows; micro-batch j (rows j, j + K, …) all from one domain: sums for even j."""
  rows = np.empty((g, windows["sums"][0].shape[1]), np.int32)
  for j in range(k):
    train = windows["sums" if j % 2 == 0 else "prose"][0]
    rows[j::k] = train[rng.integers(0, len(train), g // k)]
  mask = np.ones((g, rows.shape[1] - 1), np.int32)
  return {"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": mask}


def mutual_information(counts: np.ndarray) -> float:
  """Bits of information the routed expert carries about the domain, from
  ``counts [domain, expert]``."""
  p = counts / counts.sum()
  outer = p.sum(1, keepdims=True) * p.sum(0, keepdims=True)
  nz = p > 0
  return float(np.sum(p[nz] * np.log2(p[nz] / outer[nz])))


def run(scope: str, seed: int, steps: int, windows: dict, size: dict) -> dict:
  import jax
  import optax

  from jaxstep import make_train_step, models
  from jaxstep.core import router_loss
  from jaxstep.core.losses import masked_nll

  cfg = models.LlamaConfig(**size, lbl_scope=scope)
  apply_fn, params = models.build(cfg, seed)
  step = make_train_step(
    router_loss.next_token_loss(apply_fn, cfg), optax.adamw(3e-3), grad_accum_steps=4
  )
  state = step.init(params, seed)
  step = jax.jit(router_loss.with_router_metrics(step, cfg, 4), donate_argnums=0)
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    state, metrics = step(state, batch(windows, rng, 16, 4))

  @jax.jit
  def held_out(params, rows):
    logits, sums = apply_fn(params, rows[:, :-1], with_routing=True)
    nll, _ = masked_nll(logits, rows[:, 1:], np.ones(rows[:, 1:].shape, np.float32))
    return nll / rows[:, 1:].size, sums["counts"]

  losses, counts = {}, {}
  for name, (_, test) in windows.items():
    loss, c = held_out(state.params, test[:64])
    losses[name], counts[name] = float(loss), np.asarray(c)
  per_layer = np.stack([counts["sums"], counts["prose"]], axis=1)  # [L, domain, E]
  return {
    "scope": scope,
    "seed": seed,
    "held_out_loss": float(np.mean(list(losses.values()))),
    "held_out_loss_by_domain": losses,
    "mutual_information_bits": float(np.mean([mutual_information(c) for c in per_layer])),
    "final_lbl": float(metrics["moe/lbl"]),
  }


SIZE = dict(
  vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4, intermediate_size=128,
  num_experts=8, experts_per_token=2, moe_intermediate_size=64, router_aux_loss=0.05,
)  # fmt: skip


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.moe_specialization")
  p.add_argument("--quick", action="store_true", help="a few steps, one seed: a smoke run")
  p.add_argument("--out", type=pathlib.Path, default=RESULTS / "moe_specialization.json")
  args = p.parse_args(argv)
  steps, seeds = (3, (0,)) if args.quick else (400, (0, 1, 2))
  windows = domains(SIZE["max_seq_len"])
  t = time.perf_counter()
  runs = [run(s, seed, steps, windows, SIZE) for seed in seeds for s in ("global", "micro_batch")]
  summary = {}
  for scope in ("global", "micro_batch"):
    mine = [r for r in runs if r["scope"] == scope]
    summary[scope] = {
      key: float(np.mean([r[key] for r in mine]))
      for key in ("held_out_loss", "mutual_information_bits", "final_lbl")
    }
  out = {"size": SIZE, "steps": steps, "seeds": list(seeds), "runs": runs, "summary": summary}
  out["seconds"] = time.perf_counter() - t
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(out, indent=1) + "\n")
  print(json.dumps(summary, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
