"""A mixture-of-experts model's router losses, added to its training loss (SFT's, a
preference or an RL loss): the load-balancing loss (LBL) and the router z-loss, exact over
the global batch.

Over the T loss-masked tokens (the NLL's N) and the L MoE layers, with ``c_i`` the tokens
routed to expert ``i`` (a token counts once for each of its k experts) and ``P_i`` the sum of
the tokens' router probabilities for ``i`` (``models/moe.py``'s routing sums)::

    LBL = (1/L) Σ_layers E · Σ_i (c_i / T) · (P_i / T)        (k at perfect balance)
    Z   = (1/L) Σ_layers (1/T) Σ_t logsumexp(z_t)²

and the objective adds ``router_aux_loss · LBL + router_z_loss · Z``. This is the Switch /
Mixtral loss per layer (``N_E · Σ f_i · p_i``, Hugging Face's ``load_balancing_loss_func``
for one layer), averaged over layers as Megatron and MaxText do.

``lbl_scope: global`` (the default) counts ``c``, ``P`` and ``T`` over the WHOLE global
batch, every micro-batch and device, so K micro-batches and any mesh give the update of one
big batch. ``c`` is a count (no gradient), so given the global counts the LBL is a sum over
tokens, and micro-batch k contributes ``(E/L) Σ_i (c_i/T)·P_i^(k)/T``: its exact share.
The counts must be known before any micro-gradient: with K = 1 they come out of the same
forward pass (summed over the devices' rows), with K > 1 from a forward-only routing pass
over the K micro-batches first (``accumulate``'s ``global_sums``; docs/moe.md measures it).
``Z`` is a plain sum over tokens: exact for any K without it.

``lbl_scope: micro_batch`` is what most frameworks compute: the LBL and Z of each
micro-batch (of each device's rows, under a mesh) on its own, averaged over the K × devices
terms. Few sequences per micro-batch then push every sequence to use every expert.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxstep.core import chunked_loss, losses
from jaxstep.core.accumulate import GLOBAL_SUMS
from jaxstep.core.layout import sum_over_batch
from jaxstep.core.losses import document_fields
from jaxstep.core.step import binds

METRICS = ("moe/lbl", "moe/z_loss")  # means over the update whatever the scope


def with_router_losses(build: Callable, apply_fn: Callable, model_cfg, rows: Callable) -> Callable:
  """The loss ``build(apply_fn)`` (SFT's, a preference, an RL or a distillation loss: any
  that runs the policy once with ``train=True``) with an MoE model's router terms added: its policy
  forward pass also returns the routing sums over the tokens ``rows(batch)`` names, and
  the loss's ``aux`` gains the LBL's global share as ``extra_share`` (or the micro-batch
  one as ``extra_loss``) and the metrics ``moe/lbl``, ``moe/z_loss``, ``moe/counts``
  (``[L, E]`` routed tokens, summed) and ``moe/dropped`` (assignments over capacity).

  ``rows(batch) -> (inputs, mask, fields)``: the policy's input ids, the tokens its loss
  counts (the router losses count the same ones) and its keyword fields (document
  masking). A 4-argument loss (with a model state) stays one. With ``lbl_scope: global``
  the result has ``global_sums``, the forward-only pass the step runs over all K
  micro-batches first (``accumulate``)."""
  layers = sum(model_cfg.moe_layers)
  scope = model_cfg.lbl_scope
  pending = {}  # the routing of the policy's forward pass, while the loss is traced

  def routed_apply(params, inputs, *, rng=None, train=False, **fields):
    if not (train and "mask" in pending):  # a reference's forward pass, an evaluation
      return apply_fn(params, inputs, rng=rng, train=train, **fields)
    weights = pending.pop("mask")
    logits, sums = apply_fn(
      params, inputs, rng=rng, train=True, route_weights=weights, with_routing=True, **fields
    )
    local = {"counts": sums["counts"], "tokens": jnp.sum(weights)}
    if pending.pop("sum_here"):  # K = 1: this forward's counts, summed over the devices' rows
      local = sum_over_batch(local)
    pending["sums"], pending["totals"] = sums, local
    return logits

  inner = build(chunked_loss.like(routed_apply, apply_fn))

  def loss_fn(params, batch, rng, *model_state):
    _, mask, _ = rows(batch)
    pending.clear()
    pending["mask"] = mask.astype(jnp.float32)
    pending["sum_here"] = scope == "global" and GLOBAL_SUMS not in batch
    loss, aux, *rest = inner(params, batch, rng, *model_state)
    sums, totals = pending.pop("sums"), pending.pop("totals")
    if scope == "global" and GLOBAL_SUMS in batch:  # K > 1: the step's routing pass
      totals = batch[GLOBAL_SUMS]
    lbl, z = router_terms(sums, totals, model_cfg.num_experts, layers)
    objective = model_cfg.router_aux_loss * lbl + model_cfg.router_z_loss * z
    term = "extra_share" if scope == "global" else "extra_loss"
    aux = {
      **aux,
      term: aux.get(term, 0.0) + objective,
      "moe/lbl": lbl,
      "moe/z_loss": z,
      "moe/counts": sums["counts"],
      "moe/dropped": jnp.sum(sums["dropped"]),
    }
    return (loss, aux, *rest)

  def global_sums(params, batch, rng):
    inputs, mask, fields = rows(batch)
    mask = mask.astype(jnp.float32)
    _, sums = apply_fn(
      params, inputs, rng=rng, train=True, route_weights=mask, with_routing=True, **fields
    )
    return {"counts": sums["counts"], "tokens": jnp.sum(mask)}

  if scope == "global":
    loss_fn.global_sums = global_sums
  return _arity_of(inner, loss_fn)


def _arity_of(inner: Callable, loss_fn: Callable) -> Callable:
  """``loss_fn`` with ``inner``'s signature (3 arguments, or 4 with a model state): the step
  reads the signature to know which form it calls."""
  if binds(inner, 4):  # the step's own test of the form it calls

    def four(params, batch, rng, model_state):
      return loss_fn(params, batch, rng, model_state)

    wrapped = four
  else:

    def three(params, batch, rng):
      return loss_fn(params, batch, rng)

    wrapped = three
  if hasattr(loss_fn, "global_sums"):
    wrapped.global_sums = loss_fn.global_sums
  return wrapped


def sft_rows(batch):
  """SFT's policy rows: the inputs, the loss mask, the document-masking fields."""
  return batch["inputs"], batch["loss_mask"], document_fields(batch)


