"""Same global batch, same seed: 1 device vs meshes with a tensor axis on 8 virtual CPU
devices, for the bundled GPT and a Llama with grouped key/value heads, full and LoRA.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Prints one JSON line per
(model, mesh, K, LoRA) with the worst relative parameter error after 3 updates (SGD and
AdamW), the loss error, and the shardings some leaves got.
"""

import dataclasses
import json
import math
import pathlib
import re
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import mesh_equivalence as me  # noqa: E402

from jaxstep import make_train_step, models, parallel  # noqa: E402
from jaxstep.core import freeze, layout  # noqa: E402
from jaxstep.core.losses import next_token_loss  # noqa: E402
from jaxstep.models import lora  # noqa: E402
from jaxstep.trainer.config.schema import MeshConfig  # noqa: E402
from jaxstep.trainer.plan import tensor_split  # noqa: E402

MODELS = {
  "gpt": models.GPTConfig(vocab_size=32, max_seq_len=8, d_model=32, n_layers=1, n_heads=4),
  "llama": models.LlamaConfig(  # a 3-key sliding window: windowed attention split too
    vocab_size=32,
    max_seq_len=8,
    d_model=32,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    sliding_window=3,
  ),  # fmt: skip
}
MESHES = ((1, 1, 8), (2, 1, 4), (1, 2, 4), (2, 2, 2))
# (LoRA, K, meshes, sequence parallelism): every mesh at K 4 and 1 without sequence
# parallelism, and at K 4 with it (K 1 with it on one mesh); LoRA on two meshes
CASES = (
  (False, 4, MESHES, False),
  (False, 1, MESHES, False),
  (False, 4, MESHES, True),
  (False, 1, ((2, 2, 2),), True),
  (True, 4, ((1, 2, 4), (2, 2, 2)), False),
)


def run(cfg, mesh, k, opt_name, with_lora, sequence_parallel=False):
  trainable = None
  if with_lora:
    cfg = dataclasses.replace(cfg, lora=lora.LoraConfig(rank=4, alpha=8.0))
    trainable = freeze.by_patterns([lora.ADAPTER])
  apply_fn, params = models.build(cfg, 0)
  if with_lora:  # B ≠ 0, so A's gradients are not zero either
    params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.01 if "lora_b" in jax.tree_util.keystr(p) else x, params
    )
  opt = me.make_opt(opt_name)
  step = make_train_step(
    next_token_loss(apply_fn), opt, grad_accum_steps=k, mesh=mesh, trainable=trainable
  )
  state = step.init(params, 0)
  layout.split_rules(seq="tensor" if sequence_parallel else None)
  sharding = None if mesh is None else parallel.batch_sharding(mesh)
  put = (lambda b: b) if mesh is None else (lambda b: parallel.put_batch(b, sharding))  # noqa: E731
  step = jax.jit(step, donate_argnums=0)
  for b in me.batches():
    state, metrics = step(state, put(b))
  layout.split_rules()
  return state, metrics


def errors(state, ref):
  pairs = zip(jax.tree.leaves(state.params), jax.tree.leaves(ref.params), strict=True)
  return max(me.rel(a, b) for a, b in pairs)


COLLECTIVE = re.compile(
  r"= [^=]*? (?:all-to-all|collective-permute|all-gather|all-reduce|reduce-scatter)(?:-start)?\("
)
RESHARD = re.compile(r"= [^=]*? (?:all-to-all|collective-permute)(?:-start)?\(")


