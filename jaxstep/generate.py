"""``python -m jaxstep.generate``: the same as ``jaxstep generate`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("generate"))
