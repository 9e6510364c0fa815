"""jaxstep in EleutherAI's lm-evaluation-harness (``pip install 'jaxstep[eval]'``).

``register()`` adds the model ``jaxstep`` to the harness's registry (``JaxstepLM``);
``jaxstep harness …`` is the harness's own command line with it registered, and
``jaxstep.harness.tasks`` runs tasks from local files only.
"""

from __future__ import annotations

from jaxstep.errors import ConfigError

__all__ = ["register"]

NAME = "jaxstep"


def require_harness():
  """The ``lm_eval`` module; ``ConfigError`` saying how to install it when it is missing."""
  try:
    import lm_eval
  except ImportError:
    raise ConfigError(
      "lm-evaluation-harness is not installed: pip install 'jaxstep[eval]'"
    ) from None
  return lm_eval


def register() -> None:
  """Makes ``--model jaxstep`` (and ``simple_evaluate(model="jaxstep", …)``) known to the
  harness in this process; a second call changes nothing."""
  require_harness()
  import lm_eval.models  # noqa: F401 - the harness's own models first: it loads them only
  from lm_eval.api.registry import model_registry  # into an empty registry

  if NAME not in model_registry:
    from jaxstep.harness.lm import JaxstepLM

    model_registry.register(NAME, target=JaxstepLM)
