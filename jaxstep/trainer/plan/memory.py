"""Memory ledger: the textbook mixed-precision Adam table, jaxstep's own layout, and the
compiled step's ``memory_analysis()`` (``python -m jaxstep.memory`` prints them side by side).

Textbook (ZeRO paper) layout per parameter: fp16/bf16 params 2 B + grads 2 B + fp32 master
4 B + Adam moments 4 + 4 B = 16 B. Per device with D data-parallel ranks: ZeRO-0 16P,
ZeRO-1 (4 + 12/D)P, ZeRO-2 (2 + 14/D)P, ZeRO-3 16P/D. Activations come on top and are
not divided by D.

jaxstep's layout: fp32 params 4P/F and Adam moments 8P/F persist (F = mesh.fsdp); during an
update the fp32 gradient accumulator 4P is full-size per device, the fsdp-gathered params
add 4P when F > 1, and bf16/fp16 compute adds a 2P cast copy. With frozen parameters
(``optim.trainable``, LoRA) of T trainable ones: the trainable 4T/F, the frozen
(P − T)·b/F (b = 4, or 2 with ``optim.frozen_dtype: bf16``), Adam 8T/F and the accumulator
4T: the optimizer never sees a frozen parameter.

The ledger's prediction adds an estimate of the step's temporaries (``activation_bytes``:
activations kept for the backward pass, attention probabilities, logits, gradient buffers)
to the state, and ``python -m jaxstep.memory`` sets it beside the compiled step's own
count, so a config can be sized before a GPU is at hand and the estimate is checked on
every run of the command.
"""

from __future__ import annotations

import math

from jaxstep.core import chunked_loss
from jaxstep.core.precision import PRECISIONS
from jaxstep.errors import ConfigError


def textbook_state_bytes(num_params: int, *, zero_stage: int = 0, data_parallel: int = 1) -> int:
  """Bytes per device of the textbook 16 B/param mixed-precision Adam state under ZeRO."""
  p, d = num_params, data_parallel
  if zero_stage not in (0, 1, 2, 3) or d < 1:
    raise ConfigError(f"zero_stage must be 0-3 and data_parallel >= 1, got {zero_stage}, {d}")
  replicated, sharded = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}[zero_stage]
  return replicated * p + math.ceil(sharded * p / d)


def jaxstep_layout(
  num_params: int,
  *,
  precision: str = "fp32",
  fsdp: int = 1,
  trainable: int | None = None,
  frozen_bytes: float = 4,
) -> dict[str, int]:
  """jaxstep's bytes per device by role (persistent state, then update-time buffers);
  ``trainable``: how many of the parameters train (None: all), ``frozen_bytes`` per frozen
  parameter (4 fp32, 2 bf16; a quantized base's average, ``frozen_bytes_per_param``)."""
  p = num_params
  if trainable is None or trainable == p:
    rows = {
      "params fp32 (4P/F)": math.ceil(4 * p / fsdp),
      "Adam moments fp32 (8P/F)": math.ceil(8 * p / fsdp),
      "grad accumulator fp32 (4P, during the update)": 4 * p,
    }
    if fsdp > 1:
      rows["gathered params fp32 (4P, during the update)"] = 4 * p
    if PRECISIONS[precision] is not None:
      rows[f"{precision} compute copy (2P, during the update)"] = 2 * p
    return rows
  t, f, b = trainable, p - trainable, frozen_bytes
  kind = {2: "bf16", 4: "fp32"}.get(b, "quantized")
  b_text = f"{b:g}" if kind != "quantized" else f"{b:.2f}"
  rows = {
    "trainable params fp32 (4T/F)": math.ceil(4 * t / fsdp),
    f"frozen params {kind} ({b_text}(P−T)/F)": math.ceil(b * f / fsdp),
    "Adam moments fp32 (8T/F)": math.ceil(8 * t / fsdp),
    "grad accumulator fp32 (4T, during the update)": 4 * t,
  }
  if fsdp > 1:
    rows[f"gathered params (4T + {b_text}(P−T), during the update)"] = math.ceil(4 * t + b * f)
  if PRECISIONS[precision] is not None:
    cast = t + (f if b == 4 else 0)
    rows[f"{precision} compute copy (2 × fp32 params, during the update)"] = 2 * cast
  return rows


