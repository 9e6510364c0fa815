"""The preference losses (``jaxstep.core.preference``) against TRL 1.16, the reference
implementation, and exact over the global batch under gradient accumulation.

TRL's loss code lives inside trainer methods (``DPOTrainer._compute_loss``,
``CPOTrainer``/``ORPOTrainer.get_batch_loss_metrics`` with their ``concatenated_forward``),
and a trainer needs a dataset, a tokenizer and an ``accelerate`` set-up to be built. So the
tests call those methods unbound, on a stub ``self`` holding the attributes the trainer's
``__init__`` would set (``trl_self``) and a stub or tiny model: TRL's own code computes
every number it is compared with, from the same logits (random ones, or a tiny random Llama's).
Importing TRL takes several seconds, so every test that drives it is in the slow tier.
"""

import inspect
import types
import warnings
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_HF_SHAPE, tiny_lm_apply, tiny_lm_params
from tolerance import assert_close, assert_far

from jaxstep.core.accumulate import split_micro_batches
from jaxstep.core.preference import (
  METRICS,
  PAIR_FIELDS,
  SIDES,
  pair_units,
  preference_loss,
  sequence_logps,
)
from jaxstep.core.step import make_train_step
from jaxstep.errors import BatchError, ConfigError

VOCAB = 32
# the brief's fp32 bound, ≈ 1e-5 relative: rtol(100) = 8·ε·10 = 9.5e-6
TERMS = 100
# pairs of various lengths: (prompt, chosen completion, rejected completion) tokens
LENGTHS = [(1, 6, 1), (3, 1, 5), (2, 3, 3), (4, 2, 7)]


def make_examples(lengths=LENGTHS, seed=0, vocab=VOCAB):
  """Token-id pairs in TRL's ``DataCollatorForPreference`` form."""
  rng = np.random.default_rng(seed)
  draw = lambda n: [int(t) for t in rng.integers(1, vocab, n)]  # noqa: E731
  return [
    {"prompt_ids": draw(p), "chosen_ids": draw(c), "rejected_ids": draw(r)} for p, c, r in lengths
  ]


def full_length(examples):
  return max(len(e["prompt_ids"]) + len(e[f"{s}_ids"]) for e in examples for s in SIDES)


def pair_batch(examples, length, pad_rows=0, refs=None, seed=1, vocab=VOCAB):
  """The jaxstep layout of ``examples`` (each sequence right-padded to ``length`` tokens,
  shifted into inputs/targets of ``length − 1``), plus ``pad_rows`` padding rows of random
  tokens whose masks are all ones (so only ``pair_mask`` keeps them out)."""
  rng = np.random.default_rng(seed)
  rows = {name: [] for name in PAIR_FIELDS}
  for e in examples:
    for side in SIDES:
      ids = e["prompt_ids"] + e[f"{side}_ids"]
      completion = [0] * len(e["prompt_ids"]) + [1] * len(e[f"{side}_ids"])
      ids, completion = (np.pad(x, (0, length - len(x))) for x in (ids, completion))
      rows[f"{side}_inputs"].append(ids[:-1])
      rows[f"{side}_targets"].append(ids[1:])
      rows[f"{side}_mask"].append(completion[1:])
  for _ in range(pad_rows):
    for side in SIDES:
      ids = rng.integers(0, vocab, length)
      rows[f"{side}_inputs"].append(ids[:-1])
      rows[f"{side}_targets"].append(ids[1:])
      rows[f"{side}_mask"].append(np.ones(length - 1))
  batch = {name: jnp.asarray(np.stack(v), jnp.int32) for name, v in rows.items()}
  batch["pair_mask"] = jnp.asarray([1] * len(examples) + [0] * pad_rows, jnp.int32)
  if refs is not None:
    for i, side in enumerate(SIDES):
      batch[f"ref_{side}_logps"] = jnp.asarray(np.concatenate([refs[i], [np.nan] * pad_rows]))
  return batch


def fixed_logits(logits):
  """An ``apply_fn`` that returns ``logits`` whatever its params (a stand-in model)."""

  def apply_fn(params, inputs, *, rng=None, train=False):
    assert inputs.shape == logits.shape[:2], (inputs.shape, logits.shape)
    return logits

  return apply_fn


# ---------------------------------------------------------------------------- TRL's side


