"""The distillation core (``jaxstep.core.distill``): GKD's divergence against TRL's
``GKDTrainer.generalized_jsd_loss``, offline KD against float64 numpy, on-policy
distillation's loss and gradient on a fixed rollout against a hand-written reference, and
every mode's K micro-batches equal to one big batch."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_lm_apply, tiny_lm_params
from test_rl_losses import SEQ, VOCAB, rl_batch
from tolerance import assert_close

from jaxstep.core import distill, rl
from jaxstep.core.step import make_train_step
from jaxstep.errors import BatchError, ConfigError, DataError

TEACHER = tiny_lm_params(vocab=VOCAB, dim=8, seed=7)


def teacher(inputs, **_):
  return tiny_lm_apply(TEACHER, inputs)


def sft_batch(seed=0, rows=8):
  """Windows whose loss masks cover 0 to all of their targets, unevenly."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
  mask = (rng.random((rows, SEQ)) < np.linspace(0.0, 1.0, rows)[:, None]).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


def log_softmax64(logits, temperature=1.0):
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.skipif(not importlib.util.find_spec("trl"), reason="trl: the test extra")
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_gkd_equals_trls_generalized_jsd(beta):
  import torch
  from trl.experimental.gkd.gkd_trainer import GKDTrainer

  d = distill.DistillConfig(mode="gkd", beta=beta, temperature=0.8)
  batch, params = sft_batch(), tiny_lm_params(vocab=VOCAB)
  total, aux = jax.jit(distill.supervised_loss(tiny_lm_apply, teacher, d, "gkd"))(
    params, batch, None
  )
  labels = np.where(batch["loss_mask"] > 0, batch["targets"], -100)
  student = torch.tensor(np.asarray(tiny_lm_apply(params, batch["inputs"])))
  want = GKDTrainer.generalized_jsd_loss(
    student,
    torch.tensor(np.asarray(teacher(batch["inputs"]))),
    labels=torch.tensor(labels),
    beta=beta,
    temperature=0.8,
    num_items_in_batch=int(batch["loss_mask"].sum()),
  )
  assert_close(float(total) / batch["loss_mask"].sum(), float(want), terms=VOCAB)
  assert float(aux["distill/divergence"]) == float(total)


def test_offline_kd_equals_a_numpy_computation():
  d = distill.DistillConfig(mode="logits", alpha=0.3, temperature=2.0)
  batch, params = sft_batch(1), tiny_lm_params(vocab=VOCAB)
  total, aux = jax.jit(distill.supervised_loss(tiny_lm_apply, teacher, d, "logits"))(
    params, batch, None
  )
  s, t = tiny_lm_apply(params, batch["inputs"]), teacher(batch["inputs"])
  s_soft, t_soft = log_softmax64(s, 2.0), log_softmax64(t, 2.0)
  kl = np.sum(np.exp(t_soft) * (t_soft - s_soft), -1)
  nll = -np.take_along_axis(log_softmax64(s), batch["targets"][..., None], -1)[..., 0]
  mask = batch["loss_mask"]
  want = np.sum(mask * (0.3 * 4.0 * kl + 0.7 * nll))
  assert_close(float(total), want, terms=VOCAB * SEQ)
  assert_close(float(aux["distill/nll"]), np.sum(mask * nll), terms=VOCAB * SEQ)


def reference_on_policy(params, batch, coef, estimator, temperature, eps=0.2):
  """The on-policy objective written out in jnp: the clipped importance-sampled loss with
  the per-token advantage −coef·(log π_old − log π_T) at the sampled token, or the reverse
  KL summed over the vocabulary; the sum over completion tokens."""
  mask = batch["completion_mask"].astype(jnp.float32)
  logp_all = jax.nn.log_softmax(tiny_lm_apply(params, batch["inputs"]) / temperature, -1)
  t_all = jax.nn.log_softmax(teacher(batch["inputs"]) / temperature, -1)
  pick = lambda a: jnp.take_along_axis(a, batch["targets"][..., None], -1)[..., 0]  # noqa: E731
  if estimator == "full":
    return coef * jnp.sum(mask * jnp.sum(jnp.exp(logp_all) * (logp_all - t_all), -1))
  adv = -coef * (batch["old_logps"] - pick(t_all))
  ratio = jnp.exp(pick(logp_all) - batch["old_logps"])
  per = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps, 1 + eps) * adv)
  return jnp.sum(mask * per)