def compiled_memory(cfg) -> dict:
  """Compiles the train step of ``cfg`` on abstract inputs (nothing allocated, nothing run)
  for this host's devices: bytes per device, the parameter count, and for
  ``grad_accum_steps: auto`` the ``(K, bytes)`` table the search compiled and its choice."""
  import jax

  from jaxstep import models
  from jaxstep.core import freeze
  from jaxstep.trainer.plan import auto_accum, steps
  from jaxstep.trainer.plan.numbers import make_plan

  plan = make_plan(cfg)
  cfg, mesh, k, table = plan.cfg, plan.mesh, plan.grad_accum_steps, list(plan.accum_table)
  apply_fn, state = steps.abstract_state(cfg, mesh, plan.schedule_steps)
  compiled = steps.compile_step(cfg, apply_fn, mesh, plan.schedule_steps, k, state)
  mem = compiled.memory_analysis()
  trainable = steps.trainable(cfg)
  return {
    "num_params": models.num_params(state.params),
    "trainable_params": None if trainable is None else freeze.count(state.params, trainable)[0],
    "frozen_bytes": frozen_bytes_per_param(cfg, state.params, trainable),
    "state_bytes": sum(_shard_bytes(x) for x in jax.tree.leaves(state)),
    "optimizer_state_bytes": sum(_shard_bytes(x) for x in jax.tree.leaves(state.opt_state)),
    "argument_bytes": mem.argument_size_in_bytes,
    "output_bytes": mem.output_size_in_bytes,
    "alias_bytes": mem.alias_size_in_bytes,
    "temp_bytes": mem.temp_size_in_bytes,
    "peak_bytes": auto_accum.compiled_bytes(compiled),
    "grad_accum_steps": k,
    "auto_table": table,
    "budget_bytes": auto_accum.budget_bytes(cfg.train.memory_budget_gb) if table else 0,
    "cfg": cfg,
    "platform": jax.default_backend(),
    "devices": mesh.devices.size,
    "fsdp": mesh.shape["fsdp"],
    "data": mesh.shape["data"],
    "tensor": dict(mesh.shape).get("tensor", 1),
    "expert": dict(mesh.shape).get("expert", 1),
    "expert_params": _expert_params(state.params),
  }


def frozen_bytes_per_param(cfg, params, trainable) -> float:
  """Bytes per frozen parameter as ``params`` store them: 4 (fp32) or 2
  (``optim.frozen_dtype: bf16``), and with ``model.lora.base_quant`` the average over the
  quantized weights' codes and scales and the leaves left unquantized."""
  plain = 2 if cfg.optim.frozen_dtype == "bf16" else 4
  if cfg.model.lora.base_quant == "none" or trainable is None:
    return plain
  from jaxstep.core import freeze
  from jaxstep.core.trees import param_count
  from jaxstep.models import quant

  frozen = freeze.partition(params, trainable)[1]
  count = param_count(frozen)
  return quant.nbytes(frozen) / count if count else plain


def _expert_params(params) -> int:
  """How many parameters the routed experts of an MoE model hold (0 for a dense one)."""
  from jaxstep.core.trees import is_stored_weight

  leaves = jax_leaves_with_path(params, is_leaf=is_stored_weight)  # quantized: the weight's
  return sum(math.prod(x.shape) for path, x in leaves if "['experts']" in path)


def jax_leaves_with_path(tree, is_leaf=None) -> list[tuple[str, object]]:
  import jax

  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _shard_bytes(x) -> int:
  """Bytes of one device's shard of an abstract array."""
  shape = x.sharding.shard_shape(x.shape)
  return math.prod(shape) * x.dtype.itemsize


# The compiled step's temporaries per device, as a sum of a few sizes: one [rows, S, D]
# fp32 activation (A), one block's fp32 attention probabilities as the blocked kernel keeps
# them (Pr), the [rows, S, vocab] fp32 logits (Lg), a gradient's 4P bytes. Coefficients
# fitted (non-negative least squares, relative error) to XLA:CPU's compiled fp32 and bf16
# steps (K = 2) of the bundled GPT over 12 shapes from 2 blocks of width 128 to 24 blocks
# of 1024 and 8 blocks of 2048 at 2048 tokens; the fits are within 3 % (unrolled, scanned)
# and 17 % (scanned with remat) of every one of those shapes.
#   mode: (L·A, L·Pr, A, Pr, Lg, 4P, 4P if bf16/fp16)
COEFFICIENTS = {
  "unrolled": (22.34, 1.83, 1.95, 0.0, 2.36, 1.43, 1.01),
  "scanned": (28.69, 1.41, 25.61, 0.0, 1.61, 1.92, 1.33),
  "scanned, remat": (0.23, 0.0, 26.99, 2.2, 1.34, 1.89, 1.18),
}


