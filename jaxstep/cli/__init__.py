"""The commands: ``jaxstep <command> …`` (the console script), ``python -m jaxstep <command>``
and ``python -m jaxstep.<command>`` all run the ``main(argv)`` of one module here."""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import signal
import sys
import threading

# command -> (module, one-line description)
COMMANDS = {
  "prepare": ("jaxstep.cli.prepare", "tokenize a corpus once into shards and a manifest"),
  "train": ("jaxstep.cli.train", "train from a config (default: the bundled tiny one)"),
  "check": ("jaxstep.cli.check", "is accumulation exact for a config? K vs 1, stage by stage"),
  "memory": ("jaxstep.cli.memory", "bytes per device: textbook, jaxstep's layout, compiled"),
  "checkpoints": ("jaxstep.cli.checkpoints", "list a run's checkpoints and whether each is ok"),
  "generate": ("jaxstep.cli.generate", "continue text prompts with a trained run's model"),
  "evaluate": ("jaxstep.cli.evaluate", "loss, perplexity and bits per byte of a run on any data"),
  "harness": ("jaxstep.cli.harness", "lm-evaluation-harness tasks on a run or a model folder"),
  "export": ("jaxstep.cli.export", "a run's checkpoint as a Hugging Face model folder"),
  "plot": ("jaxstep.cli.plot", "RUN_DIR/loss.png: loss, lr and grad norm by update step"),
}


# the commands that compile: each starts with the persistent compilation cache on
# (``compile_cache``; ``train`` may move or disable it with its config's ``xla_cache``)
COMPILING = frozenset({"train", "check", "memory", "generate", "evaluate", "harness", "export"})


def usage() -> str:
  width = max(map(len, COMMANDS))
  lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
  return "usage: jaxstep <command> [args …]   (jaxstep <command> --help)\n\n" + "\n".join(lines)


SIGINT_EXIT = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C stopped


def _stop_at_once(command: str):
  """SIGINT before a command installs its own handling: one line and exit 130 at once. A
  KeyboardInterrupt would not do: Python raises it wherever the interpreter happens to be,
  and inside a garbage-collection callback (JAX has one) it is printed and swallowed, so
  the command would go on."""

  def handler(signum, frame):
    sys.stderr.write(f"error: jaxstep {command} interrupted (SIGINT)\n")
    sys.stderr.flush()
    os._exit(SIGINT_EXIT)

  return handler


def run(command: str, argv=None) -> int:
  """Runs one command's ``main`` with ``argv`` (default: the process's arguments). Ctrl-C
  before the command installs its own handling (imports, reading data, compiling) ends it
  with one line and exit 130, not a traceback; ``train``'s update loop takes SIGINT over
  and saves a checkpoint first."""
  main_thread = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGINT, _stop_at_once(command)) if main_thread else None
  try:
    if command in COMPILING:
      from jaxstep.cli import compile_cache

      compile_cache.enable()
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(sys.argv[1:] if argv is None else argv)
  except KeyboardInterrupt:
    print(f"error: jaxstep {command} interrupted (SIGINT)", file=sys.stderr)
    return SIGINT_EXIT
  finally:
    if main_thread:
      signal.signal(signal.SIGINT, previous)


def exit_process(code: int) -> None:
  """Ends the process with ``code``, as a command's entry point does. Python waits for every
  background thread before it exits; after a failed checkpoint write, orbax's save threads
  wait up to 20 minutes for signals that never come, so a command that already reported
  its error would hang. A command that failed has written and closed what it keeps (the
  error paths do that before returning), so it ends at once; a command that succeeded, or
  any process of a multi-process job, ends as Python ends, running every exit handler."""
  if code == 0 or _in_a_multi_process_job():
    sys.exit(code)  # the job's processes leave together through JAX's shutdown barrier
  sys.stdout.flush()
  sys.stderr.flush()
  logging.shutdown()
  os._exit(code)


def _in_a_multi_process_job() -> bool:
  """Whether ``jax.distributed`` was started: then a process that skipped its exit handlers
  would leave the others waiting for it at their shutdown barrier until JAX aborts them."""
  jax = sys.modules.get("jax")
  return jax is not None and jax.distributed.is_initialized()


def console_main() -> None:
  """The ``jaxstep`` console script and ``python -m jaxstep``."""
  exit_process(main())


def main(argv=None) -> int:
  """``jaxstep <command> [args …]``."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(usage())
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command not in COMMANDS:
    near = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f" (commands: {', '.join(COMMANDS)})"
    print(f"error: unknown command {command!r}{hint}", file=sys.stderr)
    return 2
  return run(command, rest)
