"""``python -m jaxstep.evaluate``: the same as ``jaxstep evaluate`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("evaluate"))
