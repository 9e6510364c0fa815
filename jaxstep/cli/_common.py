"""What every command shares: the ``--config`` + ``key=value`` arguments, logging, and one
mapping from jaxstep's errors to a one-line message and an exit code."""

from __future__ import annotations

import argparse
import logging
import sys

from jaxstep.errors import (
  CheckpointError,
  ConfigError,
  DataError,
  Interrupted,
  JaxstepError,
  PromptError,
  RunDirError,
  RunIOError,
)
from jaxstep.trainer.store.orbax_echoes import drop_closed_loop_echoes

# Bad input: nothing was trained, or nothing was written; the user changes something.
BAD_INPUT = (ConfigError, DataError, CheckpointError, RunDirError, PromptError)


IO_ERROR = 74  # sysexits.h EX_IOERR: a write failed (disk full, read-only directory)


def exit_code(error: JaxstepError) -> int:
  """2 bad input, 74 a failed write, 128 + signal after SIGTERM/SIGINT, 1 any other stop."""
  if isinstance(error, Interrupted):
    return 128 + error.signum
  if isinstance(error, RunIOError):
    return IO_ERROR
  return 2 if isinstance(error, BAD_INPUT) else 1


class Parser(argparse.ArgumentParser):
  """argparse's parser whose usage errors are one ``error:`` line and exit 2, as every other
  error of the commands: the usage block is what ``--help`` prints, not what a typo gets."""

  def error(self, message: str):
    print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
    raise SystemExit(2)


MAX_MESSAGE = 1000  # characters of an error line: a value quoted in it may be huge


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
  """``message`` on one line, cut to ``limit`` characters (saying how much was cut)."""
  message = " ".join(line.strip() for line in message.splitlines())
  if len(message) <= limit:
    return message
  return f"{message[:limit]} … ({len(message) - limit:,} more characters)"


def report(error: JaxstepError) -> int:
  """Prints ``error: <message>`` (one line, capped) on stderr and returns the exit code."""
  print(f"error: {one_line(str(error))}", file=sys.stderr)
  return exit_code(error)


def setup_logging() -> None:
  """INFO lines with a time on stderr; JAX's and orbax's own chatter quietened.

  ``force``: importing orbax may already have given the root logger a default handler
  (absl's ``log`` calls ``basicConfig`` when nothing is configured).
  """
  logging.basicConfig(
    level=logging.INFO,
    format="%(asctime)s %(message)s",
    datefmt="%H:%M:%S",
    stream=sys.stderr,
    force=True,
  )
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)  # "no TPU" noise on CPU
  # A damaged checkpoint fails several of orbax's concurrent reads: the first error reaches
  # us (and is reported as one line); the others end as "Task exception was never
  # retrieved" tracebacks that asyncio logs when their tasks are collected.
  logging.getLogger("asyncio").setLevel(logging.CRITICAL)
  absl = logging.getLogger("absl")
  absl.setLevel(logging.WARNING)  # orbax's per-save INFO chatter
  if not any(isinstance(f, _OrbaxErrorsRaisedToUs) for f in absl.filters):
    absl.addFilter(_OrbaxErrorsRaisedToUs())
  drop_closed_loop_echoes()


class _OrbaxErrorsRaisedToUs(logging.Filter):
  """orbax logs a failed background write from each of its threads, with tracebacks, and
  also raises it to the caller, where jaxstep reports it in one line: drop the logged
  copies (ERROR and above from orbax's modules); warnings still show."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or "orbax" not in record.pathname


def add_config_args(parser: argparse.ArgumentParser) -> None:
  """``--config`` and the ``key=value`` overrides, for every command that takes a config."""
  parser.add_argument(
    "--config",
    default=None,
    help="YAML file or bundled name (tiny, small, sft-chat, …); default: tiny",
  )
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")


def config_command(prog: str, doc: str, action, argv=None) -> int:
  """``main`` of a command that takes ``--config`` + overrides and runs ``action(cfg) ->
  exit code``; a jaxstep error prints one ``error:`` line and sets the exit code."""
  from jaxstep.trainer.config import loading as config_lib

  p = Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_config_args(p)
  args = p.parse_intermixed_args(argv)
  try:
    return action(config_lib.load(args.config, args.overrides))
  except JaxstepError as e:
    return report(e)


def run_dir_parser(prog: str, doc: str) -> argparse.ArgumentParser:
  """The parser of a command that reads a trained run: ``RUN_DIR`` and ``--step``."""
  p = Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", metavar="PATH", help="a run directory (or a model folder)")
  p.add_argument("--step", type=int, default=None, help="checkpoint (default: newest valid)")
  return p


def add_tensor_arg(parser: argparse.ArgumentParser) -> None:
  """``--tensor N``: the model split over N local devices (a CPU-only host: N virtual ones)."""
  parser.add_argument(
    "--tensor",
    type=int,
    default=1,
    help="split the model over this many local devices, the way mesh.tensor splits it in "
    "training (a model one device does not hold); default 1",
  )


def run_dir_command(action, args) -> int:
  """Runs ``action(args) -> exit code`` of a command that reads a trained run; a jaxstep
  error prints one ``error:`` line and sets the exit code. A ``--tensor`` over 1 on a
  CPU-only host splits the CPU into that many devices first."""
  setup_logging()
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notices on reading a run
  if getattr(args, "tensor", 1) > 1:
    from jaxstep.parallel import cpu_devices

    cpu_devices.configure_cpu_defaults(1, 1, cpu_devices=args.tensor)
  try:
    return action(args)
  except JaxstepError as e:
    return report(e)
