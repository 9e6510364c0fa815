"""``python -m jaxstep.memory``: the same as ``jaxstep memory`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("memory"))
