"""Generation from a trained model: ``Generator`` (prompts → ``Sample`` continuations, with
the bundled GPT's key/value cache) and the sampling rules it uses."""

from jaxstep.generation.engine import STOP_REASONS, Generator, Sample, check_settings
from jaxstep.generation.sampling import allowed_ids, filter_logits, next_tokens

__all__ = [
  "STOP_REASONS",
  "Generator",
  "Sample",
  "allowed_ids",
  "check_settings",
  "filter_logits",
  "next_tokens",
]
