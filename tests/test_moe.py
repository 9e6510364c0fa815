"""Mixture-of-experts layers: the grouped dispatch against every expert on every token, the
capacity rule, and the router losses exact over the global batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxstep import make_train_step, models
from jaxstep.core import router_loss
from jaxstep.errors import ConfigError
from jaxstep.models import grouped, moe
from jaxstep.models.llama import Llama, LlamaConfig

TINY = dict(
  vocab_size=40,
  max_seq_len=16,
  d_model=16,
  n_layers=2,
  n_heads=2,
  intermediate_size=24,
  num_experts=4,
  experts_per_token=2,
  moe_intermediate_size=12,
)


def _mlp(**fields):
  cfg = LlamaConfig(**{**TINY, **fields})
  linear = functools.partial(nnx.Linear, use_bias=False, rngs=nnx.Rngs(1))
  return moe.MoeMLP(cfg, lambda name, i, o: linear(i, o), rngs=nnx.Rngs(2)), cfg


def every_expert(layer: moe.MoeMLP, x, keep=None):
  """The oracle: all E experts on all tokens, mixed by the top-k weights (``keep``: a
  ``[T, k]`` mask of the assignments kept)."""
  cfg, ex = layer.cfg, layer.experts
  t = x.reshape(-1, x.shape[-1])
  r = moe.route(layer.router(t), cfg.experts_per_token, cfg.router_scores, cfg.norm_topk)
  h = jax.nn.silu(jnp.einsum("td,edf->etf", t, ex.gate_proj[...]))
  h = h * jnp.einsum("td,edf->etf", t, ex.up_proj[...])
  outs = jnp.einsum("etf,efd->etd", h, ex.down_proj[...])  # [E, T, d]
  w = r.weights if keep is None else r.weights * keep
  mixed = jnp.zeros_like(t)
  for j in range(cfg.experts_per_token):
    mixed = mixed + w[:, j, None] * outs[r.experts[:, j], jnp.arange(t.shape[0])]
  if layer.shared_expert is not None:
    shared = layer.shared_expert(t)
    if layer.shared_expert_gate is not None:
      shared = jax.nn.sigmoid(layer.shared_expert_gate(t)) * shared
    mixed = mixed + shared
  return mixed.reshape(x.shape)


CASES = {
  "softmax_renorm": {},
  "softmax_raw": dict(norm_topk=False),
  "sigmoid": dict(router_scores="sigmoid"),
  "shared_gated": dict(shared_experts=1, shared_expert_size=20, shared_expert_gate=True),
  "top1_of_8": dict(num_experts=8, experts_per_token=1),
}


FAST = {("softmax_renorm", "tiles"), ("sigmoid", "ragged")}  # shared experts: test_hf_moe


@pytest.mark.parametrize(
  "case, impl",
  [
    (c, i) if (c, i) in FAST else pytest.param(c, i, marks=pytest.mark.slow)
    for c in sorted(CASES)
    for i in ("tiles", "ragged")
  ],
)
def test_grouped_dispatch_equals_every_expert_on_every_token(case, impl):
  layer, _ = _mlp(moe_matmul=impl, **CASES[case])
  x = jax.random.normal(jax.random.key(3), (3, 11, 16))
  cot = jax.random.normal(jax.random.key(4), x.shape)

  def loss(fn, layer, x):
    return jnp.sum(fn(layer, x) * cot)

  ours = lambda m, x: m(x)[0]  # noqa: E731

  @nnx.jit
  def values_and_grads(layer, x):
    return [
      (fn(layer, x), nnx.grad(functools.partial(loss, fn), argnums=(0, 1))(layer, x))
      for fn in (ours, every_expert)
    ]

  (y_ours, g_ours), (y_ref, g_ref) = values_and_grads(layer, x)
  np.testing.assert_allclose(y_ours, y_ref, atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref), strict=True):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_tiles_cover_uneven_groups_and_empty_experts():
  x = jax.random.normal(jax.random.key(0), (40, 5))
  w = jax.random.normal(jax.random.key(1), (6, 5, 3))
  experts = jnp.array([[0], [0], [5], [0], [2]] * 8, jnp.int32)  # experts 1, 3, 4 get none

  @jax.jit
  def tiled(x, w, experts):
    plan = moe.dispatch(experts, 6, tile=8)
    rows = jnp.concatenate([x, jnp.zeros((1, 5))])[plan.row_token]
    out = grouped.grouped_matmul(rows, w, plan.group_sizes, plan.tile_groups, "tiles")
    return out[plan.dest[:, 0]]

  expected = jax.jit(lambda x, w, e: jnp.einsum("td,tdf->tf", x, w[e[:, 0]]))(x, w, experts)
  np.testing.assert_allclose(tiled(x, w, experts), expected, atol=1e-5)


def test_take_rows_backward_is_autodiffs_scatter_in_both_directions():
  """Tokens → expert-sorted rows and rows → assignments, some assignments dropped (expert id
  6 of 6): the gather-based backward equals autodiff's scatter-add of plain indexing."""
  experts = jax.random.randint(jax.random.key(0), (13, 3), 0, 7, jnp.int32)
  plan = moe.dispatch(experts, 6, tile=4)
  x = jax.random.normal(jax.random.key(1), (13, 5))
  rows_cot = jax.random.normal(jax.random.key(2), (plan.row_token.shape[0], 5))
  plain = lambda a, i: jnp.concatenate([a, jnp.zeros((1, 5))])[i]  # noqa: E731

  def pair(take, reference, x, cot):
    ours = jax.vjp(take, x)
    theirs = jax.vjp(reference, x)
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_allclose(ours[1](cot)[0], theirs[1](cot)[0], rtol=1e-6, atol=1e-6)

  pair(lambda a: grouped.take_rows(a, plan.row_token, plan.dest),
       lambda a: plain(a, plan.row_token), x, rows_cot)  # fmt: skip
  out_rows = jax.random.normal(jax.random.key(3), (plan.row_token.shape[0], 5))
  flat, out_cot = plan.dest.reshape(-1), jax.random.normal(jax.random.key(4), (39, 5))
  pair(lambda a: grouped.take_rows(a, flat, plan.row_assign[:, None]),
       lambda a: plain(a, flat), out_rows, out_cot)  # fmt: skip
  assert int(jnp.sum(experts == 6)) > 0  # some assignments were dropped


