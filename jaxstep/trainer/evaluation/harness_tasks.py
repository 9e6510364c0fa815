"""lm-evaluation-harness tasks scored during training: ``eval.harness_tasks`` every
``eval.harness_every`` update steps (0: ``train.eval_every``) and once at the end, on the
params of that step, offline (``jaxstep.lmeval.tasks``). Each run is one ``eval.jsonl``
record of set ``harness`` whose keys are ``harness/<task>/<metric>``, the names the
trackers show it under.

The tasks are checked when the run is built (known to the harness, data local), so a bad
name stops the run before its first update, not at its first evaluation. One model is
compiled for the run and given each step's params. A job of several processes is refused:
the harness drives one process's requests.
"""

from __future__ import annotations

import jax

from jaxstep.errors import ConfigError
from jaxstep.trainer.config.eval_section import HARNESS_SET


def check_tasks(eval_cfg) -> None:
  """``ConfigError`` when ``eval.harness_tasks`` cannot run here (no harness installed, a
  task it does not know or whose data is not local, several processes)."""
  if not eval_cfg.harness_tasks:
    return
  from jaxstep.lmeval import require_harness, tasks

  require_harness()
  if jax.process_count() > 1:
    raise ConfigError(
      f"eval.harness_tasks runs in one process; this job has {jax.process_count()}: score "
      f"the tasks after training with jaxstep evaluate RUN_DIR --tasks …"
    )
  tasks.check_tasks(list(eval_cfg.harness_tasks), eval_cfg.harness_include_path or None)


def harness_evaluation(cfg, tokenizer):
  """``evaluate(state) → {"harness": {metric: value}}`` for ``cfg.eval.harness_tasks`` (None
  when there are none)."""
  e = cfg.eval
  if not e.harness_tasks:
    return None
  from jaxstep.lmeval import tasks
  from jaxstep.lmeval.model import JaxstepLM

  model = None

  def evaluate(state) -> dict:
    nonlocal model
    if model is None:
      template = getattr(tokenizer, "chat_template", None)
      model = JaxstepLM(
        cfg.model, state.params, tokenizer, chat_template=template, batch_size=e.harness_batch_size
      )
    else:
      model.set_params(state.params)
    try:
      results = tasks.run_tasks(
        model,
        list(e.harness_tasks),
        include_path=e.harness_include_path or None,
        limit=e.harness_limit or None,
      )
    finally:
      model.set_params(None)  # no second copy of the params held between evaluations
    return {HARNESS_SET: results}

  return evaluate
