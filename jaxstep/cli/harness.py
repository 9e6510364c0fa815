"""``jaxstep harness [lm_eval options …]``: EleutherAI's lm-evaluation-harness command line
(``lm_eval``) with the model ``jaxstep`` registered, offline.

    jaxstep harness --model_args path=RUN_DIR_OR_MODEL_FOLDER[,step=N,batch_size=B] \\
        --tasks hellaswag,arc_easy [--include_path MY_TASKS] [--apply_chat_template] …

``--model jaxstep`` is the default; every other option is the harness's own (``jaxstep
harness run --help`` lists them). The harness finds no model outside its own package by
itself, so its bare ``lm_eval`` command does not know ``jaxstep``: this command, or
``jaxstep.harness.register()`` before ``lm_eval.simple_evaluate(model="jaxstep", …)`` in
Python, registers it. The Hugging Face Hub is switched off: a task must read local files
(or data already in the ``datasets`` cache). Needs ``pip install 'jaxstep[eval]'``.
"""

from __future__ import annotations

import sys

from jaxstep.cli._common import report, setup_logging
from jaxstep.errors import JaxstepError

SUBCOMMANDS = ("run", "ls", "validate")


def harness_argv(argv: list[str]) -> list[str]:
  """``lm_eval``'s arguments: ``run`` first unless another subcommand is named, and
  ``--model jaxstep`` unless a model is."""
  if argv[:1] and argv[0] in SUBCOMMANDS:
    command, rest = argv[0], argv[1:]
  else:
    command, rest = "run", argv
  named = any(a == "--model" or a.startswith("--model=") for a in rest)
  if command == "run" and not named and not {"-h", "--help"} & set(rest):
    rest = ["--model", "jaxstep", *rest]
  return [command, *rest]


def main(argv=None) -> int:
  from jaxstep import harness

  setup_logging()
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    harness.register()
  except JaxstepError as e:
    return report(e)
  from lm_eval.__main__ import cli_evaluate

  from jaxstep.harness.tasks import offline

  saved = sys.argv
  sys.argv = ["jaxstep harness", *harness_argv(argv)]
  try:
    with offline():
      cli_evaluate()
  except JaxstepError as e:
    return report(e)
  except SystemExit as e:  # argparse's --help and usage errors
    return e.code if isinstance(e.code, int) else 1
  finally:
    sys.argv = saved
  return 0