@pytest.fixture(scope="module")
def trl():
  pytest.importorskip("trl")
  torch = pytest.importorskip("torch")
  with warnings.catch_warnings():  # "trl.experimental ... APIs here are unstable"
    warnings.simplefilter("ignore")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
  from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
  from trl.trainer.utils import add_fused_lm_head, selective_log_softmax

  return SimpleNamespace(
    torch=torch,
    DPOTrainer=DPOTrainer,
    CPOTrainer=CPOTrainer,
    ORPOTrainer=ORPOTrainer,
    collate=DataCollatorForPreference(pad_token_id=0),
    add_fused_lm_head=add_fused_lm_head,
    selective_log_softmax=selective_log_softmax,
  )


class OneProcess:
  """What the trainers read of ``accelerate.Accelerator`` on one CPU process."""

  def __init__(self, torch):
    self.device = torch.device("cpu")

  def gather(self, x):
    return x

  gather_for_metrics = gather

  def unwrap_model(self, model):
    return model


def trl_self(trl, cls, methods=(), **attrs):
  """A stub ``self`` for calling ``cls``'s methods unbound: ``attrs`` as the trainer's
  ``__init__`` sets them from its config, ``methods`` of ``cls`` bound to the stub
  (static methods as they are)."""
  stub = SimpleNamespace(accelerator=OneProcess(trl.torch), **attrs)
  for name in methods:
    fn = inspect.getattr_static(cls, name)
    setattr(stub, name, fn if isinstance(fn, staticmethod) else types.MethodType(fn, stub))
  return stub


class FusedHead:
  """What ``add_fused_lm_head`` makes of a model, for fixed ``logits``: per-token
  log-probs of the labels (TRL's ``selective_log_softmax``), zero where the label is -100."""

  training = True

  def __init__(self, trl, logits):
    self.trl, self.logits = trl, logits

  def __call__(self, *, input_ids, labels, fused_lm_head, **kwargs):
    assert fused_lm_head and tuple(input_ids.shape) == tuple(self.logits.shape[:2])
    torch, labels = self.trl.torch, labels[:, 1:]
    logps = self.trl.selective_log_softmax(self.logits[:, :-1], labels.clamp(min=0))
    zeros = torch.zeros_like(logps)
    return SimpleNamespace(
      log_probs=logps.masked_fill(labels == -100, 0.0),
      entropy=zeros,
      mean_logits=zeros,
      is_top1=zeros.bool(),
    )


class FixedLogits:
  """A model for ``concatenated_forward``: returns ``logits`` for the 2B rows it gets."""

  def __init__(self, logits):
    self.logits = logits

  def __call__(self, input_ids, **kwargs):
    assert tuple(input_ids.shape) == tuple(self.logits.shape[:2])
    return SimpleNamespace(logits=self.logits)


def trl_dpo(trl, loss_type, beta, examples, model, *, refs=None, ref_model=None, smoothing=0.0):
  """``DPOTrainer._compute_loss`` on ``examples`` collated by TRL's own collator:
  (loss, {metric: batch mean}). ``loss_type``: one of TRL's, or ``(types, weights)``."""
  types, weights = loss_type if isinstance(loss_type, tuple) else ([loss_type], [1.0])
  torch = trl.torch
  inputs = trl.collate([dict(e) for e in examples])
  if refs is not None:
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = (torch.tensor(r) for r in refs)
  stub = trl_self(
    trl,
    trl.DPOTrainer,
    model=model,
    ref_model=ref_model,
    precompute_ref_logps=refs is not None,
    beta=beta,
    loss_types=types,
    loss_weights=weights,
    ld_alpha=None,
    f_divergence_type="reverse_kl",
    label_smoothing=smoothing,
    use_weighting=False,
    aux_loss_enabled=False,
    args=SimpleNamespace(gradient_checkpointing_kwargs=None),
    _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    _total_train_tokens=0,
    _tp_size=1,
  )
  with torch.no_grad():
    loss = trl.DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
  mode = "train" if model.training else "eval"
  return float(loss), {k: v[0] for k, v in stub._metrics[mode].items()}


def cpo_orpo_batch(trl, examples, length):
  """``CPOTrainer``/``ORPOTrainer``'s tokenized batch: prompt + completion ids, prompt labels
  -100, right-padded to ``length`` (labels with -100)."""
  torch, batch = trl.torch, {}
  for side in SIDES:
    ids = [e["prompt_ids"] + e[f"{side}_ids"] for e in examples]
    labels = [[-100] * len(e["prompt_ids"]) + e[f"{side}_ids"] for e in examples]
    pad = lambda rows, value: torch.tensor([r + [value] * (length - len(r)) for r in rows])  # noqa: E731
    batch[f"{side}_input_ids"] = pad(ids, 0)
    batch[f"{side}_attention_mask"] = pad([[1] * len(r) for r in ids], 0)
    batch[f"{side}_labels"] = pad(labels, -100)
  return batch


