"""``jaxstep.RLTrainer``: RL with verifiable rewards (GRPO and its variants, ``docs/rl.md``)
on your own model, with ``jaxstep.Trainer``'s run driver.

Each update takes the next P = G / ``rl.num_generations`` prompts, samples
``num_generations`` completions of each with the current params (``Generator``: the bundled
models over their key/value cache, any ``apply_fn`` by full recompute), scores them with
your reward functions, turns them into group advantages and trains on them through the
exact accumulating step (``core.rl.grpo_loss``, normalized by ``rl.loss_norm``'s global
count) ``rl.iterations`` times. What ``jaxstep train`` does for an RL config, the same
parts: hooks, callbacks, trackers, ``metrics.jsonl`` (TRL's names), checkpoints that hold
the prompt position (a rollout's seed follows from the run's seed and its index, so kill
and resume is bitwise), the sampler/trainer log-prob check, and held-out prompt sets
decoded greedily and scored every ``train.eval_every`` update steps.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep import models, parallel
from jaxstep.core import distill as distill_core
from jaxstep.core import rl as rl_core
from jaxstep.data.prompt_rows import PromptSet, prompt_set
from jaxstep.errors import ConfigError
from jaxstep.generation import Generator
from jaxstep.generation.sampling import allowed_ids
from jaxstep.trainer import trainer_data
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.loop import assembly
from jaxstep.trainer.plan.reference_model import frozen_copy, loss_with_reference, loss_with_teacher
from jaxstep.trainer.plan.rl_plan import grpo_options, with_token_means
from jaxstep.trainer.plan.teacher import cast
from jaxstep.trainer.rl import evaluate as rl_evaluate
from jaxstep.trainer.rl.logp_check import LogpCheck
from jaxstep.trainer.rl.rewards import load_rewards
from jaxstep.trainer.rl.source import HOST, ROLLOUT_FILE, Rollouts
from jaxstep.trainer.trainer_run import Trainer

GAP_CAUSE = (
  "the loss's forward differs from the sampler's (dropout on in train=True, a lower "
  "precision); make them agree, or raise rl.logp_tolerance"
)


class RLTrainer(Trainer):
  """Trains a policy on its own samples, scored by reward functions.

  Args:
    model: a ``GPTConfig`` or ``LlamaConfig``, or your ``apply_fn(params, tokens, *,
      rng=None, train=False) -> logits`` (then ``max_seq_len`` is required).
    params: the starting params: the policy, and with ``rl.beta`` > 0 the frozen reference
      (a copy in ``rl.reference_dtype``, carried in the state's ``model_state``).
    optimizer: an optax transformation or an ``OptimConfig``, as for ``Trainer``.
    prompts: the training prompts: rows as a JSONL file holds them (dicts with a
      ``"prompt"``, a string or a message list, and the columns the rewards read), or a
      ``data.prompt_rows.PromptSet``.
    tokenizer: a ``jaxstep.data`` tokenizer (encodes the prompts, decodes completions).
    rewards: ``reward(prompts, completions, **columns) -> list[float]`` functions (or
      bundled names / ``module:function``), summed with ``reward_weights`` (default 1 each).
    rl: ``RLConfig`` or a dict of its keys (``num_generations``, ``iterations``,
      ``max_new_tokens``, ``temperature``, ``advantage``, ``loss_norm``, ``beta`` …).
    eval_prompts: ``{name: prompts}``, each decoded greedily and scored with the rewards
      every ``train.eval_every`` update steps and at the end (``eval_reward``,
      ``eval_rewards/<name>``).
    max_seq_len: the longest input an ``apply_fn`` takes.
    run_dir, train, checkpoint, mesh, trainable, mlflow, wandb, hparams, callbacks: as for
      ``Trainer``; ``train.global_batch_size`` counts completions.
    teacher: ``(model, params)`` of a frozen teacher with the policy's vocabulary (a config
      or an ``apply_fn``): distillation on the policy's samples (``docs/distill.md``)
      replaces the reward advantages by the teacher's per-token reverse KL (``on_policy``)
      or generalized JSD (``gkd``, with ``lmbda`` < 1 a share of rollouts the prompts' own
      ``completion_column``); the rewards still score the samples and the held-out
      prompts. The teacher rides in the state's ``model_state`` and never in a checkpoint
      (give it again to resume).
    distill: ``DistillConfig`` or a dict of its keys (``mode``, ``estimator``, ``beta``,
      ``coef``, ``lmbda``, ``completion_column``, ``teacher_dtype``).

  Example:
    >>> trainer = RLTrainer(cfg, params, OptimConfig(lr=1e-4), prompts=rows,
    ...                     tokenizer=tok, rewards=[exact_answer], run_dir="runs/grpo",
    ...                     rl={"num_generations": 8, "max_new_tokens": 5},
    ...                     train={"global_batch_size": 64, "max_steps": 100})
    >>> trainer.fit()
  """

  def __init__(
    self,
    model,
    params,
    optimizer,
    *,
    prompts,
    tokenizer,
    rewards: Sequence[Callable | str],
    run_dir: str | pathlib.Path,
    rl: rl_core.RLConfig | Mapping | None = None,
    reward_weights: Sequence[float] = (),
    eval_prompts: Mapping[str, object] | None = None,
    max_seq_len: int | None = None,
    train=None,
    checkpoint=None,
    mesh=None,
    trainable=None,
    mlflow=None,
    wandb=None,
    hparams: Mapping | None = None,
    callbacks: Sequence = (),
    teacher: tuple | None = None,
    distill: distill_core.DistillConfig | Mapping | None = None,
  ):
    r = _rl_config(rl)
    r.check_groups(distilling=teacher is not None)
    if _is_config(model) and getattr(model, "num_experts", 0):
      raise ConfigError(
        "RLTrainer trains a dense policy: its loss has no router losses for a mixture of "
        "experts; train an MoE model with jaxstep train (rl.rewards)"
      )
    self.r, self.tokenizer = r, tokenizer
    self.model_cfg = model if _is_config(model) else None
    self.rewards = load_rewards(list(rewards), reward_weights)
    self.prompts = _prompts(prompts, tokenizer, "prompts")
    self.eval_prompts = {k: _prompts(v, tokenizer, k) for k, v in (eval_prompts or {}).items()}
    apply_fn = models.build(model, 0, abstract=True)[0] if _is_config(model) else model
    self.generator = Generator(model, None, tokenizer, max_seq_len=max_seq_len)
    longest = max(len(p) for s in (self.prompts, *self.eval_prompts.values()) for p in s.ids)
    self.seq_len = longest + r.max_new_tokens - 1  # prompt + completion, shifted
    kind = "live" if r.beta and r.reference != "none" else "none"
    if r.beta and r.reference == "adapters":
      raise ConfigError("rl.reference=adapters needs jaxstep train's LoRA; use live or none")
    vocab = _vocab(model, apply_fn, params)
    options = grpo_options(r, jnp.asarray(allowed_ids(vocab, tokenizer)))
    frozen = frozen_copy(params, r.reference_dtype) if kind == "live" else None
    self.distill = None if teacher is None else _distill_config(distill)
    if self.distill is not None:
      self.distill.check_sampler(r.top_k, r.top_p)
    if teacher is None:
      if distill is not None:
        raise ConfigError("distill settings need a teacher=(model, params) to distill from")
      loss_fn = loss_with_reference(
        kind, apply_fn, lambda ref: rl_core.grpo_loss(apply_fn, reference=ref, **options)
      )
    else:  # on-policy distillation: the teacher rides in the state, never checkpointed
      loss_fn, frozen = self._with_teacher(teacher, vocab, kind, apply_fn, options, frozen)
    self.rollouts = None  # made once train settings are read (super().__init__)
    super().__init__(
      loss_fn,
      params,
      optimizer,
      train_data=[],
      run_dir=run_dir,
      train=train,
      checkpoint=checkpoint,
      model_state=frozen,
      units_fn=rl_core.units_fn(r.loss_norm, r.max_new_tokens),
      mesh=mesh,
      trainable=trainable,
      mlflow=mlflow,
      wandb=wandb,
      hparams=hparams,
      callbacks=callbacks,
    )
    g = self.train_cfg.global_batch_size
    if g % r.num_generations:
      raise ConfigError(
        f"train.global_batch_size {g} is not a multiple of rl.num_generations "
        f"{r.num_generations}: each prompt's completions form one group in one update"
      )
    self.rollouts = Rollouts(
      self.prompts,
      self.generator,
      self.rewards,
      r,
      global_batch_size=g,
      seq_len=self.seq_len,
      seed=self.train_cfg.seed,
      file=self.run_dir / ROLLOUT_FILE,
      writer=jax.process_index() == 0,
      sharding=parallel.batch_sharding(mesh) if mesh is not None else None,
      lmbda=self.distill.lmbda if self.distill is not None else 1.0,
      completion_column=self.distill.completion_column if self.distill else "completion",
    )
    self.train_data = self.rollouts

  def _with_teacher(self, teacher, vocab: int, kind: str, apply_fn, options, frozen):
    """The on-policy distillation loss against ``teacher = (model, params)`` and the model
    state that carries the teacher's params (in ``distill.teacher_dtype``)."""
    model, params = teacher
    d = self.distill
    teacher_apply = models.build(model, 0, abstract=True)[0] if _is_config(model) else model
    logits = _vocab(model, teacher_apply, params)
    if logits != vocab:
      raise ConfigError(
        f"the teacher has {logits} logits, the policy {vocab}: a teacher needs the student's "
        f"vocabulary"
      )

    def build(reference, teacher):
      return distill_core.on_policy_loss(
        apply_fn, teacher, d, d.resolved_mode(rl_run=True), reference=reference, **options
      )

    if _is_config(model) and model.max_seq_len < self.seq_len:
      raise ConfigError(
        f"the teacher takes {model.max_seq_len} positions, the rollouts' rows {self.seq_len}"
      )
    params = cast(params, d.teacher_dtype)
    loss_fn = loss_with_teacher(kind, apply_fn, teacher_apply, build)
    return loss_fn, {**(frozen or {}), distill_core.TEACHER: params}

  def config(self) -> dict:
    rewards = {"rewards": [x.name for x in self.rewards]}
    out = {**super().config(), "rl": {**config_lib.to_dict(self.r), **rewards}}
    if self.distill is not None:
      out["distill"] = config_lib.to_dict(self.distill)
    return out

  def _model_section(self) -> dict | None:
    return None if self.model_cfg is None else config_lib.to_dict(self.model_cfg)

  def _source(self) -> trainer_data.TrainBatches:
    return trainer_data.TrainBatches(self.rollouts, self.train_cfg.global_batch_size, (HOST,))

  def _step(self):
    return with_token_means(super()._step())

  def _jitted(self, step, state):
    step_fn, put = super()._jitted(step, state)
    return step_fn, lambda batch: put({k: v for k, v in batch.items() if k != HOST})

  def _evaluation(self) -> assembly.Evaluation:
    if not self.eval_prompts:
      return assembly.Evaluation(None, None)
    gen, r, seq_len = self.generator, self.r, self.seq_len

    def evaluate(state) -> dict:
      return {
        name: rl_evaluate.evaluate_prompts(gen, state.params, s, r, self.rewards, seq_len=seq_len)
        for name, s in self.eval_prompts.items()
      }

    return assembly.Evaluation(evaluate, next(iter(self.eval_prompts)))

  def _throughput(self) -> assembly.Throughput:
    return assembly.Throughput(host_fields=lambda batch: batch[HOST])

  def _first_hooks(self) -> tuple:
    return (LogpCheck(self.r.logp_tolerance, lambda: GAP_CAUSE),)

  def _loop(self, run_dir, ckpt, state, start, step_fn, put, run_info, source):
    loop = super()._loop(run_dir, ckpt, state, start, step_fn, put, run_info, source)
    self.rollouts.params = lambda: loop.state.params  # each rollout samples with today's
    return loop