@pytest.mark.parametrize("estimator", distill.ESTIMATORS)
def test_on_policy_loss_and_gradient_equal_a_hand_written_reference(estimator):
  batch = {k: v for k, v in rl_batch(3).items() if k != "ref_logps"}
  d = distill.DistillConfig(mode="on_policy", estimator=estimator, coef=0.7)
  loss_fn = distill.on_policy_loss(tiny_lm_apply, teacher, d, temperature=0.9)
  params = tiny_lm_params(vocab=VOCAB)
  (total, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, None)
  want, want_grads = jax.jit(jax.value_and_grad(reference_on_policy), static_argnums=(2, 3, 4))(
    params, batch, 0.7, estimator, 0.9
  )
  assert_close((total, grads), (want, want_grads), terms=VOCAB * SEQ)
  t_logp = log_softmax64(teacher(batch["inputs"]), 0.9)
  t_pick = np.take_along_axis(t_logp, batch["targets"][..., None], -1)[..., 0]
  gap = np.sum(batch["completion_mask"] * (batch["old_logps"] - t_pick))
  assert_close(float(aux[distill.ON_POLICY_METRIC]), gap, terms=VOCAB * SEQ)


LOSSES = {
  "logits": lambda: distill.supervised_loss(
    tiny_lm_apply, teacher, distill.DistillConfig(alpha=0.4, temperature=1.5), "logits"
  ),
  "gkd": lambda: distill.supervised_loss(
    tiny_lm_apply, teacher, distill.DistillConfig(beta=0.3), "gkd"
  ),
  "on_policy": lambda: distill.on_policy_loss(
    tiny_lm_apply, teacher, distill.DistillConfig(estimator="sampled"), temperature=0.9
  ),
  "on_policy_full": lambda: distill.on_policy_loss(
    tiny_lm_apply, teacher, distill.DistillConfig(estimator="full"), loss_norm="sequences"
  ),
  "on_policy_gkd": lambda: distill.on_policy_loss(
    tiny_lm_apply, teacher, distill.DistillConfig(beta=0.3, coef=0.5), "gkd", temperature=0.8
  ),
}


@pytest.mark.parametrize("mode", list(LOSSES))
def test_k_micro_batches_equal_one_big_batch_for_every_mode(mode):
  """K = 4 against K = 1, one AdamW update, masks and completions of uneven lengths (and
  padding rows): the same loss, metrics and new params."""
  on_policy = mode.startswith("on_policy")
  batch = rl_batch() if on_policy else sft_batch(2)
  units = rl.units_fn("sequences" if mode == "on_policy_full" else "tokens") if on_policy else None
  params, out = tiny_lm_params(vocab=VOCAB), {}
  for k in (1, 4):
    step = make_train_step(LOSSES[mode](), optax.adamw(1e-2), grad_accum_steps=k, units_fn=units)
    state, metrics = jax.jit(step)(step.init(params, 0), batch)
    sums = [n for n in (*distill.SFT_METRICS, distill.ON_POLICY_METRIC) if n in metrics]
    out[k] = (state.params, metrics["loss"], [metrics[n] for n in sums])
  assert_close(out[4], out[1], terms=8 * SEQ * VOCAB)


def _hidden_model(dim: int, seed: int, asked: list):
  """A model whose logits are ``h·W`` (running mean of embeddings → tanh), which gives
  ``(h, W)`` when asked (``as_hidden``), as the bundled decoders do; ``asked`` records it."""
  params = {
    "embed": jax.random.normal(jax.random.key(seed), (VOCAB, dim)),
    "head": jax.random.normal(jax.random.key(seed + 1), (dim, VOCAB)),
  }

  def apply(params, inputs, *, rng=None, train=False, as_hidden=False, **_):
    h = jnp.cumsum(params["embed"][inputs], axis=1) / jnp.arange(1, inputs.shape[1] + 1)[:, None]
    asked.append(as_hidden)
    return (jnp.tanh(h), params["head"]) if as_hidden else jnp.tanh(h) @ params["head"]

  apply.emits_hidden, apply.vocab_size = True, VOCAB
  return apply, params


SLOW_CHUNKED = ("logits", "gkd", "on_policy/sampled")  # the fast tier runs on_policy/full