def trl_cpo_orpo(
  trl, loss, examples, logits, *, beta=0.1, gamma=0.5, cpo_alpha=0.0, orpo_lambda=0.1
):
  """``get_batch_loss_metrics`` of TRL's CPO (``loss_type="simpo"``) or ORPO trainer, its
  ``concatenated_forward`` run on a model returning ``logits``: (loss, metrics)."""
  methods = ("concatenated_inputs", "concatenated_forward", "get_batch_logps")
  common = dict(is_encoder_decoder=False, aux_loss_enabled=False)
  if loss == "simpo":
    cls = trl.CPOTrainer
    stub = trl_self(
      trl,
      cls,
      (*methods, "cpo_loss"),
      loss_type="simpo",
      beta=beta,
      simpo_gamma=gamma,
      cpo_alpha=cpo_alpha,
      label_smoothing=0.0,
      alpha=0.0,
      pad_token_id=0,
      **common,
    )
  else:
    cls = trl.ORPOTrainer
    stub = trl_self(
      trl, cls, (*methods, "odds_ratio_loss"), beta=orpo_lambda, padding_value=0, **common
    )
  batch = cpo_orpo_batch(trl, examples, logits.shape[1])
  with trl.torch.no_grad():
    loss, metrics = cls.get_batch_loss_metrics(stub, FixedLogits(logits), batch)
  return float(loss), metrics


def random_logits(trl, n_rows, length, seed):
  gen = trl.torch.Generator().manual_seed(seed)
  return 2.0 * trl.torch.randn(n_rows, length, VOCAB, generator=gen)


def pairs_of(examples, logits_t, idx, refs=None):
  """Pairs ``idx`` of ``examples``: their TRL logits rows (chosen then rejected, cut to
  their own length) and reference log-probs."""
  b, chosen = len(examples), [examples[i] for i in idx]
  sub = logits_t[[*idx, *(b + i for i in idx)]][:, : full_length(chosen)]
  return chosen, sub, None if refs is None else tuple(r[list(idx)] for r in refs)


def ours_on(logits_t, examples, *, pad_rows=0, refs=None, **options):
  """jaxstep's ``loss_fn`` on ``examples`` (plus padding rows) with TRL's 2B rows of
  ``logits_t`` [chosen; rejected], shifted to jaxstep's inputs: (loss_sum, aux)."""
  b, length = len(examples), logits_t.shape[1]
  shifted = np.asarray(logits_t[:, :-1])
  junk = np.random.default_rng(7).normal(size=(pad_rows, length - 1, VOCAB)).astype(np.float32)
  logits = np.concatenate([shifted[:b], junk, shifted[b:], junk])
  batch = pair_batch(examples, length, pad_rows, refs)
  return preference_loss(fixed_logits(jnp.asarray(logits)), **options)(None, batch, None)


# ------------------------------------------------------------------------------- TRL parity


