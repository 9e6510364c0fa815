"""``python -m jaxstep.plot``: the same as ``jaxstep plot`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("plot"))