@settings(max_examples=200, deadline=None)
@given(
  shape=st.tuples(st.integers(1, 4), st.integers(1, 16), st.integers(2, 8)),  # B, S, E
  k=st.integers(1, 8),
  tile=st.sampled_from([1, 2, 4, 8]),
  factor=st.sampled_from([0.0, 0.25, 1.0, 1.25, 2.0]),
  shards=st.sampled_from([1, 2, 4]),
  seed=st.integers(0, 2**16),
)
def test_the_layouts_rows_hold_every_kept_assignment_and_no_more(
  shape, k, tile, factor, shards, seed
):
  """``rows_bound``, the static size of ``dispatch``'s layout, against the rows that
  routings use (numpy): each expert's kept assignments in whole tiles, summed over the
  experts of one device (of ``shards``). Distinct experts per token, a capacity per
  sequence; a routing with every token on the same k experts reaches the bound."""
  b, s, e = shape
  k, here = min(k, e), max(e // shards, 1)
  rng = np.random.default_rng(seed)
  cap = moe.capacity(s, k, e, factor)
  most = None if cap is None else cap * b
  bound = moe.rows_bound(b * s, k, here, tile, most)
  assert bound % tile == 0
  up = lambda a: -(-a // tile) * tile  # noqa: E731
  for routing in range(4):
    order = np.argsort(rng.random((b, s, e)), axis=-1)[..., :k]  # distinct, random
    experts = order if routing else np.broadcast_to(np.arange(k), (b, s, k))  # all on the first
    counts = np.zeros(e, int)
    for row in range(b):
      seen = np.zeros(e, int)
      for token in experts[row].reshape(-1):
        counts[token] += cap is None or seen[token] < cap
        seen[token] += 1
    used = sum(up(c) for c in counts[:here])
    assert used <= bound
    if routing == 0 and here == k:  # k experts here, every token on them: the bound is met
      assert used == bound


def test_a_layout_sized_by_the_capacity_places_every_kept_assignment():
  """``dispatch`` with ``most``: each assignment the capacity keeps gets a row of its own
  inside the smaller layout (one past it would be lost silently: rows are placed with
  ``mode="drop"``), on a routing that fills it: every token on the same three experts, one
  of them another device's (id 2 of the 2 here: no row), groups of 21 in tiles of 4."""
  b, s, k, e, here, tile = 3, 10, 3, 4, 2, 4
  experts = jnp.broadcast_to(jnp.array([0, 1, 2], jnp.int32), (b, s, k))
  cap = moe.capacity(s, k, e, 0.9)
  kept = moe.over_capacity(experts, e, cap).reshape(b * s, k)
  plan = moe.dispatch(kept, here, tile, cap * b)
  rows = plan.row_token.shape[0]
  assert (
    rows == moe.rows_bound(b * s, k, here, tile, cap * b) < moe.rows_bound(b * s, k, here, tile)
  )
  dest = np.asarray(plan.dest)[np.asarray(kept) < here]
  assert len(dest) == here * b * cap and dest.max() < rows and len(set(dest.tolist())) == len(dest)
  assert np.all(np.asarray(plan.dest)[np.asarray(kept) >= here] == rows)


def test_capacity_drops_the_latest_tokens_of_a_full_expert_in_each_sequence():
  """⌈c·S·k/E⌉ per expert and sequence (MaxText's rule), in token order; the same drops
  whichever rows share the call (micro-batch and mesh independent)."""
  layer, cfg = _mlp(capacity_factor=0.5, moe_matmul="tiles")
  x = jax.random.normal(jax.random.key(5), (3, 10, 16))
  call = nnx.jit(lambda layer, x: layer(x))
  out, sums = call(layer, x)
  r = nnx.jit(lambda layer: moe.route(layer.router(x.reshape(-1, 16)), 2, "softmax", True))(layer)
  experts = np.asarray(r.experts).reshape(3, 10, 2)
  cap = moe.capacity(10, 2, 4, 0.5)
  keep = np.zeros((3, 10, 2), np.float32)
  for row in range(3):
    seen = np.zeros(4, int)
    for token in range(10):
      for j in range(2):
        e = experts[row, token, j]
        keep[row, token, j] = seen[e] < cap
        seen[e] += 1
  assert int(sums["dropped"]) == int((1 - keep).sum()) > 0
  expected = nnx.jit(every_expert)(layer, x, jnp.asarray(keep.reshape(30, 2)))
  np.testing.assert_allclose(out, expected, atol=1e-5)
  alone, _ = call(layer, x[1:2])  # a sequence's drops are its own
  np.testing.assert_allclose(alone, out[1:2], atol=1e-5)


def test_moe_settings_are_checked_with_one_line():
  with pytest.raises(ConfigError, match="experts_per_token must be in"):
    LlamaConfig(**{**TINY, "experts_per_token": 5})
  with pytest.raises(ConfigError, match="lbl_scope must be one of global, micro_batch"):
    LlamaConfig(**{**TINY, "lbl_scope": "sequence"})
  with pytest.raises(ConfigError, match="scan_layers=false"):
    LlamaConfig(**{**TINY, "scan_layers": True, "dense_layers": (0,)})
  assert LlamaConfig(**{**TINY, "moe_every": 2}).moe_layers == (False, True)


def _batches(seed=0, g=8, s=12):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(2):
    tokens = rng.integers(0, 40, size=(g, s + 1), dtype=np.int32)
    # very uneven masks: some rows nearly empty, some full, one empty
    mask = (rng.random((g, s)) < rng.choice([0.1, 1.0], size=(g, 1))).astype(np.int32)
    mask[1] = 0
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask})
  return out


