"""TensorBoard events through tensorboardX: a writer opened without importing torch, and
closed without leaving its thread or its file behind when the disk is full."""

from __future__ import annotations

import pathlib
import re

from jaxstep.trainer.tracking.threads import watch_threads

QUEUE_EVENTS = 10_000  # events waiting for the writer thread
_NOT_IN_A_TAG = re.compile(r"[^-/\w.]")  # what TensorBoard allows in a tag, negated


def tag(name: str) -> str:
  """``name`` as a TensorBoard tag: each character it does not allow (e.g. the ``:`` of a
  reward named ``module:function``) becomes ``_``. tensorboardX makes the same change
  itself, but logs a line for every scalar it changes: at every logged update."""
  return _NOT_IN_A_TAG.sub("_", name)


def open_events(folder: pathlib.Path, purge_step: int):
  """A tensorboardX ``SummaryWriter`` into ``folder``. ``purge_step`` tells TensorBoard to
  drop the events a resumed run is about to write again. Its queue is far longer than one
  update's events: if the writer thread dies (disk full) the loop learns it from the thread's
  exception before a put could ever block."""
  return _summary_writer()(str(folder), purge_step=purge_step, max_queue=QUEUE_EVENTS)


def close_events(tb) -> None:
  """Closes a tensorboardX ``SummaryWriter`` and raises what its final flush raised.

  tensorboardX's ``close`` flushes first and, when that fails (a full disk), returns without
  stopping its writer thread or closing the event file: the thread lived on and failed in the
  background at its next timed flush, and its exit handler failed again at the end of the
  process. Here the unflushed events are dropped, the thread is joined and the file closed."""
  try:
    tb.close()
  finally:
    for file_writer in (getattr(tb, "all_writers", None) or {}).values():
      _abandon(file_writer.event_writer)
    if getattr(tb, "all_writers", None) is not None:
      tb.file_writer = tb.all_writers = None  # a second close does nothing


class _Discard:
  """Where a failed writer's last events go: nowhere."""

  def write_event(self, event) -> None:
    pass

  def flush(self) -> None:
    pass


def _abandon(events) -> None:
  """Ends a tensorboardX ``EventFileWriter`` whose flush failed: its thread takes the queued
  events into ``_Discard`` up to the stop sign, and the file is closed (what is still buffered
  for it is lost; the error of that write was raised already)."""
  if events._closed:
    return
  events._closed = True  # add_event, flush, and the close at exit, do nothing from now on
  worker, queue, file = events._worker, events._event_queue, events._ev_writer
  with watch_threads():  # a write the thread was making as it failed is not reported twice
    worker._record_writer = _Discard()
    worker.stop()  # the stop sign, then join
  queue.close()
  queue.join_thread()
  try:
    file._py_recordio_writer.close()  # the descriptor is closed even when the flush fails
  except OSError:
    pass
  events._event_queue = events._worker = None


class NoEvents:
  """TensorBoard switched off (``train.trackers`` without ``tensorboard``)."""

  def add_scalar(self, *args, **kwargs) -> None:
    pass

  add_text = add_scalar

  def close(self) -> None:
    pass


def _summary_writer():
  """tensorboardX's ``SummaryWriter``, imported on first use. tensorboardX imports torch
  whenever installed (~2 s) only to recognize its tensors; jaxstep logs floats, so torch is
  marked absent for that import (and unmarked after: the process may import it later)."""
  import importlib
  import sys

  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # an ImportError for tensorboardX's ``try: import torch``
  try:
    return importlib.import_module("tensorboardX").SummaryWriter
  finally:
    if hide and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