@pytest.mark.parametrize(
  "mode", ["on_policy/full", *(pytest.param(m, marks=pytest.mark.slow) for m in SLOW_CHUNKED)]
)
def test_a_chunked_distillation_loss_equals_the_whole_logits(mode):
  """From both models' hidden states a few tokens at a time (the last chunk padded), the
  loss, its records and the student's gradient equal the whole logits' to rounding."""
  asked = []
  student, params = _hidden_model(6, 0, asked)
  t_apply, t_params = _hidden_model(10, 5, asked)
  teacher_fn = lambda inputs, **f: t_apply(t_params, inputs, **f)  # noqa: E731
  teacher_fn.emits_hidden = True
  mode, _, estimator = mode.partition("/")
  d = distill.DistillConfig(teacher="t", alpha=0.3, temperature=2.0, beta=0.4, coef=0.7,
                            estimator=estimator or "full")  # fmt: skip
  if mode == "on_policy":  # the sampler's filters: ids 9 and 10 never drawn, a top-k of the rest
    batch = {k: jnp.asarray(v) for k, v in rl_batch(3, rows=4, pad_rows=1).items()}
    batch["targets"] = jnp.minimum(batch["targets"], 8)  # every target can be drawn
    allowed = jnp.arange(VOCAB) < 9
    sampler = dict(temperature=0.9, top_k=9, allowed=allowed, loss_norm="sequences")
    make = lambda chunk: distill.on_policy_loss(student, teacher_fn, d, chunk=chunk, **sampler)  # noqa: E731
  else:
    batch = {k: jnp.asarray(v) for k, v in sft_batch(rows=4).items()}
    make = lambda chunk: distill.supervised_loss(student, teacher_fn, d, mode, chunk)  # noqa: E731
  results = []
  for chunk in (0, 8):  # 8 tokens: 2 positions of the 4 rows a chunk, the 9th padded
    loss = make(chunk)
    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, None)
    results.append((value, aux, grads))
  assert asked.count(True) == 2 and asked.count(False) == 2  # the chunked run asked for h
  (v0, a0, g0), (v1, a1, g1) = results
  assert_close(v1, v0, terms=SEQ * 4)
  for key in a0:
    assert_close(a1[key], a0[key], terms=SEQ * 4)
  assert_close(g1, g0, terms=SEQ * 4 * VOCAB)
  finite = [v0, v1, *a0.values(), *a1.values(), *jax.tree.leaves((g0, g1))]
  assert all(np.isfinite(np.asarray(x)).all() for x in finite)  # a NaN would compare as equal
  assert float(v0) != 0


def test_bad_settings_and_batches_are_one_line():
  for bad, words in (
    ({"mode": "kd"}, "distill.mode must be one of"),
    ({"estimator": "exact"}, "distill.estimator"),
    ({"alpha": 1.5}, "weights in [0, 1]"),
    ({"temperature": 0.0}, "distill.temperature must be > 0"),
    ({"coef": float("nan")}, "distill.coef must be > 0"),
    ({"teacher_dtype": "fp16"}, "fp32 or bf16"),
  ):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
      distill.DistillConfig(**bad)
  assert distill.completion_text([{"role": "assistant", "content": "42"}], "c") == "42"
  for bad in (42, "", [{"role": "user", "content": "42"}]):
    with pytest.raises(DataError, match="a prompt's 'c' must be a non-empty string"):
      distill.check_completion_column(0.5, "c", {"c": ["ok", bad]})
  assert distill.DistillConfig().resolved_mode(rl_run=True) == "on_policy"
  assert distill.DistillConfig().resolved_mode(rl_run=False) == "logits"
  batch = rl_batch()
  batch["advantages"] = np.zeros((3, 3), np.float32)
  loss_fn = rl.grpo_loss(tiny_lm_apply)
  with pytest.raises(BatchError, match="one per row"):
    loss_fn(tiny_lm_params(vocab=VOCAB), batch, None)


