"""The launch recipes in examples/launch/ parse, and every ``python -m jaxstep.train`` command
in them takes only flags and config keys that exist: each is parsed by ``jaxstep train``'s own
argument parser and loaded by ``config.load`` (shell variables stand for a dummy path)."""

import pathlib
import re
import shlex
import subprocess

import pytest
import yaml

from jaxstep.cli import train as train_cli
from jaxstep.errors import ConfigError
from jaxstep.trainer.config import loading as config_lib

LAUNCH = pathlib.Path(__file__).resolve().parent.parent / "examples" / "launch"
COMMAND = re.compile(r"python -m jaxstep\.train\b[^\n]*")
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
DUMMY = "/shared/dummy"
SHELL_RECIPES = ("slurm.sbatch", "tpu_pod.sh")


def shell_commands(text: str) -> list[str]:
  """The ``python -m jaxstep.train …`` commands of a shell script, continuation lines joined
  and variables replaced by a dummy path."""
  text = re.sub(r"\\\n\s*", " ", text)
  lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
  return [
    VARIABLE.sub(lambda m: f"{DUMMY}/{m.group(1)}", c) for c in COMMAND.findall("\n".join(lines))
  ]


def yaml_commands(node) -> list[str]:
  """The ``python -m jaxstep.train …`` commands in any string of a parsed YAML tree."""
  if isinstance(node, dict):
    return [c for v in node.values() for c in yaml_commands(v)]
  if isinstance(node, list):
    return [c for v in node for c in yaml_commands(v)]
  return COMMAND.findall(node) if isinstance(node, str) else []


def jobset_docs() -> list[dict]:
  return list(yaml.safe_load_all((LAUNCH / "jobset.yaml").read_text(encoding="utf-8")))


def all_commands() -> list[tuple[str, str]]:
  found = [(n, c) for n in SHELL_RECIPES for c in shell_commands((LAUNCH / n).read_text())]
  return found + [("jobset.yaml", c) for c in yaml_commands(jobset_docs())]


def check_command(command: str) -> config_lib.Config:
  """Parses ``command``'s arguments like ``jaxstep train`` does and loads the config: an
  unknown flag or config key fails."""
  argv = shlex.split(command)[3:]  # after python -m jaxstep.train
  try:
    args = train_cli.parser().parse_args(argv)
  except SystemExit as e:
    pytest.fail(f"jaxstep train rejects the arguments of {command!r} (exit {e.code})")
  return config_lib.load(args.config, args.overrides)


def test_every_recipe_has_a_train_command():
  found = all_commands()
  assert {name for name, _ in found} == {*SHELL_RECIPES, "jobset.yaml"}, found
  assert len(found) == 3, found


@pytest.mark.parametrize("name, command", all_commands(), ids=lambda x: str(x)[:40])
def test_commands_use_only_existing_flags_and_keys(name, command):
  cfg = check_command(command)
  assert cfg.model.d_model == 2048  # gpt-1.3b
  assert cfg.run_dir.startswith("/shared/"), (name, cfg.run_dir)  # every host sees it
  assert cfg.data.path.startswith("/shared/"), (name, cfg.data.path)


def test_an_unknown_key_or_flag_would_fail():
  with pytest.raises(ConfigError, match="unknown config key 'mesh.fsdpp'"):
    check_command("python -m jaxstep.train --config gpt-1.3b mesh.fsdpp=8")
  with pytest.raises(pytest.fail.Exception):
    check_command("python -m jaxstep.train --config gpt-1.3b --no-such-flag")


def test_no_recipe_sets_jaxstep_process_variables():
  # the launcher's own environment tells jax.distributed the processes (comments may say so)
  for path in [LAUNCH / n for n in (*SHELL_RECIPES, "jobset.yaml")]:
    code = [line.split(" #")[0] for line in path.read_text(encoding="utf-8").splitlines()]
    code = [line for line in code if not line.lstrip().startswith("#")]
    assert not [line for line in code if "JAXSTEP_" in line], path.name


def test_shell_recipes_are_valid_bash():
  for name in SHELL_RECIPES:
    proc = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True)
    assert proc.returncode == 0, (name, proc.stderr)


def test_slurm_recipe_runs_one_task_per_node_with_eight_gpus():
  text = (LAUNCH / "slurm.sbatch").read_text()
  directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
  assert directives["ntasks-per-node"] == "1"
  assert directives["gpus-per-node"] == "8"
  assert re.search(r"^srun .*python -m jaxstep\.train", re.sub(r"\\\n", "", text), re.M)


def test_jobset_manifest_replicates_gpu_pods_over_a_shared_volume():
  docs = {d["kind"]: d for d in jobset_docs()}
  job = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]
  pod = job["template"]["spec"]
  assert job["parallelism"] == job["completions"] > 1
  assert job["completionMode"] == "Indexed"
  container = pod["containers"][0]
  assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
  mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
  volumes = {v["name"]: v for v in pod["volumes"]}
  assert mounts["shared"] == "/shared" and "persistentVolumeClaim" in volumes["shared"]
  assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]


def test_tpu_recipe_runs_on_every_worker():
  text = (LAUNCH / "tpu_pod.sh").read_text()
  assert re.search(r"gcloud compute tpus tpu-vm ssh \S+ .*--worker=all .*--command", text)
