"""``jaxstep harness [lm_eval options …]``: EleutherAI's lm-evaluation-harness command line
(``lm_eval``) with the model ``jaxstep`` registered, offline.

    jaxstep harness --model_args path=RUN_DIR_OR_MODEL_FOLDER[,step=N,batch_size=B] \\
        --tasks hellaswag,arc_easy [--include_path MY_TASKS] [--apply_chat_template] …

``--model jaxstep`` and ``--batch_size 8`` are the defaults (``batch_size=`` in
``--model_args`` wins); every other option is the harness's own (``jaxstep
harness run --help`` lists them). The harness finds no model outside its own package by
itself, so its bare ``lm_eval`` command does not know ``jaxstep``: this command, or
``jaxstep.register_harness()`` before ``lm_eval.simple_evaluate(model="jaxstep", …)`` in
Python, registers it. The Hugging Face Hub is switched off: a task must read local files
(or data already in the ``datasets`` cache). Needs ``pip install 'jaxstep[eval]'``.
"""

from __future__ import annotations

import logging
import sys

from jaxstep.cli._common import report, setup_logging
from jaxstep.errors import JaxstepError

SUBCOMMANDS = ("run", "ls", "validate")
DEFAULT_BATCH = 8  # requests per compiled batch unless --batch_size (or batch_size=) says


def harness_argv(argv: list[str]) -> list[str]:
  """``lm_eval``'s arguments: ``run`` first unless another subcommand is named, and
  ``--model jaxstep`` unless a model is."""
  if argv[:1] and argv[0] in SUBCOMMANDS:
    command, rest = argv[0], argv[1:]
  else:
    command, rest = "run", argv
  given = lambda flag: any(a == flag or a.startswith(f"{flag}=") for a in rest)  # noqa: E731
  if command == "run" and not given("--model") and not {"-h", "--help"} & set(rest):
    rest = ["--model", "jaxstep", *rest]
    if not given("--batch_size") and not given("-b"):
      rest += ["--batch_size", str(DEFAULT_BATCH)]  # the harness's own default is 1
  return [command, *rest]


def main(argv=None) -> int:
  from jaxstep.trainer.saved_run.harness import register

  setup_logging()
  logging.getLogger("datasets").setLevel(logging.WARNING)  # its import's notes
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    register()
  except JaxstepError as e:
    return report(e)
  from lm_eval._cli import HarnessCLI

  from jaxstep.lmeval.tasks import check_tasks, offline, same_index

  cli = HarnessCLI()
  cli._parser.prog = "jaxstep harness"
  for name, parser in cli._subparsers.choices.items():
    parser.prog = f"jaxstep harness {name}"
    parser.usage = parser.usage and parser.usage.replace("lm-eval", "jaxstep harness")
  for parser in (cli._parser, *cli._subparsers.choices.values()):
    parser.error = _one_line  # a usage mistake: one line and exit 2, as every command's
  if argv[:1] in (["-h"], ["--help"]):
    print(__doc__)
  saved = sys.argv
  sys.argv = ["jaxstep harness", *harness_argv(argv)]
  try:
    args = cli.parse_args()
    manager = None
    if getattr(args, "command", None) == "run" and args.tasks:
      manager = check_tasks(args.tasks, args.include_path)  # before any model work
    with offline(), same_index(manager):
      cli.execute(args)
  except JaxstepError as e:
    return report(e)
  finally:
    sys.argv = saved
  return 0


def _one_line(message: str):
  print(f"error: jaxstep harness: {message} (see jaxstep harness --help)", file=sys.stderr)
  sys.exit(2)
