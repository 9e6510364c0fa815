"""Documents → framed token arrays (``encode``), in this process or in worker processes
that the parent stops on any error: a Ctrl-C kills them, and a worker that dies (the OOM
killer) is seen at once, never waited for."""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import NoReturn

import numpy as np

from jaxstep.data import samples
from jaxstep.data.tokenizer import Tokenizer
from jaxstep.data.tokenizer_loading import load_tokenizer
from jaxstep.errors import DataError, WorkerError

# Worker processes keep their tokenizer in a global: it is loaded once per process.
_worker_tok: Tokenizer | None = None


def _init_worker(spec: str) -> None:
  global _worker_tok
  _worker_tok = load_tokenizer(spec)


def encode(task: tuple[str, list]) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
  """One batch of documents → ``(kind, tokens, flags, lengths)``: every document's framed
  tokens and target flags back to back, and each one's length."""
  kind, docs = task
  tok = _worker_tok
  if kind == "chat":
    encoded = [samples.encode_chat(d, tok) for d in docs]
    lengths = np.array([len(t) for t, _ in encoded], np.int64)
    return kind, *(np.concatenate(parts) for parts in zip(*encoded, strict=True)), lengths
  ids, body = tok.encode_flat(docs)  # [Σ body] tokens, [docs] body lengths
  lengths = body + 2  # BOS body EOS
  starts = np.cumsum(lengths) - lengths
  tokens = np.empty(int(lengths.sum()), np.int32)
  frame = np.zeros(len(tokens), bool)
  frame[starts], frame[starts + lengths - 1] = True, True
  tokens[starts], tokens[starts + lengths - 1] = tok.BOS, tok.EOS
  tokens[~frame] = ids
  flags = np.ones(len(tokens), np.uint8)
  flags[starts] = 0  # BOS is never a target; EOS is
  return kind, tokens, flags, lengths


@contextlib.contextmanager
def encoder(workers: int, spec: str) -> Iterator[Callable[[Iterable], Iterator]]:
  """``encode(tasks)``: ``encode`` of each task, in order; in this process, or in
  ``workers`` processes. The processes are stopped on the way out, killed if an error (a
  Ctrl-C) is on its way.

  Raises:
    WorkerError: a worker process died (killed: out of memory, say).
  """
  if workers == 1:
    _init_worker(spec)
    yield lambda tasks: map(encode, tasks)
    return
  pool = _Pool(workers, spec)
  try:
    yield pool.map
  except BaseException:
    pool.close(kill=True)
    raise
  pool.close()


class _Pool:
  """Worker processes that encode tasks in turn, two in flight each (memory holds those,
  never the corpus). Each has pipes of its own, so its results come back in order, and its
  death, even halfway through a result, ends its pipe: seen at once. (A pool sharing one
  result pipe waits forever for the rest of a result a killed worker was sending.)"""

  DEPTH = 2

  def __init__(self, workers: int, spec: str):
    spawn = multiprocessing.get_context("spawn")
    self.workers = []
    for _ in range(workers):
      tasks_out, tasks_in = spawn.Pipe(duplex=False)
      results_out, results_in = spawn.Pipe(duplex=False)
      process = spawn.Process(target=_work, args=(spec, tasks_out, results_in), daemon=True)
      with _sigint_held():  # the process inherits that: a Ctrl-C is for this one to handle
        process.start()
      tasks_out.close()  # the worker's ends: only it holds them now
      results_in.close()
      self.workers.append((process, tasks_in, results_out))

  def map(self, tasks: Iterable) -> Iterator:
    """The results of ``tasks``, in order."""
    n, sent, received = len(self.workers), 0, 0
    for task in tasks:
      self._send(sent % n, task)
      sent += 1
      if sent - received == self.DEPTH * n:
        yield self._receive(received % n)
        received += 1
    for i in range(received, sent):
      yield self._receive(i % n)

  def _send(self, i: int, task) -> None:
    try:
      self.workers[i][1].send(task)
    except OSError:  # a broken pipe: the worker is gone
      self._died(i)

  def _receive(self, i: int):
    try:
      ok, value = self.workers[i][2].recv()
    except (EOFError, OSError):  # its end of the pipe closed, maybe halfway through a result
      self._died(i)
    if not ok:
      raise value  # what the encoding raised, in the worker
    return value

  def _died(self, i: int) -> NoReturn:
    process = self.workers[i][0]
    process.join(timeout=10)  # it is gone: its exit code says how
    raise WorkerError(_worker_died(process.exitcode)) from None

  def close(self, kill: bool = False) -> None:
    """Ends the workers: each exits once its task pipe is closed (at once: ``kill``)."""
    for process, tasks, _ in self.workers:
      if kill:
        process.kill()
      tasks.close()
    for process, _, results in self.workers:
      process.join(timeout=30)  # a worker finishes its task, sees its pipe closed, exits
      if process.is_alive():
        process.kill()
        process.join()
      results.close()


def _work(spec: str, tasks, results) -> None:
  """A worker process: encodes the tasks from its pipe until it is closed. A thread takes
  them in as they come, so its parent never blocks sending one (while this one is blocked
  sending it a result). Ctrl-C is its parent's to handle, which stops it."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a group-wide SIGTERM: the parent stops it
  _init_worker(spec)
  inbox = queue.SimpleQueue()
  threading.Thread(target=_take_in, args=(tasks, inbox), daemon=True).start()
  try:
    while (task := inbox.get()) is not None:
      try:
        answer = (True, encode(task))
      except Exception as e:  # noqa: BLE001 - raised again in the parent
        answer = (False, _portable(e))
      results.send(answer)
  except (BrokenPipeError, EOFError):
    pass  # the parent is gone


def _portable(error: Exception) -> Exception:
  """``error`` if it survives the pipe (pickled here, rebuilt in the parent), else a
  ``DataError`` with its type and message, so the cause is never lost."""
  try:
    pickle.loads(pickle.dumps(error))
    return error
  except Exception:  # noqa: BLE001 - any failure to round-trip
    return DataError(f"{type(error).__name__}: {error}")


def _take_in(tasks, inbox) -> None:
  while True:
    try:
      inbox.put(tasks.recv())
    except (EOFError, OSError):  # closed: the parent is done, or gone
      inbox.put(None)
      return


def _worker_died(code: int | None) -> str:
  """The error line for a worker that ended with exit code ``code``."""
  how = ""
  if code is not None and code < 0:
    oom = ", perhaps out of memory" if code == -signal.SIGKILL else ""
    how = f" (killed by signal {-code}{oom})"
  elif code:
    how = f" (exit status {code})"
  return f"a prepare worker died{how}; nothing was written; retry with fewer --workers"


@contextlib.contextmanager
def _sigint_held():
  """SIGINT held back from this thread meanwhile, then delivered: a process started now
  inherits the mask, so a Ctrl-C in the terminal reaches only this one."""
  old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