def _train(cfg, k, batches):
  apply_fn, params = models.build(cfg, 0)
  loss = router_loss.next_token_loss(apply_fn, cfg)
  opt = optax.adamw(1e-2)
  step = make_train_step(loss, opt, grad_accum_steps=k)
  state = step.init(params, 0)
  step = jax.jit(router_loss.with_router_metrics(step, cfg, k))
  metrics = []
  for b in batches:
    state, m = step(state, b)
    metrics.append(jax.device_get(m))
  return state, metrics


WEIGHTS = dict(router_aux_loss=0.5, router_z_loss=0.1)  # large: the terms move the update


@pytest.mark.parametrize(
  "remat, scan", [("none", False), pytest.param("block", True, marks=pytest.mark.slow)]
)
def test_global_lbl_gives_the_update_of_one_big_batch_for_any_k(remat, scan):
  cfg = LlamaConfig(**TINY, **WEIGHTS, remat=remat, scan_layers=scan)
  batches = _batches()
  one, m1 = _train(cfg, 1, batches)
  four, m4 = _train(cfg, 4, batches)
  for a, b in zip(m1, m4, strict=True):
    for key in ("loss", "moe/lbl", "moe/z_loss", "grad_norm", "extra_loss", "moe/max_load"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
  # AdamW moves every weight by about lr whatever its gradient's size, so a weight whose
  # gradient is near 0 carries the sums' rounding into its update: 1e-5 absolute, not 1e-6
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert m1[0]["moe/lbl"] > 1.0  # k = 2: 2 at perfect balance, near it at init


@nnx.jit
def _router_logits(model, inputs):
  """The first block's router logits for ``inputs``, from the block's own parts."""
  blk = model.blocks[0]
  x = model.embed_tokens(inputs)
  x = x + blk.attention(blk.input_layernorm(x))
  return blk.mlp.router(blk.post_attention_layernorm(x))


def _by_hand(cfg, params, batch):
  """LBL and Z of ``batch`` computed outside the model's routing sums: the router's
  input rebuilt from the block's own parts, top-k taken in numpy. One MoE layer."""
  model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))), params)
  z = np.asarray(_router_logits(model, jnp.asarray(batch["inputs"])), np.float64).reshape(-1, 4)
  m = batch["loss_mask"].reshape(-1).astype(np.float64)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  top = np.argsort(-p, axis=-1)[:, :2]
  chosen = np.zeros_like(p)
  np.put_along_axis(chosen, top, 1.0, axis=-1)
  t = m.sum()
  if not t:  # an empty micro-batch adds 0 to the mean
    return 0.0, 0.0
  lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
  lbl = 4 * np.sum((m @ chosen / t) * (m @ p / t))
  return lbl, np.sum(m * lse**2) / t


