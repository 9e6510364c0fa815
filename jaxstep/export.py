"""``python -m jaxstep.export``: the same as ``jaxstep export`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("export"))
