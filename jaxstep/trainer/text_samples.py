"""Text samples during training: every ``train.sample_every`` update steps, a greedy and a
sampled continuation of each of ``train.sample_prompts``, written to ``samples.jsonl``
(``step``, ``mode``, ``prompt``, ``text``, ``stop_reason``) and TensorBoard text.

The generator is compiled once (the first time it runs) and reused with each step's params;
it runs between two updates, after the previous one's metrics are read back, so it adds its
own time to that step and nothing to the others (docs/generation.md says what it costs).
"""

from __future__ import annotations

from jaxstep.generation import Generator

TEMPERATURE = 0.8  # the sampled continuation's temperature


class TextSamples:
  """Generates the samples of one update step from the params of that step."""

  def __init__(self, model_cfg, tokenizer, train_cfg):
    self.every, self.prompts = train_cfg.sample_every, list(train_cfg.sample_prompts)
    self.max_new, self.seed = train_cfg.sample_max_new_tokens, train_cfg.seed
    self.generator = Generator(model_cfg, None, tokenizer)
    for i, prompt in enumerate(self.prompts):  # a prompt that cannot run fails before training
      self.generator.encode_prompt(prompt, i)

  def due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

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