def preference_rows(batch):
  """A preference loss's policy rows: chosen and rejected in one forward pass, their
  completion tokens."""
  from jaxstep.core.preference import concatenated

  rows = concatenated(batch)
  return rows["inputs"], rows["mask"], {}


def rl_rows(batch):
  """An RL loss's policy rows: prompts and completions, the completion tokens."""
  return batch["inputs"], batch["completion_mask"], {}


def next_token_loss(apply_fn: Callable, model_cfg) -> Callable:
  """``losses.next_token_loss`` of an MoE model, with its router losses
  (``with_router_losses``) over the loss-masked tokens."""
  return with_router_losses(losses.next_token_loss, apply_fn, model_cfg, sft_rows)


def router_terms(sums: dict, totals: dict, experts: int, layers: int):
  """``(LBL, Z)`` of the tokens in ``sums`` (a micro-batch's routing sums, stacked over
  layers) against ``totals`` (``counts [L, E]`` and ``tokens`` over the scope): the whole
  value when ``totals`` are the micro-batch's own, its share when they are global."""
  tokens = jnp.maximum(totals["tokens"], 1.0)
  f = jax.lax.stop_gradient(totals["counts"]) / tokens
  lbl = experts * jnp.sum(f * sums["probs"]) / tokens / max(layers, 1)
  z = jnp.sum(sums["z"]) / tokens / max(layers, 1)
  return lbl, z


def with_router_metrics(step, model_cfg, terms: int):
  """``step`` whose metrics hold ``moe/lbl`` and ``moe/z_loss`` as the update's values (a
  micro-batch scope's summed terms divided by ``terms`` = K × devices) and
  ``moe/max_load``: the largest expert's share of the routed tokens over the mean share,
  averaged over the MoE layers (1 = balanced), in place of the ``moe/counts`` array."""
  sparse = jnp.asarray(model_cfg.moe_layers)

  def train_step(state, batch):
    state, metrics = step(state, batch)
    metrics = dict(metrics)
    counts = metrics.pop("moe/counts")
    load = jnp.max(counts, axis=-1) / jnp.maximum(jnp.mean(counts, axis=-1), 1e-9)
    metrics["moe/max_load"] = jnp.sum(jnp.where(sparse, load, 0.0)) / jnp.maximum(
      jnp.sum(sparse), 1
    )
    if model_cfg.lbl_scope != "global":
      metrics.update({k: metrics[k] / terms for k in METRICS})
    return state, metrics

  train_step.init = step.init
  return train_step