def test_lbl_scopes_against_the_formula_by_hand():
  """global at K = 4 is the formula over the whole batch; micro_batch at K = 4 is the mean
  of the formula over each micro-batch (rows k, k + 4, …), as the anchors compute it."""
  base = {**TINY, "n_layers": 1, **WEIGHTS}
  batch = _batches(seed=3)[0]
  params = models.build(LlamaConfig(**base), 0)[1]
  whole = _by_hand(LlamaConfig(**base), params, batch)
  parts = [
    _by_hand(LlamaConfig(**base), params, {k: v[i::4] for k, v in batch.items()}) for i in range(4)
  ]
  for scope, (lbl, z) in {
    "global": whole,
    "micro_batch": (np.mean([p[0] for p in parts]), np.mean([p[1] for p in parts])),
  }.items():
    cfg = LlamaConfig(**base, lbl_scope=scope)
    _, m = _train(cfg, 4, [batch])
    np.testing.assert_allclose(m[0]["moe/lbl"], lbl, rtol=1e-5, err_msg=scope)
    np.testing.assert_allclose(m[0]["moe/z_loss"], z, rtol=1e-5, err_msg=scope)
  assert abs(whole[0] - np.mean([p[0] for p in parts])) > 1e-3  # the scopes do differ here


def test_the_specialization_measure_is_bits_between_domain_and_expert():
  from benchmarks.moe_specialization import mutual_information

  assert mutual_information(np.array([[5.0, 0.0], [0.0, 5.0]])) == pytest.approx(1.0)
  assert mutual_information(np.array([[3.0, 3.0], [2.0, 2.0]])) == pytest.approx(0.0, abs=1e-12)
  assert 0 < mutual_information(np.array([[4.0, 1.0], [1.0, 4.0]])) < 1


@pytest.mark.slow
def test_the_specialization_benchmark_runs_both_scopes(tmp_path):
  import json

  from benchmarks import moe_specialization

  assert moe_specialization.main(["--quick", "--out", str(tmp_path / "s.json")]) == 0
  out = json.loads((tmp_path / "s.json").read_text())
  assert {r["scope"] for r in out["runs"]} == {"global", "micro_batch"}
  assert all(0 <= r["mutual_information_bits"] <= 1 for r in out["runs"])
