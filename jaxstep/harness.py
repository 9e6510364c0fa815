"""``python -m jaxstep.harness``: the same as ``jaxstep harness`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("harness"))
