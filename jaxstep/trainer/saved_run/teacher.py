"""A distillation run's teacher read back (``distill.teacher``: a model folder or a run
directory, as ``jaxstep generate`` reads either): its params in ``distill.teacher_dtype``,
once its vocabulary is checked against the student's (``plan.teacher``)."""

from __future__ import annotations

import logging

import jax

from jaxstep.trainer.config import loading as config_lib
from jaxstep.trainer.plan import teacher
from jaxstep.trainer.saved_run import load as saved_run

log = logging.getLogger("jaxstep")


def load(cfg: config_lib.Config, tokenizer):
  """The teacher's params (on this process's first device, in ``distill.teacher_dtype``)
  for a student whose data ``tokenizer`` gives ``cfg.model.vocab_size`` logits; None
  without a teacher. ``ConfigError`` for a path that is neither kind or another vocabulary."""
  path = cfg.distill.teacher
  if not path:
    return None
  teacher.teacher_config(path)  # a path that is neither kind: one line naming the key
  saved = saved_run.load_run(path)
  teacher.check_vocabulary(cfg, saved.cfg.model.vocab_size, saved.tokenizer, tokenizer)
  log.info(
    "distill: teacher %s (%s, %s parameters, %s), mode %s",
    path,
    "model folder" if saved.model_folder else f"run directory, update step {saved.step}",
    f"{sum(x.size for x in jax.tree.leaves(saved.params)):,}",
    cfg.distill.teacher_dtype,
    cfg.distill.resolved_mode(bool(cfg.rl.rewards)),
  )
  return teacher.cast(cfg, saved.params)
