"""Quiet failures: the echoes a failed checkpoint read or write leaves behind in background
threads, dropped once jaxstep has reported the failure itself in one line."""

from __future__ import annotations

import sys


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
