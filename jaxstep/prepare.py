"""``python -m jaxstep.prepare``: the same as ``jaxstep prepare`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("prepare"))
