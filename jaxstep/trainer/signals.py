"""SIGTERM/SIGINT become a request to stop at the next update boundary (then save)."""

from __future__ import annotations

import contextlib
import signal
import threading


class StopRequest:
  signum: int | None = None


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGTERM, signal.SIGINT)):
  """Within the block, the listed signals set ``request.signum`` instead of killing.

  A second signal of the same kind restores the default behaviour (so a stuck run can still
  be stopped with a second Ctrl-C). Outside the main thread nothing is installed.
  """
  request = StopRequest()
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