def test_the_full_reverse_kl_over_allowed_ids_has_a_finite_gradient():
  """Ids the sampler may not draw are −inf for student and teacher alike: they add nothing
  to the KL and nothing (not NaN) to its gradient."""
  allowed = np.ones(VOCAB, bool)
  allowed[[0, 5]] = False
  batch = {k: v for k, v in rl_batch(4).items() if k != "ref_logps"}
  batch["targets"] = np.where(np.isin(batch["targets"], [0, 5]), 1, batch["targets"])
  d = distill.DistillConfig(estimator="full")
  loss_fn = distill.on_policy_loss(tiny_lm_apply, teacher, d, allowed=jnp.asarray(allowed))
  params = tiny_lm_params(vocab=VOCAB)
  total, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, None)[0])(params)

  def restricted(p):  # the same KL on the allowed ids' logits alone
    keep = np.flatnonzero(allowed)
    s = jax.nn.log_softmax(tiny_lm_apply(p, batch["inputs"])[..., keep], -1)
    t = jax.nn.log_softmax(teacher(batch["inputs"])[..., keep], -1)
    mask = batch["completion_mask"]
    return jnp.sum(mask * jnp.sum(jnp.exp(s) * (s - t), -1))

  want, want_grads = jax.value_and_grad(restricted)(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  assert_close((total, grads), (want, want_grads), terms=VOCAB * SEQ)


@pytest.mark.parametrize(
  "beta",
  [pytest.param(0.0, marks=pytest.mark.slow), 0.4, pytest.param(1.0, marks=pytest.mark.slow)],
)
def test_gkd_on_samples_is_the_jsd_over_the_allowed_ids(beta):
  """GKD on an RL batch (the student's samples): ``coef`` × the generalized JSD at every
  completion position, over the ids the sampler may draw at its temperature; its value and
  gradient equal the JSD of the allowed ids' logits alone (finite, where the others' −inf
  would give NaN), and at β = 1 on-policy's full reverse KL."""
  allowed = np.ones(VOCAB, bool)
  allowed[[0, 5]] = False
  batch = {k: v for k, v in rl_batch(5).items() if k != "ref_logps"}
  batch["targets"] = np.where(np.isin(batch["targets"], [0, 5]), 1, batch["targets"])
  options = dict(allowed=jnp.asarray(allowed), temperature=0.8)
  d = distill.DistillConfig(mode="gkd", beta=beta, coef=0.6)
  loss_fn = distill.on_policy_loss(tiny_lm_apply, teacher, d, "gkd", **options)
  params = tiny_lm_params(vocab=VOCAB)
  total, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, None)[0]))(params)
  keep = np.flatnonzero(allowed)

  def restricted(p):
    s = tiny_lm_apply(p, batch["inputs"])[..., keep] / 0.8
    t = teacher(batch["inputs"])[..., keep] / 0.8
    mask = batch["completion_mask"]
    return 0.6 * jnp.sum(mask * distill.generalized_jsd(s, t, beta))

  want = jax.jit(jax.value_and_grad(restricted))(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  assert_close((total, grads), want, terms=VOCAB * SEQ)
  if beta == 1.0:
    on_policy = distill.DistillConfig(estimator="full", coef=0.6)
    reverse = distill.on_policy_loss(tiny_lm_apply, teacher, on_policy, **options)
    assert_close(float(total), float(reverse(params, batch, None)[0]), terms=VOCAB * SEQ)
  with pytest.raises(ConfigError, match="drop distill.estimator"):
    distill.DistillConfig(mode="gkd", estimator="sampled")


def test_rows_of_given_completions_take_the_policys_own_log_probs_as_old():
  """GKD with lmbda < 1: a row marked ``given`` holds the data's completion, no sample:
  its ``old_logps`` (0 from the rollout) are replaced by the policy's own log-probs, so the
  loss, its gradient and the metrics are those of the batch with those log-probs written in,
  and the sampler check sees no gap there."""
  batch = {k: v for k, v in rl_batch(6).items() if k != "ref_logps"}
  given = np.array([1, 0, 1, 1, 0, 0, 1, 0], np.float32)
  params = tiny_lm_params(vocab=VOCAB)
  own, _ = rl.token_logps(tiny_lm_apply(params, batch["inputs"]), batch["targets"], 0.8)
  written = dict(batch, old_logps=np.where(given[:, None] > 0, np.asarray(own), batch["old_logps"]))
  marked = dict(batch, old_logps=np.where(given[:, None] > 0, 0.0, batch["old_logps"]))
  marked[distill.GIVEN] = given
  d = distill.DistillConfig(mode="gkd", beta=0.5, lmbda=0.5)
  loss_fn = distill.on_policy_loss(tiny_lm_apply, teacher, d, "gkd", temperature=0.8, beta=0.1,
                                   reference=tiny_lm_apply)  # fmt: skip
  value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  (v, aux), g = value_and_grad(params, marked, None)
  (v_w, aux_w), g_w = value_and_grad(params, written, None)
  assert_close((v, g), (v_w, g_w), terms=VOCAB * SEQ)
  for key in ("logp_gap", "kl", distill.ON_POLICY_METRIC):
    assert_close(float(aux[key]), float(aux_w[key]), terms=VOCAB * SEQ)
  sampled = batch["completion_mask"] * (given[:, None] == 0)
  gap = np.abs(np.asarray(own) - batch["old_logps"])
  assert_close(float(aux["logp_gap"]), float(np.sum(gap * sampled)), terms=VOCAB * SEQ)


READ_ONLY_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, optax
from jaxstep import parallel
from jaxstep.core.step import make_train_step

def loss_fn(params, batch, rng, model_state):
  pred = batch["x"] * params["w"] + jnp.sum(model_state["teacher"]) * 0.0
  stats = model_state["stats"] + jnp.mean(batch["x"])  # differs per device: averaged
  loss = jnp.sum(batch["loss_mask"] * (pred - batch["y"]) ** 2)
  return loss, {}, {"teacher": model_state["teacher"], "stats": stats}

mesh = parallel.make_mesh(3, 1)
rng = np.random.default_rng(0)
teacher = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32) / 3.0
batch = {"x": rng.normal(size=(6, 4)).astype(np.float32), "y": np.zeros((6, 4), np.float32),
         "loss_mask": np.ones((6, 4), np.int32)}
