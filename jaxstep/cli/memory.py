"""``python -m jaxstep.memory [--config FILE] [key=value …]``: the memory ledger of a config.

The textbook mixed-precision Adam table (ZeRO stages), jaxstep's own layout by role, and the
compiled step's ``memory_analysis()``, per device (GiB = 2^30 bytes).
"""

from __future__ import annotations

from jaxstep.cli._common import config_command
from jaxstep.trainer.plan.memory import (
  compiled_memory,
  jaxstep_layout,
  loss_tokens,
  predicted_bytes,
  textbook_state_bytes,
)

GIB = 2**30


def report(cfg) -> str:
  c = compiled_memory(cfg)
  p, dp, t = c["num_params"], c["data"] * c["fsdp"], c["trainable_params"]
  split = c["fsdp"] * c["tensor"]  # the ways a parameter is split (fsdp × tensor)
  tensor = f" tensor={c['tensor']}" if c["tensor"] > 1 else ""
  tensor += f" expert={c['expert']}" if c["expert"] > 1 else ""
  shards = dp * c["expert"]  # the batch's rows split over data × fsdp × expert
  gib = lambda b: f"{b / GIB:9.3f} GiB"  # noqa: E731
  k, rows = c["grad_accum_steps"], cfg.train.global_batch_size // (c["grad_accum_steps"] * shards)
  trains = "" if t is None else f" (T = {t:,} train, {p - t:,} frozen)"
  unit = " pairs" if cfg.preference.loss else ""
  lines = [
    f"P = {p:,} parameters{trains}; mesh data={c['data']} fsdp={c['fsdp']}{tensor}; "
    f"precision {cfg.train.precision}; K = {k} (micro-batch {rows}{unit} per device); "
    f"remat {cfg.model.remat}, scan_layers {str(cfg.model.scan_layers).lower()}; per device:",
    "",
    f"textbook mixed-precision Adam (16 B/param), D = {dp}:",
  ]
  formulas = ["16P", "(4 + 12/D)P", "(2 + 14/D)P", "16P/D"]
  for stage, formula in enumerate(formulas):
    lines.append(
      f"  ZeRO-{stage}  {formula:<12} "
      f"{gib(textbook_state_bytes(p, zero_stage=stage, data_parallel=dp))}"
    )
  lines += ["  + activations (not divided by D)", "", "jaxstep layout:"]
  layout = jaxstep_layout(
    p, precision=cfg.train.precision, fsdp=split, trainable=t, frozen_bytes=c["frozen_bytes"]
  )
  name = cfg.optim.name
  if name != "adamw":  # its moments as the state holds them, not Adam's 8 bytes a parameter
    layout = {k: v for k, v in layout.items() if "Adam moments" not in k}
    layout[f"{name} state (its own shapes, per device)"] = c["optimizer_state_bytes"]
  for row, b in layout.items():
    lines.append(f"  {row:<48} {gib(b)}")
  persistent = sum(b for n, b in layout.items() if "during" not in n)
  predicted = predicted_bytes(
    c["cfg"], p, k, c["data"], split, trainable=t, frozen_bytes=c["frozen_bytes"]
  )
  lines += [
    f"  {'persistent state (params + moments)':<48} {gib(persistent)}",
    f"  {'temporaries: activations, gradients (estimate)':<48} {gib(predicted['activations'])}",
    f"  {'predicted peak (state, batch, gathered, above)':<48} {gib(predicted['peak'])}",
    "",
    f"compiled train step (memory_analysis, {c['platform']}):",
    f"  {'arguments (state + batch)':<48} {gib(c['argument_bytes'])}",
    f"  {'outputs (aliased to the donated state)':<48} {gib(c['output_bytes'])}",
    f"  {'temporaries (accumulator, activations, …)':<48} {gib(c['temp_bytes'])}",
    f"  {'peak: arguments + outputs − aliased + temps':<48} {gib(c['peak_bytes'])}",
    f"  {'predicted ÷ compiled peak':<48} {predicted['peak'] / c['peak_bytes']:9.3f}",
  ]
  lines += ["", loss_line(c["cfg"], rows)]
  if cfg.preference.loss:
    lines += ["", preference_line(c["cfg"])]
  if cfg.rl.rewards:
    lines += ["", rl_line(c["cfg"])]
  if cfg.distill.teacher:
    lines += ["", distill_line(c["cfg"])]
  if getattr(cfg.model, "num_experts", 0):
    lines += ["", moe_line(c["cfg"], c["expert_params"], c["expert"], shards)]
  if c["auto_table"]:
    budget = c["budget_bytes"]
    lines += ["", f"grad_accum_steps=auto, budget {gib(budget).strip()} per device:"]
    for cand, b in c["auto_table"]:
      lines.append(f"  K={cand:<5} {gib(b)}  {'fits' if b <= budget else 'over'}")
    lines.append(f"  chosen K = {k}")
  return "\n".join(lines)