@pytest.mark.slow
@pytest.mark.parametrize(
  "case",
  [
    ("dpo", {"beta": 0.1}, "sigmoid"),
    ("dpo", {"beta": 0.5}, "sigmoid"),
    ("ipo", {"beta": 0.1}, "ipo"),
    ("dpo", {"beta": 0.1, "rpo_alpha": 0.5}, (["sigmoid", "sft"], [1.0, 0.5])),
    ("simpo", {"beta": 2.0, "gamma": 0.5}, "simpo"),
    ("simpo", {"beta": 2.0, "gamma": 1.0, "cpo_alpha": 1.0}, "simpo"),
    ("orpo", {"orpo_lambda": 0.1}, "orpo"),
    ("orpo", {"orpo_lambda": 0.5}, "orpo"),
  ],
  ids=lambda case: f"{case[0]}-" + "-".join(f"{k}{v}" for k, v in case[1].items()),
)
def test_each_loss_and_its_metrics_equal_trls(trl, case):
  """Per pair (TRL called on that pair alone) and over the batch (TRL's logged means
  against jaxstep's sums / N, with a padding row on jaxstep's side only), on the same
  random logits, pairs of very different prompt and completion lengths."""
  loss, options, trl_type = case
  examples = make_examples()
  b, length = len(examples), full_length(examples)
  logits_t = random_logits(trl, 2 * b, length, seed=3)
  refs = None
  if loss in ("dpo", "ipo"):
    refs = tuple(np.random.default_rng(s).uniform(-30, -5, b).astype(np.float32) for s in (4, 5))

  def trl_run(idx):
    chosen, sub, sub_refs = pairs_of(examples, logits_t, idx, refs)
    if loss in ("dpo", "ipo"):
      return trl_dpo(trl, trl_type, options["beta"], chosen, FusedHead(trl, sub), refs=sub_refs)
    return trl_cpo_orpo(trl, loss, chosen, sub, **options)

  def ours_run(idx, pad_rows=0):
    chosen, sub, sub_refs = pairs_of(examples, logits_t, idx, refs)
    return ours_on(sub, chosen, pad_rows=pad_rows, refs=sub_refs, loss=loss, **options)

  for i in range(b):  # one pair: TRL's loss is that pair's loss
    want_loss, want = trl_run([i])
    got_loss, got = ours_run([i])
    if loss == "orpo":  # TRL's NLL term also covers the prompt; the odds-ratio term is shared
      assert_close(float(got_loss - got["nll_loss"]), want_loss - want["nll_loss"], terms=TERMS)
      if len(examples[i]["prompt_ids"]) == 1:  # no prompt token is predicted: the same NLL
        assert_close(float(got_loss), want_loss, terms=TERMS)
    else:
      assert_close(float(got_loss), want_loss, terms=TERMS)
    for name in METRICS:
      assert_close(float(got[name]), float(want[name]), terms=TERMS)

  want_loss, want = trl_run(list(range(b)))  # the batch: TRL's means, with a padding row here
  got_loss, got = ours_run(list(range(b)), pad_rows=1)
  assert float(got["rewards/accuracies"]) == pytest.approx(b * want["rewards/accuracies"])
  for name in METRICS:
    assert_close(float(got[name]) / b, float(want[name]), terms=TERMS)
  nll = options.get("cpo_alpha") or options.get("rpo_alpha") or loss == "orpo"
  if not nll:
    assert_close(float(got_loss) / b, want_loss, terms=TERMS)
  else:  # TRL's NLL is a mean over the batch's tokens, not over pairs (the docstring)
    assert abs(float(got_loss) / b - want_loss) > 1e-3
  assert_far(float(got_loss) / (b + 1), float(got_loss) / b, terms=TERMS)  # padding counted


@pytest.mark.slow
def test_dpo_label_smoothing_is_trls_conservative_dpo(trl):
  """ε > 0. TRL 1.16's DPO sigmoid ignores ``label_smoothing`` (pinned below, as the
  docstring says so), so the conservative-DPO loss −(1−ε)·logσ(β·h) − ε·logσ(−β·h) is
  checked against TRL's ``CPOTrainer.cpo_loss`` (``loss_type="sigmoid"``, ``alpha=0``),
  which computes exactly that of the log-probs it is given: here the log-ratios π − ref,
  read off TRL's DPO as its rewards at β = 1."""
  torch, beta, eps = trl.torch, 0.2, 0.15
  examples = make_examples()
  b, length = len(examples), full_length(examples)
  logits_t = random_logits(trl, 2 * b, length, seed=8)
  refs = tuple(np.random.default_rng(s).uniform(-30, -5, b).astype(np.float32) for s in (4, 5))
  ratios = []
  for i in range(b):
    chosen, sub, sub_refs = pairs_of(examples, logits_t, [i], refs)
    _, m = trl_dpo(trl, "sigmoid", 1.0, chosen, FusedHead(trl, sub), refs=sub_refs)
    ratios.append((m["rewards/chosen"], m["rewards/rejected"]))
  stub = trl_self(
    trl, trl.CPOTrainer, loss_type="sigmoid", beta=beta, label_smoothing=eps, alpha=0.0
  )
  losses, _, _ = trl.CPOTrainer.cpo_loss(stub, *torch.tensor(ratios).T)
  got, _ = ours_on(logits_t, examples, pad_rows=1, refs=refs, beta=beta, label_smoothing=eps)
  plain, _ = ours_on(logits_t, examples, refs=refs, beta=beta)
  assert_close(float(got) / b, float(losses.mean()), terms=TERMS)
  assert_far(float(plain) / b, float(losses.mean()), terms=TERMS)  # ε changes the loss
  trl_smoothed, _ = trl_dpo(
    trl, "sigmoid", beta, examples, FusedHead(trl, logits_t), refs=refs, smoothing=eps
  )
  assert_close(float(plain) / b, trl_smoothed, terms=TERMS)  # TRL's DPO: ε had no effect


