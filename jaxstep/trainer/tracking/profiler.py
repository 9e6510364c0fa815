"""``train.profile_steps: "A:B"``: a ``jax.profiler`` trace of update steps A through B
(inclusive) in ``run_dir/profile/``: ``*.xplane.pb`` for TensorBoard's profile plugin and
``*.trace.json.gz`` for Perfetto (ui.perfetto.dev).

The trace starts before update step A is dispatched and stops once update step B's state
is computed, so it holds whole steps: host work, compilation if A is the first step, and
the device's kernels. A resumed run past A starts at its first step. Off (``""``), the loop
holds ``None`` and pays nothing.
"""

from __future__ import annotations

import logging
import pathlib

import jax

log = logging.getLogger("jaxstep")


class StepProfiler:
  """Starts and stops one trace around update steps ``first..last``."""

  def __init__(self, steps: tuple[int, int], run_dir: pathlib.Path):
    self.first, self.last = steps
    self.directory = run_dir / "profile"
    self.active = False

  def before(self, step: int) -> None:
    """Called before update step ``step`` is dispatched."""
    if not self.active and self.first <= step <= self.last:
      jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, state) -> None:
    """Called once update step ``step`` is dispatched; ``state`` is its output."""
    if self.active and step >= self.last:
      jax.block_until_ready(state)
      self.stop()
      log.info("profile of update steps %d-%d written to %s", self.first, step, self.directory)

  def stop(self) -> None:
    if self.active:
      self.active = False
      jax.profiler.stop_trace()