def loss_line(cfg, rows: int) -> str:
  """The loss's logits in a micro-step, whole and as ``model.loss_chunk`` computes them."""
  m = cfg.model
  sequences = 2 if cfg.preference.loss else 1
  tokens = sequences * rows * cfg.train.seq_len
  whole = f"[{tokens:,} × {m.vocab_size:,}] fp32 = {_size(tokens * m.vocab_size * 4)}"
  held = loss_tokens(cfg, sequences * rows)
  if held == tokens:
    return f"loss logits per micro-step: {whole} (model.loss_chunk={m.loss_chunk}: whole)"
  now = f"[{held:,} × {m.vocab_size:,}] = {_size(held * m.vocab_size * 4)}"
  return (
    f"loss logits per micro-step: {whole} whole; model.loss_chunk={m.loss_chunk} computes "
    f"them {held:,} tokens at a time: {now} alive at once"
  )


def _size(nbytes: int) -> str:
  return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.1f} KiB"


def preference_line(cfg) -> str:
  """What a preference run holds for its reference, in the ledger's words."""
  from jaxstep.trainer.plan.preference_plan import reference_kind

  p = cfg.preference
  if reference_kind(cfg) == "none":
    return f"preference.loss={p.loss}: reference-free, nothing held for a reference"
  if reference_kind(cfg) == "live":
    return (
      f"preference.loss={p.loss}: the reference is a frozen copy of the starting weights in "
      f"{p.reference_dtype}, part of the state above (sharded like the params, checkpointed)"
    )
  if reference_kind(cfg) == "precompute":
    return (
      f"preference.loss={p.loss}: the reference's log-probs are computed once before "
      f"training and read with the batches (8 bytes per pair): no copy, no second forward"
    )
  return (
    f"preference.loss={p.loss}: the reference is the LoRA base (adapters off), the same "
    f"weights: no second copy of the model; its forward keeps no activations"
  )


def moe_line(cfg, expert_params: int, expert: int, shards: int) -> str:
  """What a mixture-of-experts model holds and moves, in the ledger's words (docs/moe.md):
  ``shards`` devices split the batch's rows (data × fsdp × expert)."""
  m, t = cfg.model, cfg.train
  sequences = 2 if cfg.preference.loss else 1  # a pair's chosen and rejected: one forward
  tokens = sequences * t.global_batch_size * t.seq_len // max(t.grad_accum_steps, 1)
  split = (
    f", {expert_params // expert:,} per device over mesh.expert={expert}" if expert > 1 else ""
  )
  moved = (
    f"; expert parallelism all-gathers each MoE layer's group rows ({expert} × a device's) in "
    f"and reduce-scatters them out"
    if expert > 1
    else ""
  )
  return (
    f"mixture of experts: the routed experts hold {expert_params:,} of the parameters{split}; "
    f"a micro-step routes {tokens:,} tokens × {m.experts_per_token} experts per MoE layer "
    f"(sorted rows of width {m.d_model}, padded to whole tiles on CPU){moved}; "
    f"{dispatch_rows(m, tokens // shards * expert, t.seq_len, expert)}"
  )


def dispatch_rows(m, group_tokens: int, seq_len: int, expert: int) -> str:
  """The static rows of a device's dispatch layout per MoE layer (``moe.rows_bound``), for
  ``group_tokens`` tokens of its expert group."""
  from jaxstep.models import moe

  tile, most = moe.layout_sizes(m, group_tokens, seq_len)
  rows = moe.rows_bound(group_tokens, m.experts_per_token, m.num_experts // expert, tile, most)
  why = "dropless" if most is None else f"model.capacity_factor={m.capacity_factor:g}"
  return f"each device's dispatch holds {rows:,} rows per MoE layer ({why})"


def distill_line(cfg) -> str:
  """What a distillation run holds for its teacher, in the ledger's words."""
  import jax

  from jaxstep.trainer.plan import teacher

  leaves = jax.tree.leaves(teacher.abstract_params(cfg))
  count, nbytes = sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)
  d = cfg.distill
  return (
    f"distill: the teacher {d.teacher} holds {count:,} parameters in {d.teacher_dtype} "
    f"({_size(nbytes)} in all, split over the mesh like the params), part of the compiled "
    f"step's arguments above and never of a checkpoint; its forward keeps no activations "
    f"but adds its logits per micro-step (where model.loss_chunk chunks them and neither "
    f"model soft-caps its logits: its final hidden states, and its logits a chunk at a time)"
  )


def rl_line(cfg) -> str:
  """What an RL run holds besides a supervised one, in the ledger's words."""
  from jaxstep.trainer.plan.rl_plan import reference_kind

  r, kind = cfg.rl, reference_kind(cfg)
  held = {
    "none": "no reference (rl.beta 0)",
    "adapters": "the KL's reference is the LoRA base (adapters off): no second copy",
    "live": f"the KL's reference is a frozen {r.reference_dtype} copy of the starting weights, "
    f"in the state above",
  }[kind]
  return (
    f"RL: a batch is {cfg.train.global_batch_size} completions ({r.num_generations} per "
    f"prompt) of up to {r.max_new_tokens} new tokens; {held}; sampling adds the KV cache of "
    f"the rollout, not counted here"
  )


def main(argv=None) -> int:
  def action(cfg) -> int:
    from jaxstep.trainer.plan.numbers import configure_devices

    configure_devices(cfg)  # the devices train would use for this config
    print(report(cfg))
    return 0

  return config_command("jaxstep memory", __doc__, action, argv)
