"""jaxstep models in EleutherAI's lm-evaluation-harness (``pip install 'jaxstep[eval]'``).

``model.JaxstepLM`` answers the harness's three request types from a model's params and
tokenizer (``scoring`` batches the log-likelihoods); ``tasks`` runs tasks offline and
flattens their results. ``--model jaxstep`` itself, which reads a run directory or a
model folder, is registered by ``jaxstep.register_harness()``.
"""

from __future__ import annotations

from jaxstep.errors import ConfigError

__all__ = ["require_harness"]


def require_harness():
  """The ``lm_eval`` module; ``ConfigError`` saying how to install it when it is missing."""
  try:
    import lm_eval
  except ImportError:
    raise ConfigError(
      "lm-evaluation-harness is not installed: pip install 'jaxstep[eval]'"
    ) from None
  return lm_eval
