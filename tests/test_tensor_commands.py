"""``jaxstep generate`` and ``jaxstep evaluate`` with ``--tensor N``: the model split over N
devices (on a CPU-only host, N virtual ones) the way a tensor-parallel run splits it, for a
model one device does not hold; the same tokens and the same losses as on one device."""

import json
import subprocess
import sys

import pytest
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import folder  # noqa: F401 - fixture

from jaxstep.errors import ConfigError


def jaxstep(*args):
  return subprocess.run(
    [sys.executable, "-m", "jaxstep", *args], capture_output=True, text=True, timeout=300
  )


def outputs(command: str, path, *args) -> list:
  """``command``'s JSON lines on one device and on a tensor axis of 2 (whose log says so)."""
  out = []
  for tensor in ("1", "2"):
    done = jaxstep(command, str(path), *args, "--json", "--tensor", tensor)
    assert done.returncode == 0, done.stderr[-2000:]
    split = "split over 2 devices on a tensor axis" in done.stderr
    assert split == (tensor == "2"), done.stderr[-2000:]
    out.append([json.loads(line) for line in done.stdout.splitlines()])
  return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A bundled-GPT run (2 heads) of 2 updates, and the text it trained on."""
  from conftest import make_cfg

  from jaxstep import trainer

  root = tmp_path_factory.mktemp("tensor-commands")
  trainer.train(make_cfg(root, "train.max_steps=2", "train.eval_every=0"))
  return root / "run", root / "corpus.txt"


@pytest.mark.slow
def test_a_run_generates_and_evaluates_split_over_tensor_as_on_one_device(run_dir):
  run, corpus = run_dir
  greedy = ["--prompt", "12 + 7 =", "--prompt", "3", "--temperature", "0"]
  one, split = outputs("generate", run, *greedy, "--max-new-tokens", "12")
  assert [s["tokens"] for s in split] == [s["tokens"] for s in one]
  (one,), (split,) = outputs("evaluate", run, "--data", str(corpus))
  assert split["tokens"] == one["tokens"] > 0
  assert split["loss"] == pytest.approx(one["loss"], rel=1e-5)


@pytest.mark.slow
def test_a_model_folder_generates_split_over_tensor_as_on_one_device(folder):  # noqa: F811
  """A grouped-query Qwen3 folder (4 query heads, 2 key/value heads), each tensor placed
  on its split as it is read."""
  path, _ = folder
  one, split = outputs("generate", path, "--prompt", "hello", "--temperature", "0")
  assert split[0]["tokens"] == one[0]["tokens"] and len(one[0]["tokens"]) > 0


def test_more_devices_than_the_process_has_is_one_line():
  from jaxstep.models import GPTConfig
  from jaxstep.trainer.saved_run.load import tensor_mesh

  model = GPTConfig(n_heads=2, d_model=32)
  with pytest.raises(ConfigError, match=r"^--tensor 2 splits the model over 2 devices; this "):
    tensor_mesh(model, 2)  # this test process has one device
  with pytest.raises(ConfigError, match=r"--tensor must be >= 1"):
    tensor_mesh(model, 0)
  assert tensor_mesh(model, 1) is None


@pytest.mark.slow
def test_a_tensor_size_the_model_cannot_split_is_one_line(run_dir):
  """The run's 2 heads do not split over 3 devices: one line naming the numbers and the
  nearest size that works, exit 2, before anything is read."""
  run, _ = run_dir
  done = jaxstep("generate", str(run), "--tensor", "3")
  assert done.returncode == 2, done.stderr[-2000:]
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "--tensor 3 does not divide model.n_heads 2" in errors[0]
  assert errors[0].endswith("use --tensor 2")
  assert "Traceback" not in done.stderr
