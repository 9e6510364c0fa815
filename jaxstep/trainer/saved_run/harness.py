"""``--model jaxstep``: a run directory or a model folder as an lm-evaluation-harness model.

``register()`` adds it to the harness's registry in this process, after the harness's own
models (the harness loads those only into an empty registry); ``jaxstep harness``,
``evaluate --tasks`` and ``jaxstep.register_harness()`` call it. The harness has no way to
find a model outside its own package, so its bare ``lm_eval`` command does not know it.
"""

from __future__ import annotations

from jaxstep.errors import ConfigError
from jaxstep.lmeval import require_harness
from jaxstep.trainer.saved_run.load import load_run

NAME = "jaxstep"


def register() -> None:
  """Makes ``--model jaxstep`` (and ``lm_eval.simple_evaluate(model="jaxstep", …)``) known
  to the harness in this process; a second call changes nothing."""
  require_harness()
  import lm_eval.models  # noqa: F401 - the harness's own models first
  from lm_eval.api.registry import model_registry

  if NAME not in model_registry:
    model_registry.register(NAME, target=saved_run_model())


def saved_run_model():
  """The ``JaxstepLM`` subclass that reads ``path=`` (and ``step=``) itself."""
  from jaxstep.lmeval.model import JaxstepLM

  class SavedRunLM(JaxstepLM):
    """``--model_args path=RUN_DIR_OR_MODEL_FOLDER[,step=N,…]``: the params of the run's
    checkpoint (default the newest that restores) or the folder's weights, its tokenizer
    and chat template; the other arguments are ``JaxstepLM``'s."""

    def __init__(self, path: str | None = None, step=None, **options):
      if not path:
        raise ConfigError("--model jaxstep needs --model_args path=RUN_DIR_OR_MODEL_FOLDER")
      saved = load_run(path, None if step in (None, "") else int(step))
      super().__init__(
        saved.cfg.model,
        saved.params,
        saved.tokenizer,
        chat_template=saved.chat_template,
        step=saved.step,
        path=str(path),
        **options,
      )

  return SavedRunLM
