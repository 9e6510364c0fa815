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


@contextlib.contextmanager
def watch_threads():
  """Within the block, an exception that ends any thread is kept (not printed) for the
  main loop to raise with ``ThreadErrors.check()``."""
  errors = ThreadErrors()
  previous = threading.excepthook

  def hook(args):
    if args.exc_type is SystemExit or args.exc_value is None:
      return previous(args)
    errors.errors.append(args.exc_value)

  threading.excepthook = hook
  try:
    yield errors
  finally:
    threading.excepthook = previous
