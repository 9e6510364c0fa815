"""The teacher of a distillation run (``distill.teacher``): a model folder or a run
directory, read at every start (``saved_run.teacher.load``), frozen, carried in the train
state's ``model_state`` under ``distill.TEACHER`` (so it is laid out on the mesh like the
student's params, by the same rules) and left out of every checkpoint (``Checkpointer``
drops it; a resume reads the teacher again). Its vocabulary must be the student's: the same
ids for the same text, and the same number of logits."""

from __future__ import annotations

import functools
import logging
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxstep import models
from jaxstep.core import distill
from jaxstep.core.step import with_means
from jaxstep.core.trees import is_stored_weight
from jaxstep.errors import ConfigError
from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan import init_from, rl_plan
from jaxstep.trainer.plan.reference_model import loss_with_teacher

log = logging.getLogger("jaxstep")

# text each tokenizer must encode to the same ids: words, digits, punctuation, spaces, UTF-8
IDS = ("vocab_size", "pad_id", "bos_id", "eos_id")  # a tokenizer's sizes, not its file format
PROBE = "The teacher's 12 + 30 = 42, isn't it?\n  Ünïcödé — 文字 ok.\tEnd"


def teacher_config(path: str) -> config_lib.Config:
  """The config of the teacher at ``path``: a run directory's ``config.yaml``, or what a
  model folder's ``config.json`` gives (``init_from.folder_config``; no weights read)."""
  folder = pathlib.Path(path)
  if init_from.is_model_folder(folder):
    return init_from.folder_config(folder)
  if not (folder / "config.yaml").is_file():
    raise ConfigError(
      f"distill.teacher {path} is neither a model folder (config.json) nor a run directory "
      f"(config.yaml); name the teacher's exported folder or its run_dir"
    )
  cfg = config_lib.load(folder / "config.yaml")
  if not cfg.model.vocab_size:
    raise ConfigError(f"distill.teacher {path}: its config.yaml has no resolved vocabulary")
  return cfg


@functools.lru_cache(maxsize=4)
def teacher_apply(path: str) -> Callable:
  """``(params, inputs, *, rng, train, **fields) -> logits`` of the teacher's model."""
  return models.build(teacher_config(path).model, jax.random.PRNGKey(0), abstract=True)[0]


def cast(params, dtype: str):
  """The teacher's params (a tree, or one tensor as it is read) in ``distill.teacher_dtype``
  ``dtype``: with ``bf16`` the floating leaves in bf16, a quantized weight (its codes and
  fp32 scales) as stored."""
  if dtype != "bf16":
    return params
  return jax.tree.map(_low_precision, params, is_leaf=is_stored_weight)


def _low_precision(x):
  if is_stored_weight(x) or not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return x.astype(jnp.bfloat16)


def abstract_params(cfg: config_lib.Config):
  """The teacher's params as shapes and dtypes (for ``memory`` and ``auto``); None without
  a teacher."""
  if not cfg.distill.teacher:
    return None
  model = teacher_config(cfg.distill.teacher).model
  built = lambda: models.build(model, jax.random.PRNGKey(0))[1]  # noqa: E731
  return jax.eval_shape(lambda: cast(built(), cfg.distill.teacher_dtype))


def check_vocabulary(cfg: config_lib.Config, teacher_vocab: int, teacher_tok, student_tok):
  """``ConfigError`` unless the teacher scores the student's ids: a tokenizer of the same
  size and special ids that encodes a probe text to the same ids (a byte tokenizer and its
  export as a ``tokenizer.json`` are one vocabulary), and as many logits."""
  where = f"distill.teacher {cfg.distill.teacher}"
  if teacher_vocab != cfg.model.vocab_size:
    raise ConfigError(
      f"{where} has {teacher_vocab} logits, the student {cfg.model.vocab_size}: a teacher "
      f"needs the student's vocabulary"
    )
  ids = lambda tok: {k: tok.describe()[k] for k in IDS}  # noqa: E731
  if ids(teacher_tok) != ids(student_tok):
    raise ConfigError(
      f"{where} has another tokenizer than the student's data ({ids(teacher_tok)} vs "
      f"{ids(student_tok)}): a teacher needs the student's vocabulary"
    )
  got, want = teacher_tok.encode(PROBE).tolist(), student_tok.encode(PROBE).tolist()
  if got != want:
    raise ConfigError(
      f"{where} has another tokenizer than the student's data: {PROBE!r} is {len(got)} ids "
      f"to the teacher, {len(want)} to the student (first ones {got[:6]} vs {want[:6]}); a "
      f"teacher needs the student's vocabulary"
    )


def model_state(cfg: config_lib.Config, reference, teacher_params):
  """The ``model_state`` a run starts with: ``reference`` (a live reference's copy, or
  None) and, with a teacher, its params under ``distill.TEACHER``."""
  if teacher_params is None:
    return reference
  return {**(reference or {}), distill.TEACHER: teacher_params}


def loss_fn(cfg: config_lib.Config, apply_fn: Callable, allowed=None) -> Callable:
  """The step's 4-argument ``loss_fn`` of ``cfg``'s distillation mode: on an RL run's
  rollouts (``on_policy``, ``gkd``; ``allowed``: the ids the sampler may draw) or on
  supervised windows (``logits``, ``gkd``)."""
  d = cfg.distill
  mode = d.resolved_mode(bool(cfg.rl.rewards))
  if cfg.rl.rewards:
    options = {**rl_plan.grpo_options(cfg.rl, allowed), "chunk": cfg.model.loss_chunk}
    kind = rl_plan.reference_kind(cfg)

    def build(reference, teacher):
      return distill.on_policy_loss(apply_fn, teacher, d, mode, reference=reference, **options)

  else:
    kind = "none"

    def build(reference, teacher):
      return distill.supervised_loss(apply_fn, teacher, d, mode, cfg.model.loss_chunk)

  return loss_with_teacher(kind, apply_fn, teacher_apply(d.teacher), build)


def with_token_means(step):
  """``step`` whose metrics hold ``distill.SFT_METRICS`` as means over the step's tokens."""
  return with_means(step, distill.SFT_METRICS, "tokens")
