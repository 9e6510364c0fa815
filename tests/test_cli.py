"""The commands as a user runs them: in subprocesses, and through the same dispatcher in this
process where a test checks what a command prints and returns, not how a process starts."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from jaxstep.cli import COMMANDS

ROOT = pathlib.Path(__file__).resolve().parent.parent

FAST = ["train.max_steps=24", "train.log_every=4", "train.eval_every=12"]


def cli(*args, module="jaxstep.train", timeout=300, cwd=None):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-m", module, *map(str, args)],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
    cwd=cwd,
  )


@pytest.mark.slow
def test_every_command_runs_as_python_m_jaxstep_dot_command():
  for command in COMMANDS:
    proc = cli("--help", module=f"jaxstep.{command}")
    assert proc.returncode == 0 and f"usage: jaxstep {command}" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_a_command_runs_three_ways_through_one_dispatcher():
  script = pathlib.Path(sys.executable).parent / "jaxstep"  # the console script pip installed
  ways = [
    cli("checkpoints", "--help", module="jaxstep"),
    cli("--help", module="jaxstep.checkpoints"),
    subprocess.run([script, "checkpoints", "--help"], capture_output=True, text=True, timeout=120),
  ]
  for proc in ways:
    assert proc.returncode == 0, proc.stderr
    assert "usage: jaxstep checkpoints" in proc.stdout


def test_unknown_command_names_the_nearest_one():
  proc = cli("trian", module="jaxstep")
  assert proc.returncode == 2 and "did you mean 'train'?" in proc.stderr


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_usage_mistake_is_one_error_line_and_exit_2(command, capsys):
  import importlib

  with pytest.raises(SystemExit) as stop:
    importlib.import_module(COMMANDS[command][0]).main(["--no-such-flag"])
  assert stop.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: jaxstep {command}: "), err
  assert err[0].endswith(f"(see jaxstep {command} --help)")


def test_overrides_may_stand_before_after_and_around_the_config_flag():
  from jaxstep.cli import _common, train

  got = train.parser().parse_intermixed_args(["run_dir=x", "--config", "tiny", "optim.lr=1"])
  assert (got.config, got.overrides) == ("tiny", ["run_dir=x", "optim.lr=1"])
  seen = []  # what a --config command (memory, check) gets
  argv = ["model.n_layers=1", "--config", "small", "model.d_model=32"]
  assert _common.config_command("jaxstep x", "", lambda cfg: seen.append(cfg) or 0, argv) == 0
  assert (seen[0].model.n_layers, seen[0].model.d_model) == (1, 32)
  assert seen[0].run_dir == "runs/small"  # the file's


# Shrinks any config to a seconds-long CPU run; everything else comes from the file.
SHRINK = {
  "model.d_model": 32,
  "model.n_layers": 1,
  "model.n_heads": 2,
  "model.max_seq_len": 32,
  "train.seq_len": 32,
  "train.global_batch_size": 8,
  "train.grad_accum_steps": 2,
  "train.max_steps": 2,
  "train.eval_batches": 1,
  "train.progress": False,
}


def _own_model(path) -> bool:
  """A config whose model is the bundled one (not a model folder's: ``model.init_from``)."""
  return not (yaml.safe_load(path.read_text()).get("model") or {}).get("init_from")


@pytest.mark.parametrize(
  "name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if _own_model(p))
)
@pytest.mark.slow
def test_every_file_in_configs_trains_from_the_repository_root(tmp_path, monkeypatch, name):
  """In this process (what --config does: config.load of the path, then train), to spare
  a start-up per file. A config that starts from a model folder (``sft-hf``) needs one:
  ``test_init_from.py`` trains it on a tiny folder."""
  from jaxstep import trainer
  from jaxstep.trainer.config import loading as config_lib

  overrides = [f"{k}={v}" for k, v in SHRINK.items()]
  path = (yaml.safe_load((ROOT / "configs" / name).read_text()).get("data") or {}).get("path")
  if path and not path.startswith("bundled:") and not (ROOT / path).exists():
    # a config for data you prepare first: prepare a small stand-in the same way
    from jaxstep.data import prepare

    prepare(["bundled:text"], tmp_path / "prepared", train_bpe_vocab=512, progress=False)
    overrides.append(f"data.path={tmp_path / 'prepared'}")
  monkeypatch.chdir(ROOT)
  trainer.train(config_lib.load(f"configs/{name}", [*overrides, f"run_dir={tmp_path / 'run'}"]))
  resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
  set_here = {o.split("=")[0] for o in overrides}
  for section, values in yaml.safe_load((ROOT / "configs" / name).read_text()).items():
    for key, value in values.items() if isinstance(values, dict) else []:
      if f"{section}.{key}" == "model.vocab_size" and value == 0:
        assert resolved["model"]["vocab_size"] >= 259  # followed the tokenizer
      elif f"{section}.{key}" not in set_here:
        assert resolved[section][key] == value, f"{section}.{key}"  # the file was read


@pytest.mark.slow
def test_default_config_trains_and_writes_every_output(tmp_path):
  run_dir = tmp_path / "run"
  proc = cli(*FAST, f"run_dir={run_dir}")
  assert proc.returncode == 0, proc.stderr
  assert "final step 24" in proc.stdout
  lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines] == [4, 8, 12, 16, 20, 24]
  assert lines[-1]["loss"] < lines[0]["loss"] - 0.5
  assert all(r["updated"] and r["tokens"] > 0 for r in lines)
  evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
  assert [r["step"] for r in evals] == [12, 24]
  assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
  assert "max_steps: 24" in (run_dir / "config.yaml").read_text()
  assert "\r" not in proc.stderr  # no progress bar when stderr is not a terminal

  plot = cli(run_dir, module="jaxstep.plot")
  assert plot.returncode == 0 and (run_dir / "loss.png").stat().st_size > 10_000


