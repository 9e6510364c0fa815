"""The ``distill`` section's fit with the rest of a run's config (the section itself is
``jaxstep.core.distill.DistillConfig``)."""

from __future__ import annotations

from jaxstep.errors import ConfigError


def check_distill_run(cfg) -> None:
  """Which runs a teacher (``distill.teacher``) fits: ``on_policy`` an RL run's rollouts,
  ``logits`` a supervised run's windows, ``gkd`` either."""
  d, rl_run = cfg.distill, bool(cfg.rl.rewards)
  mode = d.resolved_mode(rl_run)
  if cfg.preference.loss:
    raise ConfigError(
      "a run is either preference (preference.loss) or distillation (distill.teacher); pick one"
    )
  if mode == "on_policy" and not rl_run:
    raise ConfigError(
      "distill.mode=on_policy trains on the student's own samples of prompts: name rl.rewards "
      "(they score the samples and the held-out prompts) and give prompts as data.path, or "
      "use distill.mode=logits or gkd on supervised data"
    )
  if mode == "logits" and rl_run:
    raise ConfigError(
      "distill.mode=logits distills on supervised windows, but rl.rewards makes this an RL "
      "run: use distill.mode=on_policy or gkd, or drop rl.rewards"
    )
  if d.lmbda < 1 and not rl_run:
    raise ConfigError(
      f"distill.lmbda={d.lmbda} mixes the student's samples of prompts with their completions "
      f"in an RL run (rl.rewards, a prompts file with a {d.completion_column!r} column); a "
      f"supervised run trains on its windows as given (lmbda 0): drop distill.lmbda"
    )
  d.check_sampler(cfg.rl.top_k, cfg.rl.top_p)