def _rl_config(value) -> rl_core.RLConfig:
  if value is None:
    return rl_core.RLConfig()
  if isinstance(value, rl_core.RLConfig):
    return value
  if isinstance(value, Mapping):
    if "rewards" in value or "reward_weights" in value:
      raise ConfigError("give RLTrainer's rewards and reward_weights as its own arguments")
    return config_lib.build_section(rl_core.RLConfig(), dict(value), "rl.")
  raise ConfigError(f"rl must be an RLConfig or a dict of its keys, got {value!r}")


def _distill_config(value) -> distill_core.DistillConfig:
  """The settings of distillation on the policy's samples (``mode`` on_policy, gkd or
  auto)."""
  if value is None:
    value = distill_core.DistillConfig()
  elif isinstance(value, Mapping):
    if "teacher" in value:
      raise ConfigError("give RLTrainer's teacher as its teacher=(model, params) argument")
    value = config_lib.build_section(distill_core.DistillConfig(), dict(value), "distill.")
  elif not isinstance(value, distill_core.DistillConfig):
    raise ConfigError(f"distill must be a DistillConfig or a dict of its keys, got {value!r}")
  if value.resolved_mode(rl_run=True) == "logits":
    raise ConfigError(
      "RLTrainer distills on its own samples (distill.mode on_policy or gkd); distill.mode="
      "logits trains on supervised windows: build distill.supervised_loss into a jaxstep.Trainer"
    )
  return value


def _prompts(value, tokenizer, name: str) -> PromptSet:
  if isinstance(value, PromptSet):
    return value
  if isinstance(value, str | pathlib.Path) or not isinstance(value, Sequence):
    raise ConfigError(f"{name} must be a list of rows ({{'prompt': …, …}}) or a PromptSet")
  return prompt_set(value, tokenizer)


def _is_config(model) -> bool:
  return isinstance(model, models.GPTConfig | models.LlamaConfig)


def _vocab(model, apply_fn, params) -> int:
  if _is_config(model):
    return model.vocab_size
  return jax.eval_shape(apply_fn, params, np.zeros((1, 1), np.int32)).shape[-1]
