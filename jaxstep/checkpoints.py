"""``python -m jaxstep.checkpoints``: the same as ``jaxstep checkpoints`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import exit_process, run

  exit_process(run("checkpoints"))
