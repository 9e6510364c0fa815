"""SIGTERM/SIGINT become a request to stop at the next update boundary (then save).

In a multi-process job a scheduler may deliver SIGTERM to some hosts only, or to each at a
different update step; a host that stops alone leaves the others blocked in the next
collective. There SIGTERM is left to JAX's preemption service (its coordination service
catches the signal on any host), and every host asks it at each update boundary whether
the agreed stop step has come (``multihost_utils.reached_preemption_sync_point``), so all
save the same step and exit alike.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import jax


class StopRequest:
  """``signum`` is set once the run should stop at this update boundary."""

  signum: int | None = None
  synced: bool = False  # SIGTERM comes through JAX's multi-host preemption sync point

  def poll(self, step: int) -> None:
    """Called at every update boundary (``step`` = update steps done, the same sequence on
    every process): in a synced job, sets ``signum`` when all hosts agreed to stop here."""
    if self.synced and self.signum is None:
      from jax.experimental import multihost_utils

      if multihost_utils.reached_preemption_sync_point(step):
        self.signum = signal.SIGTERM


def _preemption_service() -> bool:
  """True in a multi-process job with JAX's preemption service on (the default)."""
  return jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGTERM, signal.SIGINT)):
  """Within the block, the listed signals set ``request.signum`` instead of killing.

  A second signal of the same kind restores the default behaviour (so a stuck run can still
  be stopped with a second Ctrl-C). Outside the main thread nothing is installed.
  """
  request = StopRequest()
  request.synced = signal.SIGTERM in signals and _preemption_service()
  if request.synced:  # JAX's service has its own SIGTERM handler; do not replace it
    signals = tuple(s for s in signals if s != signal.SIGTERM)
  if threading.current_thread() is not threading.main_thread():
    yield request
    return

  def handler(signum, frame):
    del frame
    if request.signum == signum:
      signal.signal(signum, signal.SIG_DFL)
      signal.raise_signal(signum)
    request.signum = signum

  previous = {s: signal.signal(s, handler) for s in signals}
  try:
    yield request
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
