"""Failures of background threads, handed to the main loop instead of printed.

tensorboardX writes events in a thread; when a write fails (disk full) that thread dies
and, without this, the loop would only notice by blocking forever on the writer's queue.
The echoes of a failed checkpoint read or write that background threads leave behind are
dropped once the failure itself has been reported (``drop_closed_loop_echoes``).
"""

from __future__ import annotations

import contextlib
import sys
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


def drop_closed_loop_echoes() -> None:
  """Installs (once per process) a ``sys.unraisablehook`` that drops the echoes of a failed
  orbax read or write, which jaxstep reports in one line of its own: tensorstore's
  callbacks into orbax's already closed asyncio loop print an "Event loop is closed"
  traceback each (dozens for one damaged step), and on a full disk tensorboardX's exit
  handler fails to flush again. Every other unraisable exception still reaches the hook
  that was there before. Called where checkpoints are read or written, so the Python API
  is as quiet as the commands."""
  if not getattr(sys.unraisablehook, "drops_reported_write_echoes", False):
    sys.unraisablehook = _without_closed_loop_noise(sys.unraisablehook)


def _without_closed_loop_noise(hook):
  """``hook`` without ``drop_closed_loop_echoes``' two echoes."""

  def filtered(unraisable):
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
      return
    owner = getattr(unraisable.object, "__module__", "") or ""
    if isinstance(value, OSError) and owner.startswith("tensorboardX"):
      return
    hook(unraisable)

  filtered.drops_reported_write_echoes = True
  return filtered