def sequence_buffers(name: str, tensor: int = 4) -> dict:
  """Whether the compiled step holds the residual stream split over positions: the count
  of fp32 buffers shaped [rows, S / tensor, d_model], without and with sequence parallelism;
  the count of collectives in each compiled step; and the all-to-alls and
  collective-permutes of the one without (an activation moved between two splits)."""
  cfg = MODELS[name]
  out = {"sequence_hlo": name}
  for sp in (False, True):
    apply_fn, params = models.build(cfg, 0)
    mesh = parallel.make_mesh(1, 1, jax.devices()[:tensor], tensor=tensor)
    loss = next_token_loss(apply_fn)
    step = make_train_step(loss, me.make_opt("sgd"), grad_accum_steps=1, mesh=mesh)
    # the CLI's rules: the two key/value heads stay whole over tensor 4
    tensor_split.check(cfg, MeshConfig(tensor=tensor, sequence_parallel=sp), me.S)
    batch = parallel.put_batch(me.batches()[0], parallel.batch_sharding(mesh))
    hlo = jax.jit(step).lower(step.init(params, 0), batch).compile().as_text()
    layout.split_rules()
    shape = f"f32[{me.G},{me.S // tensor},{cfg.d_model}]"
    out["sp" if sp else "plain"] = hlo.count(shape)
    out["sp_collectives" if sp else "plain_collectives"] = len(COLLECTIVE.findall(hlo))
    if not sp:
      out["plain_reshards"] = len(RESHARD.findall(hlo))
  return out


def vocab_buffers(name: str, vocab: int = 4096, tensor: int = 4) -> dict:
  """The compiled step's fp32 buffers of a model whose logits ([B, S, V]) would be the
  largest: how many hold a whole vocabulary, and the largest's shape."""
  cfg = dataclasses.replace(MODELS[name], vocab_size=vocab)
  apply_fn, params = models.build(cfg, 0)
  mesh = parallel.make_mesh(1, 1, jax.devices()[:tensor], tensor=tensor)
  loss = next_token_loss(apply_fn)
  step = make_train_step(loss, me.make_opt("sgd"), grad_accum_steps=2, mesh=mesh)
  batch = me.batches()[0]
  batch["inputs"] = batch["inputs"] * (vocab // 32)  # ids over the whole vocabulary
  batch["targets"] = batch["targets"] * (vocab // 32)
  batch = parallel.put_batch(batch, parallel.batch_sharding(mesh))
  hlo = jax.jit(step).lower(step.init(params, 0), batch).compile().as_text()
  shapes = {tuple(map(int, s.split(","))) for s in re.findall(r"f32\[([\d,]+)\]", hlo)}
  largest = max(shapes, key=lambda s: math.prod(s))
  return {"vocab_hlo": name, "whole_vocab": sum(vocab in s for s in shapes), "largest": largest}


def main():
  for name in MODELS:
    print(json.dumps(vocab_buffers(name)), flush=True)
    print(json.dumps(sequence_buffers(name)), flush=True)
  for name, cfg in MODELS.items():
    me.CFG = cfg  # adamw_leaf_errors leaves out the GPT's zero-gradient key bias
    refs = {}  # one device's runs, by (LoRA, K)
    for with_lora, k, meshes, sp in CASES:
      if (with_lora, k) not in refs:
        opts = ("adamw", "sgd") if k == 4 else ("adamw",)
        refs[with_lora, k] = {opt: run(cfg, None, k, opt, with_lora) for opt in opts}
      ref, ref_m = refs[with_lora, k]["adamw"]
      for shape in meshes:
        mesh = parallel.make_mesh(shape[0], shape[1], tensor=shape[2])
        state, m = run(cfg, mesh, k, "adamw", with_lora, sp)
        # SGD's sharper check of the gradients once per mesh and adapters: at K 4, without
        # sequence parallelism
        sgd = None if sp or k != 4 else run(cfg, mesh, k, "sgd", with_lora, sp)[0]
        sgd_err = None if sgd is None else errors(sgd, refs[with_lora, k]["sgd"][0])
        specs = {
          jax.tree_util.keystr(p): list(x.sharding.spec)
          for p, x in jax.tree_util.tree_leaves_with_path(state.params)
        }
        print(json.dumps({
            "model": name, "mesh": shape, "k": k, "lora": with_lora, "sp": sp,
            "sgd_max_leaf_rel_err": sgd_err,
            "adamw_max_leaf_rel_err": me.adamw_leaf_errors(state.params, ref.params),
            "loss_rel_err": me.rel(m["loss"], ref_m["loss"]),
            "grad_norm_rel_err": me.rel(m["grad_norm"], ref_m["grad_norm"]),
            "tokens": int(m["tokens"]), "ref_tokens": int(ref_m["tokens"]),
            "specs": specs,
          }), flush=True)  # fmt: skip


if __name__ == "__main__":
  main()