LLAMA = TINY_HF_SHAPE  # the tiny random Llama the parity tests share
# jaxstep against transformers on the same weights: the longest sum (the MLP) once per layer
LLAMA_TERMS = 4 * LLAMA["hidden_size"] * LLAMA["num_hidden_layers"]


def tiny_llama(trl, folder, seed):
  """A random ``LlamaForCausalLM`` (every weight drawn) saved to ``folder``, and the same
  weights read into jaxstep by its HF import: (torch model, apply_fn, params)."""
  transformers = pytest.importorskip("transformers")
  from jaxstep import models
  from jaxstep.models import hf_config, hf_weights

  torch = trl.torch
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(**LLAMA, attn_implementation="eager")
  model = transformers.LlamaForCausalLM(cfg)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  model = model.float().eval()
  model.save_pretrained(folder)
  jax_cfg = hf_config.model_config(hf_config.read_config(folder), attention="xla")
  apply_fn, _ = models.build(jax_cfg, 0, abstract=True)
  return model, apply_fn, hf_weights.read_params(folder, jax_cfg)


@pytest.mark.slow
def test_dpo_of_a_tiny_llama_and_its_reference_model_equals_trl(trl, tmp_path):
  """End to end on models: a random Llama (policy) and another (reference), in transformers
  and read into jaxstep. TRL's ``DPOTrainer._compute_loss`` runs both through its fused LM
  head (``add_fused_lm_head``, as its ``__init__`` does) on its collator's batch; jaxstep
  runs ``preference_loss(apply_fn, reference=...)`` on the pair layout with a padding row.
  On the way: ``sequence_logps`` on transformers' own logits equals TRL's
  ``get_batch_logps`` (sum and token-mean), and on jaxstep's logits TRL's fused head."""
  torch = trl.torch
  policy, apply_fn, params = tiny_llama(trl, tmp_path / "policy", seed=0)
  ref_model, ref_apply, ref_params = tiny_llama(trl, tmp_path / "reference", seed=1)
  examples = make_examples(seed=2)
  b, length = len(examples), full_length(examples)
  batch = pair_batch(examples, length, pad_rows=1, vocab=LLAMA["vocab_size"])

  # log-probs on the same logits: transformers' forward, TRL's get_batch_logps
  inputs = trl.collate([dict(e) for e in examples])
  labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
  with torch.no_grad():
    logits_t = policy(input_ids=inputs["input_ids"]).logits
  targets = jnp.concatenate([batch["chosen_targets"][:b], batch["rejected_targets"][:b]])
  mask = jnp.concatenate([batch["chosen_mask"][:b], batch["rejected_mask"][:b]])
  sums, counts = sequence_logps(jnp.asarray(logits_t[:, :-1].numpy()), targets, mask)
  for average, ours in ((False, sums), (True, sums / counts)):
    want = trl.CPOTrainer.get_batch_logps(logits_t, labels, average_log_prob=average)
    assert_close(np.asarray(ours), want.numpy(), terms=TERMS)

  # log-probs of jaxstep's forward against TRL's fused head on transformers' weights
  trl.add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
  trl.add_fused_lm_head(ref_model)
  with torch.no_grad():
    fused = policy(**inputs, labels=labels, fused_lm_head=True).log_probs.sum(1)
  rows = jnp.concatenate([batch["chosen_inputs"][:b], batch["rejected_inputs"][:b]])
  jax_sums, _ = sequence_logps(apply_fn(params, rows), targets, mask)
  assert_close(np.asarray(jax_sums), fused.numpy(), terms=LLAMA_TERMS)

  want_loss, want = trl_dpo(trl, "sigmoid", 0.1, examples, policy, ref_model=ref_model)
  reference = lambda _, x: ref_apply(ref_params, x)  # noqa: E731  (its own weights)
  loss_fn = preference_loss(apply_fn, loss="dpo", beta=0.1, reference=reference)
  got_loss, got = jax.jit(loss_fn)(params, batch, jax.random.key(0))
  n = int(pair_units(batch))
  assert n == b
  got_all = {"loss": got_loss / n, **{k: got[k] / n for k in METRICS}}
  want_all = {"loss": want_loss, **{k: want[k] for k in METRICS}}
  # one comparison: the loss and rewards come out of log-prob sums of the scale of logps/*
  assert_close(jax.tree.map(float, got_all), want_all, terms=LLAMA_TERMS)


