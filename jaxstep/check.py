"""``python -m jaxstep.check``: the same as ``jaxstep check`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("check"))
