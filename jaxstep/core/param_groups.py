"""Parameter groups (``optim.groups``): leaves chosen by a pattern, each group with its own
lr scale, weight decay and optimizer — "no decay on norms and biases", "embeddings at 0.1×
lr", "Muon here, AdamW there" as config.

A group is ``{match: regex, lr_scale: 1.0, weight_decay: <optim.weight_decay>, optimizer:
<optim.name>}``; ``match`` is searched (``re.search``) in each leaf's name ``"a/b/0/c"``, the
names ``optim.trainable`` matches. A leaf no group matches stays with the main optimizer.
Every group runs the schedule of the run times its ``lr_scale``; the main group's lr is the
one the state keeps and the step reports. A leaf that two groups match, a group that
matches no leaf, and a key that is not a group's are each one ``ConfigError`` line.

Built with ``optax.multi_transform``: each group's optimizer keeps state for its own leaves
only, and all of them see the same accumulated, clipped gradient.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence

import jax
import optax

from jaxstep.core.trees import path_name
from jaxstep.errors import ConfigError

KEYS = ("match", "lr_scale", "weight_decay", "optimizer")
MAIN = "main"


def check(groups: Sequence, optimizers: Sequence[str]) -> tuple[dict, ...]:
  """``groups`` as dicts of their keys (defaults filled by the caller), or one line naming
  the group and what to change."""
  out = []
  for i, g in enumerate(groups):
    where = f"optim.groups[{i}]"
    if not isinstance(g, Mapping) or not isinstance(g.get("match"), str):
      raise ConfigError(f"{where} must be a mapping with a match: regex, got {g!r}")
    unknown = sorted(set(g) - set(KEYS))
    if unknown:
      raise ConfigError(f"{where} has {', '.join(unknown)}; a group takes {', '.join(KEYS)}")
    try:
      re.compile(g["match"])
    except re.error as e:
      raise ConfigError(f"{where}.match {g['match']!r} is not a regular expression ({e})") from None
    if _number(where, "lr_scale", g.get("lr_scale", 1.0)) <= 0:
      raise ConfigError(f"{where}.lr_scale must be > 0, got {g['lr_scale']}")
    if _number(where, "weight_decay", g.get("weight_decay", 0.0)) < 0:
      raise ConfigError(f"{where}.weight_decay must be >= 0, got {g['weight_decay']}")
    if g.get("optimizer", optimizers[0]) not in optimizers:
      raise ConfigError(
        f"{where}.optimizer must be one of {', '.join(optimizers)}, got {g['optimizer']!r}"
      )
    out.append(dict(g))
  return tuple(out)


def _number(where: str, key: str, value) -> float:
  """A group's number as a float: YAML reads ``1e-3`` or ``nan`` without a dot as a string,
  which ``float`` would take, NaN and infinity included, so those are refused here."""
  try:
    number = float(value) if not isinstance(value, bool) else math.nan
  except (TypeError, ValueError):
    number = math.nan
  if not math.isfinite(number):
    raise ConfigError(f"{where}.{key} must be a finite number, got {value!r}")
  return number


def labels(params, groups: Sequence[Mapping]):
  """Each leaf's group: ``"group<i>"``, or ``MAIN`` when none matches."""
  patterns = [re.compile(g["match"]) for g in groups]

  def label(path, _):
    name = path_name(path)
    hits = [i for i, p in enumerate(patterns) if p.search(name)]
    if len(hits) > 1:
      both = " and ".join(f"optim.groups[{i}] ({groups[i]['match']!r})" for i in hits)
      raise ConfigError(f"{name} is matched by {both}; a leaf belongs to one group")
    return f"group{hits[0]}" if hits else MAIN

  return jax.tree_util.tree_map_with_path(label, params)


def assignment(params, groups: Sequence[Mapping]) -> dict[str, list[str]]:
  """``{group: [leaf names]}`` (the run's log lists it); a group that matches no leaf is one
  ``ConfigError`` line."""
  tree = labels(params, groups)
  names = {}
  for path, label in jax.tree_util.tree_leaves_with_path(tree):
    names.setdefault(label, []).append(path_name(path))
  for i, g in enumerate(groups):
    if f"group{i}" not in names:
      raise ConfigError(f"optim.groups[{i}] (match {g['match']!r}) matches no parameter")
  return names


def grouped(cfg, schedule: optax.Schedule, build: Callable) -> optax.GradientTransformation:
  """``optax.multi_transform`` of the main optimizer (``build(cfg, schedule)``, its lr
  injected) and one per group (``build(group_cfg, schedule × lr_scale, inject=False)``)."""
  transforms = {MAIN: build(cfg, schedule)}
  for i, g in enumerate(cfg.groups):
    scale = float(g.get("lr_scale", 1.0))
    sub = dataclasses.replace(
      cfg,
      name=g.get("optimizer", cfg.name),
      weight_decay=float(g.get("weight_decay", cfg.weight_decay)),
      groups=(),
    )
    transforms[f"group{i}"] = build(sub, lambda step, s=scale: schedule(step) * s, inject=False)
  return optax.multi_transform(transforms, lambda params: labels(params, cfg.groups))
