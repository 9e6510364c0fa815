"""Failures of background threads, handed to the main loop instead of printed.

tensorboardX writes events in a thread; when a write fails (disk full) that thread dies
and, without this, the loop would only notice by blocking forever on the writer's queue.
"""

from __future__ import annotations

import contextlib
import threading


class ThreadErrors:
  """Exceptions that ended a thread while the block ran; ``check`` raises the first."""

  def __init__(self):
    self.errors: list[BaseException] = []

  def check(self) -> None:
    if self.errors:
      raise self.errors[0]


WATCHED = ("tensorboardX",)  # the modules whose writer threads the run depends on


def _ours(thread) -> bool:
  """A writer thread of the run's own files (TensorBoard's), not a library's helper thread
  (a tracker's network threads fail on their own; the tracker switches itself off)."""
  module = type(thread).__module__ if thread is not None else ""
  return module.startswith(WATCHED)


@contextlib.contextmanager
def watch_threads():
  """Within the block, an exception that ends one of the run's writer threads (``WATCHED``)
  is kept (not printed) for the main loop to raise with ``ThreadErrors.check()``."""
  errors = ThreadErrors()
  previous = threading.excepthook

  def hook(args):
    if args.exc_type is SystemExit or args.exc_value is None or not _ours(args.thread):
      return previous(args)
    errors.errors.append(args.exc_value)

  threading.excepthook = hook
  try:
    yield errors
  finally:
    threading.excepthook = previous
