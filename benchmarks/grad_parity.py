"""A DPO update's gradient, tensor by tensor: jaxstep against PyTorch in fp32, both against
PyTorch in fp64, on a local Hugging Face Llama-family folder (benchmark-only: imports torch
and transformers).

    python -m benchmarks.grad_parity [FOLDER] [--pairs 8] [--seq-len 96]

Without a folder: a SmolLM2-135M-shaped one (d 576, 30 blocks, 9 / 3 heads, SwiGLU 1,536,
vocabulary 49,152, tied head; random weights from ``LlamaForCausalLM(config)``, written once
under the temporary dir).

The loss is DPO's at its first update, where the policy is the reference: ``−log σ(β·(Δ −
Δ_ref))`` has the gradient ``−(β/2)·∇Δ`` there, ``Δ = log π(chosen) − log π(rejected)``
(sums over each completion's tokens), averaged over the pairs: the gradient TRL's
DPOTrainer and jaxstep take first. ``pairs`` pairs of random ids (seeded), prompts of 10–29
ids, sequences of 40 to ``seq_len`` ids, right-padded.

Printed (and written to ``benchmarks/results/grad_parity.json``): each side's gradient
against fp64 (relative distance of the whole gradient and the worst tensors), and the
global norm four ways: jaxstep's (``optax.tree.norm``, as the step logs and clips it),
``torch.nn.utils.clip_grad_norm_`` of PyTorch's fp32 gradient (what the HF Trainer, and so
TRL, logs and clips by), that same gradient's norm summed in fp64, and fp64's own. The
question it answers: when the logged norms differ, is it the gradient or the norm.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import pathlib
import tempfile

import numpy as np

from benchmarks.eval_bench import SMOLLM2_SHAPE
from benchmarks.harness import RESULTS, environment, write

# SmolLM2-135M(-Instruct)'s transformers.LlamaConfig keys, with its initializer range
SMOLLM2_135M = {**SMOLLM2_SHAPE, "initializer_range": 0.041666666666666664}
BETA = 0.1


def default_folder() -> pathlib.Path:
  """The SmolLM2-135M-shaped random folder, written once (keyed by its config)."""
  import torch
  import transformers

  key = hashlib.sha256(json.dumps([SMOLLM2_135M, transformers.__version__]).encode())
  folder = pathlib.Path(tempfile.gettempdir()) / "jaxstep-bench-hf" / key.hexdigest()[:12]
  if not (folder / "complete").exists():  # written last: a folder cut short is made again
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_135M))
    model.save_pretrained(folder)
    (folder / "complete").touch()
  return folder


@contextlib.contextmanager
def all_in(model, dtype):
  """transformers' modeling code computes RMSNorm, the attention softmax and the RoPE
  angles in fp32 whatever the model's dtype: here every ``*RMSNorm`` and default
  ``*RotaryEmbedding`` class among ``model``'s modules computes in ``dtype`` instead (the
  inverse frequencies too), so an fp64 model is fp64 throughout (attention through SDPA,
  which keeps its inputs' dtype). A model without both is refused."""
  import torch

  def norm(self, h):
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

  def rotary(self, x, position_ids):
    dim = 2 * self.inv_freq.shape[0]
    base = self.config.rope_parameters["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    emb = position_ids[..., None].to(dtype) * inv
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

  patched = {}
  for cls in {type(m) for m in model.modules()}:
    if cls.__name__.endswith("RMSNorm"):
      patched[cls] = cls.forward
      cls.forward = norm
    elif cls.__name__.endswith("RotaryEmbedding"):
      patched[cls] = cls.forward
      cls.forward = rotary
  kinds = {k for k in ("RMSNorm", "RotaryEmbedding") for c in patched if c.__name__.endswith(k)}
  if len(kinds) < 2:
    raise SystemExit(f"{type(model).__name__}: no RMSNorm or RotaryEmbedding to compute in fp64")
  try:
    yield
  finally:
    for cls, forward in patched.items():
      cls.forward = forward


def pairs_batch(pairs: int, seq_len: int, vocab: int, seed: int = 0):
  """``ids int[2P, S + 1]`` (rows 2i chosen, 2i + 1 rejected), the completions' loss mask
  ``float32[2P, S]`` over targets, and each row's sign in Δ (+1 chosen, −1 rejected)."""
  rng = np.random.default_rng(seed)
  rows = 2 * pairs
  lengths = rng.integers(40, seq_len + 1, size=rows)
  prompts = rng.integers(10, 30, size=rows)
  ids = rng.integers(3, vocab, size=(rows, seq_len + 1))
  mask = np.zeros((rows, seq_len), np.float32)
  for i in range(rows):
    ids[i, lengths[i] + 1 :] = 0
    mask[i, prompts[i] : lengths[i]] = 1
  sign = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0).astype(np.float32)
  return ids, mask, sign


def torch_grads(folder, ids, mask, sign, dtype: str) -> tuple[dict, float]:
  """PyTorch's gradient (SDPA attention, transformers' default; ``dtype``) by HF name, and
  its clip_grad_norm_."""
  import torch
  import transformers

  td = getattr(torch, dtype)
  exact = dtype == "float64"
  model = transformers.AutoModelForCausalLM.from_pretrained(
    folder, torch_dtype=td, attn_implementation="sdpa"
  )
  rope = model.config.rope_parameters or {}
  if exact and rope.get("rope_type", "default") != "default":
    raise SystemExit(f"{folder}: the fp64 reference computes default RoPE only, not {rope}")
  model.train()
  with all_in(model, td) if exact else contextlib.nullcontext():
    logits = model(input_ids=torch.tensor(ids[:, :-1])).logits
  logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[:, 1:])[..., None])[..., 0]
  delta = (torch.tensor(sign, dtype=td) * (logp * torch.tensor(mask, dtype=td)).sum(-1)).sum()
  loss = -BETA / 2 * delta / (len(sign) // 2)
  loss.backward()
  grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
  norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
  return grads, norm


def jaxstep_grads(folder, ids, mask, sign) -> tuple[dict, float]:
  """jaxstep's gradient of the same loss (fp32, the model as it reads the folder) by HF
  name, and its global norm as the step computes it."""
  import jax
  import jax.numpy as jnp
  import optax

  from jaxstep import models
  from jaxstep.models import hf_export, hf_parity, safetensors_out

  config, params = hf_parity.read_model(pathlib.Path(folder), ids.shape[1] - 1)
  apply_fn, _ = models.build(config, 0, abstract=True)

  def loss_fn(params):
    logits = apply_fn(params, jnp.asarray(ids[:, :-1])).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    logp = jnp.take_along_axis(logp, jnp.asarray(ids[:, 1:])[..., None], -1)[..., 0]
    delta = jnp.sum(sign * jnp.sum(logp * mask, -1))
    return -BETA / 2 * delta / (len(sign) // 2)

  with jax.default_matmul_precision("highest"):
    grads = jax.jit(jax.grad(loss_fn))(jax.tree.map(jnp.asarray, params))
  tensors = hf_export.tensors_of(config, grads)
  return {t.name: safetensors_out.host(t, np.float32) for t in tensors}, float(
    optax.tree.norm(grads)
  )


def compare(ours: dict, theirs: dict, exact: dict) -> dict:
  """Each side's distance to fp64 (whole gradient, and the worst tensors), and the norms."""
  names = sorted(exact)
  if set(ours) != set(names) or set(theirs) != set(names):
    differ = sorted((set(ours) | set(theirs)) ^ set(names))
    raise SystemExit(f"jaxstep's and PyTorch's tensors differ: {differ[:5]}")

  def distance(side: dict) -> tuple[float, list]:
    per = {n: np.linalg.norm(side[n] - exact[n]) / np.linalg.norm(exact[n]) for n in names}
    worst = sorted(per.items(), key=lambda kv: -kv[1])[:3]
    total = np.sqrt(sum(np.sum((side[n] - exact[n]) ** 2) for n in names))
    return float(total / fp64_norm(exact)), [(n, float(e)) for n, e in worst]

  return {"jaxstep": distance(ours), "torch_fp32": distance(theirs)}


def fp64_norm(grads: dict) -> float:
  return float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads.values())))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("folder", nargs="?", help="a local HF Llama-family folder")
  parser.add_argument("--pairs", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=96)
  parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder")
  args = parser.parse_args(argv)
  folder = pathlib.Path(args.folder) if args.folder else default_folder()
  vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
  batch = pairs_batch(args.pairs, args.seq_len, vocab)
  exact, exact_norm = torch_grads(folder, *batch, "float64")
  theirs, torch_norm = torch_grads(folder, *batch, "float32")
  ours, our_norm = jaxstep_grads(folder, *batch)
  truth = fp64_norm(exact)
  result = {
    "folder": str(folder),
    "pairs": args.pairs,
    "seq_len": args.seq_len,
    "norm_fp64": truth,
    "norm_jaxstep": our_norm,
    "norm_torch_clip_grad_norm": torch_norm,
    "norm_torch_grads_summed_in_fp64": fp64_norm(theirs),
    "distance_to_fp64": compare(ours, theirs, exact),
  }
  rel = lambda v: (v - truth) / truth  # noqa: E731
  print(f"global norm, fp64: {truth:.7f} (torch fp64's clip_grad_norm_ {exact_norm:.7f})")
  print(f"  jaxstep (optax.tree.norm):         {our_norm:.7f} ({rel(our_norm):+.1e})")
  print(f"  torch fp32, clip_grad_norm_:       {torch_norm:.7f} ({rel(torch_norm):+.1e})")
  theirs_norm = result["norm_torch_grads_summed_in_fp64"]
  print(f"  torch fp32's gradient, fp64 sum:   {theirs_norm:.7f} ({rel(theirs_norm):+.1e})")
  for side, (total, worst) in result["distance_to_fp64"].items():
    tensors = ", ".join(f"{n} {e:.1e}" for n, e in worst)
    print(f"{side} gradient vs fp64: {total:.1e} of the norm; worst tensors: {tensors}")
  path = write("grad_parity", {"environment": environment(), "rows": [result]}, args.out or RESULTS)
  print(f"wrote {path}")
  return result


if __name__ == "__main__":
  main()