# --------------------------------------------------------------------- exact over the batch

TINY_VOCAB = 11  # conftest's tiny_lm
# five real pairs of very different lengths and three padding rows: G = 8
EXACT_LENGTHS = [(1, 9, 1), (2, 1, 6), (3, 4, 4), (1, 2, 8), (2, 7, 2)]
OPTIMIZER = optax.adamw(1e-2, weight_decay=0.1)
EXACT_CASES = {
  "dpo": {"beta": 0.5},  # its reference: a callable (another tiny_lm)
  "ipo": {"beta": 0.5},  # its reference: log-probs in the batch
  "simpo": {"beta": 2.0, "gamma": 0.3, "cpo_alpha": 0.5},
  "orpo": {"orpo_lambda": 0.5},
}


def exact_setup(loss):
  examples = make_examples(EXACT_LENGTHS, seed=3, vocab=TINY_VOCAB)
  refs, options = None, dict(EXACT_CASES[loss])
  if loss == "dpo":
    ref_params = tiny_lm_params(vocab=TINY_VOCAB, seed=1)
    options["reference"] = lambda _, x: tiny_lm_apply(ref_params, x)
  if loss == "ipo":
    refs = tuple(np.random.default_rng(s).uniform(-20, -5, 5).astype(np.float32) for s in (1, 2))
  batch = pair_batch(examples, full_length(examples), 3, refs, vocab=TINY_VOCAB)
  return batch, preference_loss(tiny_lm_apply, loss=loss, **options)


@pytest.mark.slow  # two compiled steps: ~4 s of CPU each case
@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "orpo"])
def test_k_micro_batches_equal_one_batch_with_padding_pairs(loss):
  """K = 4 against K = 1 (one AdamW update, its loss and metrics) on a batch whose last
  three rows are padding pairs: with ``units_fn=pair_units`` both are the mean over the 5
  real pairs, which is also the mean of each pair's loss computed alone."""
  batch, loss_fn = exact_setup(loss)
  params = tiny_lm_params(vocab=TINY_VOCAB)
  out = {}
  for k in (1, 4):
    step = make_train_step(loss_fn, OPTIMIZER, grad_accum_steps=k, units_fn=pair_units)
    new_state, metrics = jax.jit(step)(step.init(params, 0), batch)
    assert bool(metrics["updated"]) and int(metrics["tokens"]) == 5
    out[k] = (new_state.params, {n: metrics[n] for n in ("loss", *METRICS)})
  length = batch["chosen_inputs"].shape[1]
  terms = 8 * length * TINY_VOCAB  # the gradient: over the pairs' tokens of vocabulary sums
  assert_close(out[4], out[1], terms=terms)
  single = jax.jit(lambda p, b: loss_fn(p, b, None)[0])  # one pair: one compile, 5 calls
  alone = [
    float(single(params, jax.tree.map(lambda x, i=i: x[i : i + 1], batch))) for i in range(5)
  ]
  assert_close(float(out[4][1]["loss"]), float(np.mean(alone)), terms=terms)


def test_a_mean_of_micro_batch_means_is_not_the_pair_mean():
  """The wrong variant beside the exact one: K = 4 micro-batches of 2 rows hold 2, 1, 1
  and 1 real pairs, so averaging each micro-batch by its own pairs weights the pairs
  unevenly, and the loss and the gradient both miss the mean over the 5 pairs (what the
  step computes: ``Σ_k grad(loss_sum_k / N)``, N = 5, checked here against it)."""
  batch, loss_fn = exact_setup("dpo")
  params = tiny_lm_params(vocab=TINY_VOCAB)
  value_and_grad = jax.jit(jax.value_and_grad(lambda p, b, n: loss_fn(p, b, None)[0] / n))
  exact = value_and_grad(params, batch, 5)
  micro = [jax.tree.map(lambda x, k=k: x[k], split_micro_batches(batch, 4)) for k in range(4)]
  pairs = [int(pair_units(part)) for part in micro]
  assert pairs == [2, 1, 1, 1]
  step_sum = jax.tree.map(lambda *x: sum(x), *(value_and_grad(params, m, 5) for m in micro))
  per_micro = [value_and_grad(params, m, n) for m, n in zip(micro, pairs, strict=True)]
  mean_of_means = jax.tree.map(lambda *x: sum(x) / 4, *per_micro)
  terms = 8 * batch["chosen_inputs"].shape[1] * TINY_VOCAB
  assert_close(step_sum, exact, terms=terms)
  assert_far(mean_of_means[0], exact[0], terms=terms)
  assert_far(mean_of_means[1], exact[1], terms=terms)


