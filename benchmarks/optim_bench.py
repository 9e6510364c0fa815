"""The optimizers' state, from their own abstract states (nothing allocated, nothing run):
per-parameter bytes of each ``optim.name`` on a Llama-shaped model. Headline key:
``adafactor_state_over_adamw`` (goal ≤ 0.1).

``STATE_MODEL`` (``tensor_bench``'s: d 1,024, 8 blocks, 16 / 8 heads, SwiGLU 2,816,
vocabulary 32,000, untied). Each optimizer is ``jaxstep.core.optim.make_optimizer`` with the
defaults of ``OptimConfig`` and only its name changed, its state's shapes from
``jax.eval_shape`` of its ``init``.
"""

from __future__ import annotations

import math

from benchmarks.tensor_bench import QUICK_STATE_MODEL, STATE_MODEL


def state_bytes(model: dict) -> dict:
  import jax

  from jaxstep import models
  from jaxstep.core.optim import OPTIMIZERS, OptimConfig, make_optimizer

  keys = ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads")
  cfg = models.LlamaConfig(
    **{k: model[k] for k in keys}, intermediate_size=model["intermediate_size"]
  )
  _, params = models.build(cfg, 0, abstract=True)
  size = lambda tree: sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  out = {"params": size(params)}
  for name in OPTIMIZERS:
    init = make_optimizer(OptimConfig(name=name), 100).init
    out[name] = size(jax.eval_shape(init, params))
  return out


def suite_optim(quick: bool) -> dict:
  model = QUICK_STATE_MODEL if quick else STATE_MODEL
  b = state_bytes(model)
  ratio = b["adafactor"] / b["adamw"]
  mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
  per = ", ".join(
    f"{n} {b[n] / b['params']:.3f}" for n in ("adamw", "muon", "lion", "sgd", "adafactor")
  )
  rows = [
    (
      f"optimizer state bytes, Adafactor ÷ AdamW (Llama d {model['d_model']}, "
      f"{model['n_layers']} blocks, vocab {model['vocab_size']:,}; {mib(b['adafactor'])} vs "
      f"{mib(b['adamw'])}; state ÷ params: {per})",
      f"{ratio:.4f}",
      "≤ 0.1",
    )
  ]
  return {
    "model": model,
    "bytes": b,
    "rows": rows,
    "summary": {"adafactor_state_over_adamw": ratio},
  }
