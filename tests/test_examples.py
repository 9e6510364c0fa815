"""The examples run and do what they say."""

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_linear_regression_converges_to_3x_plus_2(capsys):
  state = load("linear_regression").main()
  assert float(state.params["w"]) == pytest.approx(3.0, abs=0.05)
  assert float(state.params["b"]) == pytest.approx(2.0, abs=0.05)
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 100 and lines[-1].startswith("step 100")
