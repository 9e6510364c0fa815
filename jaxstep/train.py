"""``python -m jaxstep.train``: the same as ``jaxstep train`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("train"))
