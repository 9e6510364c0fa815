"""``python -m jaxstep.generate``: the same as ``jaxstep generate`` (see jaxstep.cli)."""

if __name__ == "__main__":
  from jaxstep.cli import run

  raise SystemExit(run("generate"))
