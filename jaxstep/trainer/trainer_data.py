"""Train and eval data for ``jaxstep.Trainer``: any Grain dataset, any resumable iterator,
or a plain iterable, each yielding one *global batch* per item.

A global batch is a dict of host arrays with leading dimension G
(``train.global_batch_size``), one update step's worth: ``grain.MapDataset…
.batch(G, drop_remainder=True)`` gives exactly that.

Resume. A checkpoint records where the train data stands, so a run killed at any moment
continues with the batch after the last one its checkpoint consumed:

- a Grain dataset (``MapDataset``/``IterDataset``) or ``DataLoader``, or any object whose
  iterator has ``get_state()`` (JSON-able, or bytes) and ``set_state(state)`` — the
  resumable-iterator protocol, Grain's own: the state is saved and set back;
- a plain iterable (a list, a generator function's result) has no state to save: a
  resumed run iterates it again from its start and skips the batches already consumed,
  which is exact only when it yields the same batches each time (a one-shot generator
  cannot be resumed at all). The Trainer says so in one warning at each start.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from jaxstep.errors import BatchError, ConfigError

log = logging.getLogger("jaxstep")


def _resumable(iterator) -> bool:
  return callable(getattr(iterator, "get_state", None)) and callable(
    getattr(iterator, "set_state", None)
  )


def _to_json(state):
  """A Grain ``DataLoader`` iterator's state is bytes: kept as base64 text in the JSON."""
  if isinstance(state, bytes):
    return {"bytes": base64.b64encode(state).decode("ascii")}
  return state


def _from_json(state):
  if isinstance(state, dict) and set(state) == {"bytes"}:
    return base64.b64decode(state["bytes"])
  return state


def require_iterable(data):
  """``data`` if it can be train data at all; else a ``ConfigError`` saying what can."""
  if not isinstance(data, Iterable):
    raise ConfigError(
      f"train_data must be iterable (a Grain dataset, a resumable iterator or an "
      f"iterable of global batches), got {type(data).__name__}"
    )
  return data


class TrainBatches:
  """The ``BatchSource`` of a ``Trainer``: batches of ``data`` checked for G rows, with the
  iterator state (or the count of batches consumed) as the position.

  Args:
    data: a Grain dataset / ``DataLoader``, an iterable whose iterators follow the
      resumable-iterator protocol, or a plain re-iterable.
    global_batch_size: G; every batch's leaves must have G rows.
    host_keys: entries that stay on the host and are not rows (an RL rollout's metrics).
  """

  def __init__(self, data: Iterable, global_batch_size: int, host_keys: tuple[str, ...] = ()):
    self.data, self.g, self.host_keys = require_iterable(data), global_batch_size, host_keys
    self.iterator = iter(data)
    self.resumable = _resumable(self.iterator)
    self.one_shot = self.iterator is data and not self.resumable
    self.consumed = 0  # batches taken since the run began (all starts together)

  def describe(self) -> str:
    if self.resumable:
      return "its iterator state is saved with every checkpoint"
    if self.one_shot:
      return (
        "it is a one-shot iterator without get_state/set_state, so a resumed run cannot "
        "find its place: give a re-iterable (a list, a Grain dataset) or a resumable iterator"
      )
    return (
      "it is a plain iterable: its position cannot be restored, so a resumed run iterates "
      "it again and skips the batches already consumed (exact only if it yields the same "
      "batches every time)"
    )

  def restore(self, position: dict) -> None:
    """Continues after the batches a checkpoint's position says were consumed."""
    self.consumed = int(position.get("batches", 0))
    if self.resumable and position.get("data") is not None:
      self.iterator.set_state(_from_json(position["data"]))
      return
    if self.one_shot and self.consumed:
      raise ConfigError(f"train_data cannot be resumed: {self.describe()}")
    self.close()
    self.iterator = iter(self.data)
    for i in range(self.consumed):
      if next(self.iterator, None) is None:
        raise ConfigError(
          f"train_data ended after {i} batches while skipping the {self.consumed} a resumed "
          f"run had consumed; it must yield the same batches as before"
        )

  def next_batch(self) -> dict:
    batch = next(self.iterator)
    self.consumed += 1
    rows = {k: v for k, v in batch.items() if k not in self.host_keys}
    return {**batch, **check_batch(rows, self.g, f"train_data batch {self.consumed}")}

  def where(self) -> dict:
    return {"epoch": 0, "batches": self.consumed}

  def mark(self):
    """The position after the batches taken so far: their count and the iterator's state."""
    return self.consumed, self.iterator.get_state() if self.resumable else None

  def position(self, mark) -> dict:
    consumed, state = mark
    return {"batches": consumed, "data": None if state is None else _to_json(state)}

  def close(self) -> None:
    """Closes the iterator this made (a Grain iterator's read-ahead threads); a one-shot
    iterator is the caller's own and stays open."""
    if self.iterator is not self.data and callable(getattr(self.iterator, "close", None)):
      self.iterator.close()


def check_batch(batch, g: int | None, what: str) -> dict:
  """A global batch: a mapping of arrays whose leaves share the leading dimension (G when
  ``g`` is given)."""
  if not isinstance(batch, Mapping):
    raise BatchError(f"{what} is a {type(batch).__name__}; a global batch is a dict of arrays")
  rows = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
  if g is not None and set(rows.values()) != {g}:
    raise BatchError(
      f"{what} has rows {rows}; every leaf needs train.global_batch_size = {g} rows (batch "
      f"with drop_remainder=True)"
    )
  return dict(batch)


def eval_source(name: str, data) -> Callable[[], Iterable]:
  """``() -> iterable`` giving set ``name``'s batches from the start at every evaluation:
  a re-iterable (list, Grain dataset) or a function returning one; a one-shot iterator
  would be empty from the second evaluation on, so it is refused."""
  if callable(data) and not isinstance(data, Iterable):
    return data
  if not isinstance(data, Iterable):
    raise ConfigError(f"eval_sets[{name!r}] must be iterable, got {type(data).__name__}")
  if iter(data) is data:
    raise ConfigError(
      f"eval_sets[{name!r}] is a one-shot iterator; give a re-iterable (a list, a Grain "
      f"dataset) or a function returning a fresh iterable"
    )
  return lambda: data