def estimate_mode(model) -> str:
  """Which fit applies: XLA:CPU's scheduler computes an unrolled model's recomputation
  early, so there ``remat`` without ``scan_layers`` keeps what ``none`` keeps."""
  if not model.scan_layers:
    return "unrolled"
  return "scanned" if model.remat == "none" else "scanned, remat"


def attention_probs_bytes(model, rows: int, seq_len: int) -> int:
  """The fp32 probabilities one block's blocked attention keeps: ``rows·H·S²·4`` times the
  share of query-key blocks it computes (the fully masked ones are skipped)."""
  from jaxstep.models.cpu_kernels import query_blocks

  computed = sum((hi - lo) * hi for lo, hi in query_blocks(seq_len))
  return rows * model.n_heads * computed * 4


def loss_tokens(cfg, rows: int) -> int:
  """How many tokens' logits a micro-step of ``rows`` sequences per device holds at once: a
  chunk of ``model.loss_chunk`` (``core/chunked_loss.py``), or all of them (``jaxstep
  memory``'s loss line)."""
  tokens = rows * cfg.train.seq_len
  return chunked_loss.chunk_size(cfg.model.loss_chunk, tokens, cfg.model.vocab_size) or tokens


def activation_bytes(model, rows: int, seq_len: int, num_params: int, precision: str) -> int:
  """Estimated temporaries per device of a step whose micro-batches hold ``rows`` samples
  per device: what the backward pass keeps (activations, attention probabilities), the
  logits, and the gradient buffers (the accumulator, the low-precision compute copy);
  ``COEFFICIENTS`` has the fit."""
  a = rows * seq_len * model.d_model * 4
  probs = attention_probs_bytes(model, rows, seq_len)
  logits = rows * seq_len * model.vocab_size * 4
  grad = 4 * num_params
  sizes = (
    model.n_layers * a,
    model.n_layers * probs,
    a,
    probs,
    logits,
    grad,
    grad if precision != "fp32" else 0,
  )
  return int(sum(c * x for c, x in zip(COEFFICIENTS[estimate_mode(model)], sizes, strict=True)))


def predicted_bytes(
  cfg,
  num_params: int,
  k: int,
  data: int,
  fsdp: int,
  trainable: int | None = None,
  frozen_bytes: float | None = None,
) -> dict[str, int]:
  """The ledger's prediction per device for ``cfg`` with K = ``k`` on a data × fsdp mesh:
  persistent state, the batch, fsdp-gathered params, the estimated temporaries
  (``activation_bytes``); ``"peak"`` sums them. ``frozen_bytes``: per frozen parameter
  (``frozen_bytes_per_param``; None: 4, or 2 with ``optim.frozen_dtype: bf16``)."""
  t, devices = cfg.train, data * fsdp
  if frozen_bytes is None:
    frozen_bytes = 2 if cfg.optim.frozen_dtype == "bf16" else 4
  layout = jaxstep_layout(
    num_params, precision=t.precision, fsdp=fsdp, trainable=trainable, frozen_bytes=frozen_bytes
  )
  grads = num_params if trainable is None else trainable
  # a preference row is a pair: its chosen and rejected sequences go through one forward
  # (2 rows of activations), its batch holds 6 token arrays; the reference's forward (the
  # LoRA base) keeps no activations for a backward pass
  sequences = 2 if cfg.preference.loss else 1
  rows = sequences * t.global_batch_size // (k * devices)
  from jaxstep.trainer.plan.preference_plan import reference_kind

  live = cfg.preference.loss and reference_kind(cfg) == "live"  # a frozen copy in the state
  copy = num_params * (2 if cfg.preference.reference_dtype == "bf16" else 4) // fsdp if live else 0
  if cfg.rl.rewards:
    from jaxstep.trainer.plan import rl_plan

    size = 2 if cfg.rl.reference_dtype == "bf16" else 4
    copy = num_params * size // fsdp if rl_plan.reference_kind(cfg) == "live" else 0
  out = {
    "state": sum(b for n, b in layout.items() if "during" not in n) + copy,
    "batch": 3 * sequences * t.global_batch_size // devices * t.seq_len * 4,
    "gathered": sum(b for n, b in layout.items() if "gathered" in n),
    # the whole logits, chunked or not: the fit was made on them, and where the loss is
    # not the step's peak (the blocks' backward is, at gpt-1.3b's K 16) chunking lowers the
    # compiled peak by little; `jaxstep memory` prints the logits both ways beside it
    "activations": activation_bytes(cfg.model, rows, t.seq_len, grads, t.precision),
  }
  return {**out, "peak": sum(out.values())}