# ------------------------------------------------------------------------- the small pieces


def test_sequence_logps_sums_completion_log_probs_in_fp32():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 7)).astype(np.float32) * 3
  targets = rng.integers(0, 7, (3, 5))
  mask = np.array([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
  logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  want = (np.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask).sum(-1)
  sums, counts = sequence_logps(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  assert sums.dtype == jnp.float32 and counts.tolist() == [3.0, 1.0, 0.0]
  assert_close(np.asarray(sums), want, terms=7)
  # bf16 logits are upcast before the log-softmax: the same as upcasting them first
  low = jnp.asarray(logits, jnp.bfloat16)
  from_bf16 = sequence_logps(low, jnp.asarray(targets), jnp.asarray(mask))[0]
  assert from_bf16.dtype == jnp.float32
  assert np.array_equal(from_bf16, sequence_logps(low.astype(jnp.float32), targets, mask)[0])


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_refuse_a_reference(loss):
  with pytest.raises(ValueError, match=r"reference=.*reference-free"):
    preference_loss(tiny_lm_apply, loss=loss, reference=tiny_lm_apply)


@pytest.mark.parametrize(
  "options, named",
  [
    ({"loss": "dpo", "gamma": 0.5}, "gamma="),
    ({"loss": "ipo", "label_smoothing": 0.1}, "label_smoothing="),
    ({"loss": "simpo", "orpo_lambda": 0.1}, "orpo_lambda="),
    ({"loss": "kto"}, "not a preference loss"),
    ({"loss": "dpo", "label_smoothing": 0.7}, r"\[0, 0.5\]"),
  ],
)
def test_options_a_loss_does_not_take_are_refused(options, named):
  with pytest.raises(ValueError, match=named):
    preference_loss(tiny_lm_apply, **options)


def test_a_batch_missing_a_field_is_named():
  batch, loss_fn = exact_setup("simpo")
  params = tiny_lm_params(vocab=TINY_VOCAB)
  for field in ("rejected_mask", "pair_mask"):
    partial = {k: v for k, v in batch.items() if k != field}
    with pytest.raises(BatchError, match=f"'{field}'"):
      loss_fn(params, partial, None)
  with pytest.raises(BatchError, match="pair_mask"):
    pair_units({"loss_mask": batch["chosen_mask"]})
  dpo = preference_loss(tiny_lm_apply, loss="dpo")  # no reference= and none in the batch
  with pytest.raises(BatchError, match="ref_chosen_logps.*reference="):
    dpo(params, batch, None)
  one_ref = {**batch, "ref_chosen_logps": jnp.zeros(8)}
  with pytest.raises(BatchError, match="without its partner"):
    dpo(params, one_ref, None)


def test_rpo_alpha_adds_the_chosen_mean_nll_to_dpo_and_ipo():
  """``rpo_alpha``·(−π_c/n_c) on top of each pair's dpo or ipo loss, reported as nll_loss;
  the other losses refuse it."""
  from jaxstep.core.preference import PreferenceConfig, pair_losses

  rng = np.random.default_rng(0)
  logps = tuple(jnp.asarray(rng.uniform(-40, -5, 6), jnp.float32) for _ in range(2))
  refs = tuple(jnp.asarray(rng.uniform(-40, -5, 6), jnp.float32) for _ in range(2))
  tokens = (jnp.asarray([3.0, 5, 1, 8, 2, 4]), jnp.asarray([2.0, 6, 1, 3, 9, 4]))
  for loss in ("dpo", "ipo"):
    plain = pair_losses(loss, logps, tokens, refs, beta=0.2)
    rpo = pair_losses(loss, logps, tokens, refs, beta=0.2, rpo_alpha=0.7)
    nll = -np.asarray(logps[0]) / np.asarray(tokens[0])
    np.testing.assert_allclose(rpo["nll_loss"], nll, rtol=1e-6)
    np.testing.assert_allclose(rpo["loss"], np.asarray(plain["loss"]) + 0.7 * nll, rtol=1e-6)
    assert "nll_loss" not in plain
  with pytest.raises(ConfigError, match="rpo_alpha"):
    PreferenceConfig(loss="simpo", rpo_alpha=1.0)
  with pytest.raises(ConfigError, match="rpo_alpha="):
    preference_loss(lambda *a, **k: None, loss="orpo", rpo_alpha=1.0)


def _torch_tree(trl, model, folder, values, read):
  """``values`` (a tensor per parameter of ``model``) in jaxstep's layout: written into a
  copy of ``model`` saved as an HF folder and read back by jaxstep's import (``read``)."""
  import copy

  torch = trl.torch
  holder = copy.deepcopy(model)
  with torch.no_grad():
    for p, v in zip(holder.parameters(), values, strict=True):
      p.copy_(v)
  holder.save_pretrained(folder)
  return read(folder)


@pytest.mark.slow
def test_two_adamw_updates_of_a_tiny_llama_equal_trls_dpo_loss_under_torch(trl, tmp_path):
  """TRL's ``DPOTrainer._compute_loss`` (its fused head over a transformers Llama, a second
  Llama as the reference) differentiated by torch and stepped by ``torch.optim.AdamW``,
  against jaxstep's ``make_train_step`` (K = 2, two padding rows) with ``optax.adamw`` of the
  same hyperparameters: the first update's gradient, and the parameters after two updates,
  agree leaf by leaf."""
  from jaxstep.models import hf_config, hf_weights

  torch = trl.torch
  policy, apply_fn, params = tiny_llama(trl, tmp_path / "policy", seed=0)
  ref_model, ref_apply, ref_params = tiny_llama(trl, tmp_path / "reference", seed=1)
  jax_cfg = hf_config.model_config(hf_config.read_config(tmp_path / "policy"), attention="xla")
  read = lambda folder: hf_weights.read_params(folder, jax_cfg)  # noqa: E731
  examples = make_examples(seed=2)
  batch = pair_batch(examples, full_length(examples), pad_rows=2, vocab=LLAMA["vocab_size"])
  lr, wd, beta = 1e-3, 0.01, 0.1

  trl.add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
  trl.add_fused_lm_head(ref_model)
  policy.train()  # no dropout in this config: train mode computes what eval mode does
  opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
  inputs = trl.collate([dict(e) for e in examples])
  torch_grads = None
  for _ in range(2):
    opt.zero_grad()
    stub = trl_self(
      trl,
      trl.DPOTrainer,
      model=policy,
      ref_model=ref_model,
      precompute_ref_logps=False,
      beta=beta,
      loss_types=["sigmoid"],
      loss_weights=[1.0],
      ld_alpha=None,
      f_divergence_type="reverse_kl",
      label_smoothing=0.0,
      use_weighting=False,
      aux_loss_enabled=False,
      args=SimpleNamespace(gradient_checkpointing_kwargs=None),
      _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
      _total_train_tokens=0,
      _tp_size=1,
    )
    trl.DPOTrainer._compute_loss(stub, policy, inputs, return_outputs=False).backward()
    if torch_grads is None:
      torch_grads = [p.grad.detach().clone() for p in policy.parameters()]
    opt.step()

  reference = lambda _, x: ref_apply(ref_params, x)  # noqa: E731
  loss_fn = preference_loss(apply_fn, loss="dpo", beta=beta, reference=reference)
  optimizer = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=wd)
  step = make_train_step(loss_fn, optimizer, grad_accum_steps=2, units_fn=pair_units)
  state = step.init(params, jax.random.key(0))
  n = float(pair_units(batch))
  grads = jax.grad(lambda p: loss_fn(p, batch, jax.random.key(0))[0] / n)(params)
  step = jax.jit(step)
  for _ in range(2):
    state, _ = step(state, batch)

  want_grads = _torch_tree(trl, policy, tmp_path / "grads", torch_grads, read)
  assert_close(jax.device_get(grads), jax.device_get(want_grads), terms=LLAMA_TERMS)
  want = _torch_tree(
    trl, policy, tmp_path / "after", [p.detach() for p in policy.parameters()], read
  )
  moved = jax.tree.map(
    lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), state.params, params
  )
  assert min(jax.tree.leaves(moved)) > 1e-4  # every leaf took two real steps
  np.testing.assert_allclose(
    np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(state.params))]),
    np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(want))]),
    atol=1e-5,
  )
