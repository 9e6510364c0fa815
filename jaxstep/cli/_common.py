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
)

# Bad input: nothing was trained, or nothing was written; the user changes something.
BAD_INPUT = (ConfigError, DataError, CheckpointError, RunDirError, PromptError)


def exit_code(error: JaxstepError) -> int:
  """2 bad input, 128 + signal after SIGTERM/SIGINT, 1 any other stop of a run."""
  if isinstance(error, Interrupted):
    return 128 + error.signum
  return 2 if isinstance(error, BAD_INPUT) else 1


def report(error: JaxstepError) -> int:
  """Prints ``error: <message>`` on stderr and returns the exit code."""
  print(f"error: {error}", file=sys.stderr)
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
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save INFO chatter


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
  from jaxstep.trainer import config as config_lib

  p = argparse.ArgumentParser(
    prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add_config_args(p)
  args = p.parse_args(argv)
  try:
    return action(config_lib.load(args.config, args.overrides))
  except JaxstepError as e:
    return report(e)


def run_dir_parser(prog: str, doc: str) -> argparse.ArgumentParser:
  """The parser of a command that reads a trained run: ``RUN_DIR`` and ``--step``."""
  p = argparse.ArgumentParser(
    prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("run_dir")
  p.add_argument("--step", type=int, default=None, help="checkpoint (default: newest valid)")
  return p


def run_dir_command(action, args) -> int:
  """Runs ``action(args) -> exit code`` of a command that reads a trained run; a jaxstep
  error prints one ``error:`` line and sets the exit code."""
  setup_logging()
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notices on reading a run
  try:
    return action(args)
  except JaxstepError as e:
    return report(e)
