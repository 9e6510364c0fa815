"""Text samples during training: every ``train.sample_every`` update steps, a greedy and a
sampled continuation of each of ``train.sample_prompts``, written to ``samples.jsonl``
(``step``, ``mode``, ``prompt``, ``text``, ``stop_reason``) and TensorBoard text.

The generator is compiled once (the first time it runs) and reused with each step's params;
it runs between two updates, after the previous one's metrics are read back, so it adds its
own time to that step and nothing to the others (docs/generation.md says what it costs).
"""

from __future__ import annotations

from jaxstep.errors import ConfigError, PromptError
from jaxstep.generation import Generator

TEMPERATURE = 0.8  # the sampled continuation's temperature


def check_prompts(model_cfg, tokenizer, train_cfg) -> None:
  """``ConfigError`` naming ``train.sample_prompts`` when samples are on and a prompt cannot
  run: none at all, one that does not encode, or one that leaves the model no position to
  generate into (``[BOS] + prompt`` must be shorter than ``model.max_seq_len``; a sample
  then stops at ``max_seq_len`` or after ``train.sample_max_new_tokens``). Called by
  ``build``, so such a run is refused before its run dir is written."""
  if not train_cfg.sample_every:
    return
  prompts = list(train_cfg.sample_prompts)
  if not prompts:
    raise ConfigError(
      f"train.sample_prompts is empty but train.sample_every is {train_cfg.sample_every}: "
      f"give at least one prompt, or set train.sample_every=0"
    )
  generator = Generator(model_cfg, None, tokenizer)
  for i, prompt in enumerate(prompts):
    _check_length(tokenizer, prompt, i, model_cfg.max_seq_len)
    try:
      generator.encode_prompt(prompt, i)
    except PromptError as e:
      raise ConfigError(f"train.sample_prompts[{i}] {prompt!r} cannot be sampled: {e}") from None


def _check_length(tokenizer, prompt: str, index: int, max_seq_len: int) -> None:
  """Refuses prompt ``index`` when ``[BOS] + prompt`` leaves no position to generate into."""
  bos = 1 if getattr(tokenizer, "has_bos", True) else 0  # a folder's model may start bare
  try:
    tokens = bos + len(tokenizer.encode(prompt))
  except UnicodeEncodeError:
    return  # not text at all: encode_prompt says so
  if tokens >= max_seq_len:
    raise ConfigError(
      f"train.sample_prompts[{index}] is {tokens} tokens{' with BOS' if bos else ''}; "
      f"model.max_seq_len {max_seq_len} takes prompts of at most {max_seq_len - 1 - bos} "
      f"(one position is left to generate into): shorten it or raise model.max_seq_len"
    )


class TextSamples:
  """Generates the samples of one update step from the params of that step."""

  def __init__(self, model_cfg, tokenizer, train_cfg):
    self.every, self.prompts = train_cfg.sample_every, list(train_cfg.sample_prompts)
    self.max_new, self.seed = train_cfg.sample_max_new_tokens, train_cfg.seed
    self.generator = Generator(model_cfg, None, tokenizer)
    for i, prompt in enumerate(self.prompts):  # a prompt that cannot run fails before training
      self.generator.encode_prompt(prompt, i)

  def __call__(self, step: int, params) -> list[dict]:
    self.generator.params = params
    records = []
    for mode, temperature in (("greedy", 0.0), ("sampled", TEMPERATURE)):
      samples = self.generator.generate(
        self.prompts, max_new_tokens=self.max_new, temperature=temperature, seed=self.seed + step
      )
      records += [
        {
          "step": step,
          "mode": mode,
          "prompt": s.prompt,
          "text": s.text,
          "stop_reason": s.stop_reason,
        }
        for s in samples
      ]
    self.generator.params = None
    return records
