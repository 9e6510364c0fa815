"""PyTorch baselines (benchmarks only; torch is never a jaxstep dependency).

The same GPT (fused QKV, causal attention, pre-LN, GELU-tanh, tied head), the same global
batch and the same math: every micro-batch's loss is Σ masked NLL / N_global, gradients
accumulate, then clip 1.0 and AdamW once per global batch. Variants: eager with all cores,
``torch.compile``, and 2-process gloo DDP (1 thread each, ``no_sync`` until the last
micro-step; each rank's loss is multiplied by the world size because DDP averages).
"""

from __future__ import annotations

import os
import time

from benchmarks.step_bench import make_batch, mean_seconds


def _model(cfg: dict):
  import torch
  import torch.nn.functional as F
  from torch import nn

  d, h = cfg["d_model"], cfg["n_heads"]

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
      self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
      self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
      b, s, _ = x.shape
      q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
      att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
      return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(cfg["vocab_size"], d)
      self.pos = nn.Embedding(cfg["max_seq_len"], d)
      self.blocks = nn.ModuleList(Block() for _ in range(cfg["n_layers"]))
      self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
      x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
      for block in self.blocks:
        x = block(x)
      return self.ln_f(x) @ self.embed.weight.T

  torch.manual_seed(0)
  return GPT()


def _update_fn(model, batch, k, world=1, rank=0, compiled=False):
  """One global batch (this rank's share): K micro-steps, clip, AdamW."""
  import torch
  import torch.nn.functional as F

  opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
  g = batch["inputs"].shape[0]
  rows = slice(rank * g // world, (rank + 1) * g // world)
  n = float(batch["loss_mask"].sum())  # the global token count
  micro = [{key: torch.as_tensor(v[rows][i::k]) for key, v in batch.items()} for i in range(k)]
  forward = torch.compile(model) if compiled else model

  def loss_of(mb):
    logits = forward(mb["inputs"]).float()
    nll = F.cross_entropy(
      logits.reshape(-1, logits.shape[-1]), mb["targets"].reshape(-1).long(), reduction="none"
    )
    return (nll * mb["loss_mask"].reshape(-1)).sum() * world / n

  def once():
    opt.zero_grad(set_to_none=True)
    for i, mb in enumerate(micro):
      sync = getattr(model, "no_sync", None)
      if sync is not None and i < k - 1:
        with sync():
          loss_of(mb).backward()
      else:
        loss_of(mb).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()

  return once


def torch_contender(spec):
  import torch

  torch.set_num_threads(os.cpu_count() or 1)
  batch = make_batch(spec["g"], spec["model"]["max_seq_len"], spec["model"]["vocab_size"])
  once = _update_fn(_model(spec["model"]), batch, spec["k"], compiled=spec.get("compile", False))
  t = time.perf_counter()
  once()
  first = time.perf_counter() - t
  once()
  info = {"threads": torch.get_num_threads(), "first_call_s": first}
  return info, lambda: mean_seconds(once, spec.get("repeats", 2))


def _ddp_rank(rank, world, spec, port, commands, results):
  import torch
  import torch.distributed as dist
  from torch.nn.parallel import DistributedDataParallel

  torch.set_num_threads(1)
  dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
  )
  batch = make_batch(spec["g"], spec["model"]["max_seq_len"], spec["model"]["vocab_size"])
  model = DistributedDataParallel(_model(spec["model"]))
  once = _update_fn(model, batch, spec["k"], world=world, rank=rank)
  once()
  results.put(("ready", rank))
  while commands[rank].get() == "run":
    dist.barrier()
    t = time.perf_counter()
    for _ in range(spec.get("repeats", 2)):
      once()
    results.put(("seconds", (time.perf_counter() - t) / spec.get("repeats", 2)))
  dist.destroy_process_group()


def ddp_contender(spec):
  import socket

  import torch.multiprocessing as mp

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  world = 2
  ctx = mp.get_context("spawn")
  commands, results = [ctx.Queue() for _ in range(world)], ctx.Queue()
  procs = [
    ctx.Process(target=_ddp_rank, args=(r, world, spec, port, commands, results), daemon=True)
    for r in range(world)
  ]
  for p in procs:
    p.start()
  for _ in range(world):
    results.get(timeout=600)

  def run():
    for q in commands:
      q.put("run")
    return {"seconds": max(results.get(timeout=600)[1] for _ in range(world))}

  return {"world": world, "threads_per_rank": 1}, run


CONTENDERS = {"torch": torch_contender, "torch_ddp": ddp_contender}


def _llama_model(cfg: dict):
  """transformers' ``LlamaForCausalLM`` of a jaxstep Llama model dict (``hf_bench``): random
  weights, fp32, transformers' default attention (SDPA); ``model(ids) -> logits`` as the
  GPT of ``_model``."""
  import torch
  from torch import nn
  from transformers import LlamaConfig, LlamaForCausalLM

  from benchmarks.hf_bench import hf_llama_kwargs

  torch.manual_seed(0)
  config = LlamaConfig(**hf_llama_kwargs(cfg))

  class Logits(nn.Module):
    def __init__(self):
      super().__init__()
      self.llama = LlamaForCausalLM(config)

    def forward(self, idx):
      return self.llama(input_ids=idx, use_cache=False).logits

  return Logits().train()


def torch_llama_contender(spec):
  """``torch_contender`` with transformers' Llama in place of the GPT (``hf_bench``)."""
  import torch

  torch.set_num_threads(os.cpu_count() or 1)
  batch = make_batch(spec["g"], spec["model"]["max_seq_len"], spec["model"]["vocab_size"])
  model = _llama_model(spec["model"])
  once = _update_fn(model, batch, spec["k"], compiled=spec.get("compile", False))
  t = time.perf_counter()
  once()
  first = time.perf_counter() - t
  once()
  info = {"threads": torch.get_num_threads(), "first_call_s": first}
  info["attention"] = model.llama.config._attn_implementation
  return info, lambda: mean_seconds(once, spec.get("repeats", 2))


CONTENDERS["torch_llama"] = torch_llama_contender


def transformers_contender(spec, make_model):
  """``(info, run)`` of a transformers causal LM, ``make_model()`` built after seeding 0, in
  ``_update_fn``'s update loop on every core (the MoE and Gemma comparisons' contender)."""
  import torch
  from torch import nn

  torch.set_num_threads(os.cpu_count() or 1)
  torch.manual_seed(0)
  lm = make_model()

  class Logits(nn.Module):
    def __init__(self):
      super().__init__()
      self.lm = lm

    def forward(self, idx):
      return self.lm(input_ids=idx, use_cache=False).logits

  model = Logits().train()
  batch = make_batch(spec["g"], spec["model"]["max_seq_len"], spec["model"]["vocab_size"])
  once = _update_fn(model, batch, spec["k"])
  once()
  info = {"threads": torch.get_num_threads(), "attention": lm.config._attn_implementation}
  return info, lambda: mean_seconds(once, spec.get("repeats", 2))