step = make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=2, mesh=mesh)
state = step.init({"w": jnp.ones(4)}, 0, model_state={"teacher": teacher, "stats": jnp.zeros(())})
before = np.asarray(state.model_state["teacher"]).copy()
for _ in range(3):
  state, _ = jax.jit(step)(state, parallel.put_batch(batch, parallel.batch_sharding(mesh)))
after = np.asarray(state.model_state["teacher"])
assert np.array_equal(before.view(np.uint32), after.view(np.uint32)), "the teacher drifted"
assert float(state.model_state["stats"]) != 0.0
print("READ-ONLY OK")
"""


def test_a_teacher_in_the_state_is_never_averaged_over_devices():
  """Three devices (averaging three equal floats is not exact): after updates the teacher
  is the same bits; a model-state leaf that differs per device is still averaged."""
  import os
  import subprocess
  import sys

  from conftest import xla_flags

  env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=3")}
  done = subprocess.run(
    [sys.executable, "-c", READ_ONLY_SCRIPT], env=env, capture_output=True, text=True
  )
  assert "READ-ONLY OK" in done.stdout, done.stderr[-2000:]


def test_a_read_only_entry_the_loss_changes_is_kept_on_one_device():
  """Whatever a loss returns for ``"teacher"`` / ``"reference"``, the step keeps them as
  they came (as on many devices); another entry takes what the loss returns."""
  import optax as _optax

  from jaxstep.core.step import make_train_step

  def loss_fn(params, batch, rng, model_state):
    changed = {k: v + 1.0 for k, v in model_state.items()}
    return jnp.sum(batch["x"] * params["w"]), {}, changed

  batch = {"x": np.ones((4, 3), np.float32), "loss_mask": np.ones((4, 3), np.int32)}
  step = make_train_step(loss_fn, _optax.sgd(0.1), grad_accum_steps=2)
  zeros = {k: jnp.zeros(2) for k in ("teacher", "reference", "stats")}
  state, _ = jax.jit(step)(step.init({"w": jnp.ones(3)}, 0, model_state=zeros), batch)
  assert [float(state.model_state[k][0]) for k in ("teacher", "reference", "stats")] == [0, 0, 2]


def test_a_teachers_identity_is_its_weights_when_a_folder():
  from jaxstep.trainer.store.run_state import teacher_change

  a = {"path": "runs/t-hf", "step": 0, "fingerprint": "xxh3:1"}
  assert teacher_change(a, {**a, "path": "/moved/t-hf"}) == ""  # the same weights, moved
  assert "fingerprint xxh3:1 → xxh3:2" in teacher_change(a, {**a, "fingerprint": "xxh3:2"})
  run = {"path": "runs/t", "step": 6}
  assert "step 6 → 9" in teacher_change(run, {**run, "step": 9})
  assert teacher_change({}, run) == teacher_change(run, {}) == ""  # added or dropped


def test_bf16_leaves_a_quantized_teacher_weight_as_stored():
  from types import SimpleNamespace

  from jaxstep.trainer.plan.teacher import cast

  stored = SimpleNamespace(codes=np.zeros(4, np.uint8), scales=np.ones(2, np.float32))
  assert cast(stored, "bf16") is stored
  assert cast(jnp.ones(2), "bf16").dtype == jnp.bfloat16
  assert cast(jnp.ones(2, jnp.int32), "bf16").dtype == jnp.int32
  assert cast(np.ones(2, np.float32), "bf16").dtype == jnp.bfloat16  # a tensor as it is read