def train_here(capsys, *args):
  """``jaxstep train`` with ``args`` in this process, through the commands' dispatcher:
  ``(exit code, stdout, stderr)`` (conftest started JAX's backend, so the command leaves
  this process's devices as they are)."""
  from jaxstep.cli import run

  code = run("train", [str(a) for a in args])
  out, err = capsys.readouterr()
  return code, out, err


def test_help_lists_flags_and_config_keys(capsys):
  with pytest.raises(SystemExit) as stop:
    train_here(capsys, "--help")
  assert stop.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--config", "--debug", "key=value", "train.global_batch_size", "optim.lr"):
    assert flag in out


def write(path, text):
  path.write_text(text)
  return path


BAD_INPUTS = {
  "typo": (lambda d: ["train.max_step=3"], "did you mean 'train.max_steps'"),
  "type": (lambda d: ["optim.lr=fast"], "'optim.lr': expected float"),
  "non_divisible": (
    lambda d: ["train.global_batch_size=10", "train.grad_accum_steps=4"],
    "10 is not divisible by train.grad_accum_steps 4",
  ),
  "missing_file": (lambda d: [f"data.path={d / 'nope.txt'}"], "does not exist"),
  "empty_dataset": (lambda d: [f"data.path={write(d / 'e.txt', '')}"], "no documents"),
  "malformed_jsonl": (
    lambda d: [f"data.path={write(d / 'b.jsonl', '{oops')}"],
    "b.jsonl:1: malformed JSON",
  ),
  "vocab": (lambda d: ["model.vocab_size=100"], "set model.vocab_size >= 259"),
  "missing_config": (lambda d: ["--config", d / "none.yaml"], "does not exist"),
}


ALSO_AS_A_PROCESS = ("typo",)  # also run as `python -m jaxstep.train`: the exit code of a process


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line_and_no_run_dir(tmp_path, capsys, name):
  make_args, message = BAD_INPUTS[name]
  run_dir = tmp_path / "run"
  ways = [train_here(capsys, *make_args(tmp_path), f"run_dir={run_dir}")]
  if name in ALSO_AS_A_PROCESS:
    proc = cli(*make_args(tmp_path), f"run_dir={run_dir}")
    ways.append((proc.returncode, proc.stdout, proc.stderr))
  for code, _, err in ways:
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err
    assert not run_dir.exists()


def test_debug_flag_shows_the_traceback(tmp_path, capsys):
  """With ``--debug`` the error leaves the command as an exception (Python prints its
  traceback and the process exits 1), not as one ``error:`` line."""
  from jaxstep.errors import ConfigError

  with pytest.raises(ConfigError, match="did you mean 'train.max_steps'"):
    train_here(capsys, "--debug", "train.max_step=3", f"run_dir={tmp_path / 'r'}")
  assert "error:" not in capsys.readouterr().err


def test_plot_without_metrics_exits_2(tmp_path):
  proc = cli(tmp_path, module="jaxstep.plot")
  assert proc.returncode == 2 and "metrics.jsonl" in proc.stderr


@pytest.mark.slow
def test_checkpoints_lists_them_and_all_corrupt_exits_nonzero(tmp_path):
  from conftest import SMALL_MODEL, make_cfg

  make_cfg(tmp_path)
  args = [
    *SMALL_MODEL,
    "train.max_steps=4",
    "checkpoint.every=2",
    f"data.path={tmp_path / 'corpus.txt'}",
    f"run_dir={tmp_path / 'run'}",
  ]
  assert cli(*args).returncode == 0
  listing = cli(tmp_path / "run", module="jaxstep.checkpoints")
  assert listing.returncode == 0, listing.stderr
  rows = listing.stdout.strip().splitlines()
  assert rows[0].split() == ["step", "epoch", "loss", "size", "MB", "status"]
  assert [r.split()[0] for r in rows[1:]] == ["4", "2"] and all(r.endswith("ok") for r in rows[1:])
  for marker in (tmp_path / "run" / "checkpoints").glob("*/_CHECKPOINT_METADATA"):
    marker.unlink()
  proc = cli(*args)
  assert proc.returncode == 2 and "none restores" in proc.stderr
  assert (
    "INVALID: missing commit marker" in cli(tmp_path / "run", module="jaxstep.checkpoints").stdout
  )


