"""A process's resident memory while a block of code runs (``PeakRss``): total and
anonymous (not file-backed) bytes, sampled, and the kernel's own all-time peak."""

from __future__ import annotations

import os
import resource
import threading


def _rss() -> tuple[int, int]:
  """This process's resident bytes now and those of them that are not file-backed
  (anonymous: ``/proc/self/statm``'s resident − shared); elsewhere the peak so far, twice."""
  try:
    with open("/proc/self/statm") as f:
      resident, shared = (int(x) for x in f.read().split()[1:3])
    page = os.sysconf("SC_PAGE_SIZE")
    return resident * page, (resident - shared) * page
  except OSError:
    return _max_rss(), _max_rss()


def _max_rss() -> int:
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak * 1024 if os.uname().sysname == "Linux" else peak  # kB on Linux, bytes on macOS


class PeakRss:
  """Peak resident bytes while the block runs, minus those just before it (``increase``):
  sampled every 2 ms, and ``ru_maxrss`` when the block raised the process's all-time peak.
  ``anon_increase``: the same for anonymous memory alone (sampled), leaving out the pages
  of memory-mapped files (e.g. a safetensors file being read), which the kernel can drop."""

  def __enter__(self):
    (self.before, self.anon_before), self.max_before = _rss(), _max_rss()
    self.sampled = self.anon_sampled = 0
    self._stop = threading.Event()

    def sample():
      while not self._stop.wait(0.002):
        total, anon = _rss()
        self.sampled, self.anon_sampled = max(self.sampled, total), max(self.anon_sampled, anon)

    self._thread = threading.Thread(target=sample, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    (total, anon), after = _rss(), _max_rss()
    peak = max(self.sampled, total, after if after > self.max_before else 0)
    self.increase = peak - self.before
    self.anon_increase = max(self.anon_sampled, anon) - self.anon_before
    self.after = total