def nan_run(tmp_path, policy):
  from conftest import SMALL_MODEL, make_cfg

  make_cfg(tmp_path)
  return cli(
    *SMALL_MODEL,
    "train.max_steps=5",
    "train.log_every=1",
    "checkpoint.every=1",
    "checkpoint.keep=10",
    "train.debug_nan_step=3",
    f"train.nonfinite={policy}",
    f"data.path={tmp_path / 'corpus.txt'}",
    f"run_dir={tmp_path / 'run'}",
  )


def checkpoint_params(run_dir, step):
  import jax
  from conftest import restore_state_arrays

  return jax.tree.leaves(restore_state_arrays(run_dir, step)[1]["params"])


@pytest.mark.slow
def test_nan_mid_run_is_skipped_and_the_bad_batch_kept(tmp_path):
  import numpy as np

  proc = nan_run(tmp_path, "skip")
  assert proc.returncode == 0, proc.stderr
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["updated"] for r in lines] == [True, True, False, True, True]
  assert [r["nonfinite_total"] for r in lines] == [0, 0, 1, 1, 1]
  for a, b in zip(
    checkpoint_params(tmp_path / "run", 2), checkpoint_params(tmp_path / "run", 3), strict=True
  ):
    np.testing.assert_array_equal(a, b)  # the poisoned update left the params untouched
  bad = np.load(tmp_path / "run" / "bad_batches" / "step_00000003.npz")
  assert np.isnan(bad["poison"]).all() and bad["inputs"].shape[0] == 32
  position = json.loads((tmp_path / "run" / "bad_batches" / "step_00000003.json").read_text())
  assert position["step"] == 3 and position["epoch"] == 0


@pytest.mark.slow
def test_nan_mid_run_halts_with_a_checkpoint_of_the_last_good_state(tmp_path):
  import numpy as np

  proc = nan_run(tmp_path, "halt")
  assert proc.returncode == 1 and "update step 3 was non-finite" in proc.stderr
  assert (tmp_path / "run" / "bad_batches" / "step_00000003.npz").exists()
  for a, b in zip(
    checkpoint_params(tmp_path / "run", 2), checkpoint_params(tmp_path / "run", 3), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  assert not (tmp_path / "run" / "checkpoints" / "4").exists()


@pytest.mark.slow
def test_progress_bar_shows_on_a_terminal(tmp_path):
  import fcntl
  import os
  import pty
  import struct
  import termios

  from conftest import SMALL_MODEL, make_cfg

  make_cfg(tmp_path)
  primary, secondary = pty.openpty()
  fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a real size
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "jaxstep.train",
      *[a for a in SMALL_MODEL if "progress" not in a],
      "train.max_steps=12",
      f"data.path={tmp_path / 'corpus.txt'}",
      f"run_dir={tmp_path / 'run'}",
    ],
    stdout=subprocess.DEVNULL,
    stderr=secondary,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  os.close(secondary)
  chunks = []
  while True:
    try:
      data = os.read(primary, 4096)
    except OSError:  # the child closed the terminal
      break
    if not data:
      break
    chunks.append(data)
  assert proc.wait(timeout=300) == 0
  screen = b"".join(chunks).decode(errors="replace")
  assert "\r" in screen and "12/12" in screen and "loss=" in screen and "tok_s=" in screen


@pytest.mark.slow
def test_evaluate_reads_raw_text_the_way_the_runs_data_was_prepared(tmp_path, capsys):
  from conftest import make_cfg

  from jaxstep import trainer
  from jaxstep.cli import run as run_command
  from jaxstep.data import prepare

  corpus = tmp_path / "code"
  corpus.mkdir()
  for i in range(12):  # blank lines inside each file: txt and file cut it differently
    (corpus / f"m{i}.py").write_text(f"def f{i}():\n\n  return {i} + {i}\n\n\nx = f{i}()\n")
  prepare([str(corpus)], tmp_path / "prepared", fmt="file", progress=False)
  overrides = ["train.max_steps=1", "train.global_batch_size=4", "train.grad_accum_steps=1"]
  trainer.train(make_cfg(tmp_path, f"data.path={tmp_path / 'prepared'}", *overrides))
  run_dir = tmp_path / "run"

  def evaluate(*args):
    code = run_command("evaluate", [str(run_dir), "--data", str(corpus), "--json", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)

  default, as_file, as_txt = evaluate(), evaluate("--format", "file"), evaluate("--format", "txt")
  assert default["format"] == "file" and as_txt["format"] == "txt"
  assert default["loss"] == as_file["loss"] != as_txt["loss"]
  assert default["windows"] == as_file["windows"]


def test_every_evaluate_option_is_documented_in_cli_md():
  from jaxstep.cli.evaluate import parser

  text = (ROOT / "docs" / "cli.md").read_text()
  section = text[text.index("## `jaxstep evaluate") :]
  flags = [o for a in parser()._actions for o in a.option_strings if o.startswith("--")]
  assert {"--data", "--format", "--batch-size", "--step", "--split", "--json"} <= set(flags)
  missing = [f for f in flags if f != "--help" and f"`{f}" not in section]
  assert not missing, missing
