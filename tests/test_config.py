"""Config: defaults, YAML, dotted overrides, type errors, typo suggestions, base.yaml sync."""

import dataclasses
import re

import pytest
import yaml

from jaxstep import ConfigError
from jaxstep.trainer.config import loading as config_lib


def test_bundled_default_is_tiny():
  cfg = config_lib.load()
  assert cfg.run_dir == "runs/tiny" and cfg.train.max_steps == 300
  assert config_lib.load("tiny") == cfg


def test_overrides_are_coerced_to_field_types():
  cfg = config_lib.load(
    None,
    [
      "train.global_batch_size=64",
      "optim.lr=3e-4",
      "model.tie_embeddings=false",
      "run_dir=runs/x",
      "data.eval_fraction=0",
    ],
  )
  assert cfg.train.global_batch_size == 64 and cfg.optim.lr == 3e-4
  assert cfg.model.tie_embeddings is False and cfg.run_dir == "runs/x"
  assert cfg.data.eval_fraction == 0.0


def test_unknown_key_names_the_closest_valid_one():
  with pytest.raises(ConfigError, match=r"'train.global_bath_size'.*'train.global_batch_size'"):
    config_lib.load(None, ["train.global_bath_size=8"])


def test_unknown_key_in_yaml_file(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("optim:\n  learning_rate: 0.1\n")
  with pytest.raises(ConfigError, match=r"'optim.learning_rate'.*did you mean"):
    config_lib.load(path)


@pytest.mark.parametrize(
  "text, key, lines",
  [
    ("eval:\n  sets:\n    web: a.txt\n    web: b.txt\n", "'web'", "3 and 4"),
    ("optim:\n  lr: 0.1\ntrain:\n  max_steps: 3\noptim:\n  b2: 0.9\n", "'optim'", "1 and 5"),
  ],
)
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, text, key, lines):
  path = tmp_path / "c.yaml"
  path.write_text(text)
  with pytest.raises(ConfigError, match=f"{path}: key {key} is given twice .*lines {lines}"):
    config_lib.load(path)


def test_a_merge_may_override_the_keys_it_brings(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("base: &b {lr: 0.1, b2: 0.9}\noptim:\n  <<: *b\n  lr: 0.2\n")
  tree = config_lib.read_yaml(path.read_text(), str(path))
  assert tree["optim"] == {"lr": 0.2, "b2": 0.9}


def test_an_override_given_twice_warns_once_and_the_last_wins(caplog):
  cfg = config_lib.load(None, ["optim.lr=0.1", "train.max_steps=3", "optim.lr=0.2"])
  assert cfg.optim.lr == 0.2
  twice = [r.getMessage() for r in caplog.records if "twice" in r.getMessage()]
  assert twice == [
    "optim.lr is given twice on the command line: optim.lr=0.2 wins over optim.lr=0.1"
  ]


@pytest.mark.parametrize(
  "override, expected",
  [
    ("train.global_batch_size=abc", "expected int, got 'abc'"),
    ("optim.lr=fast", "expected float"),
    ("model.tie_embeddings=maybe", "expected bool"),
    ("train.max_steps=1.5", "expected int"),
  ],
)
def test_wrong_type_names_key_value_and_type(override, expected):
  with pytest.raises(ConfigError, match=f"'{override.split('=')[0]}': {expected}"):
    config_lib.load(None, [override])


def test_non_divisible_batch_is_rejected_before_any_work():
  with pytest.raises(ConfigError, match="32 is not divisible by train.grad_accum_steps 5"):
    config_lib.load(None, ["train.grad_accum_steps=5"])
  with pytest.raises(ConfigError, match="grad_accum_steps must be a positive integer, got 0"):
    config_lib.load(None, ["train.grad_accum_steps=0"])


@pytest.mark.parametrize("override", ["novalue", "=3"])
def test_malformed_override(override):
  with pytest.raises(ConfigError, match="key=value"):
    config_lib.load(None, [override])


def test_missing_config_file_lists_bundled_names():
  with pytest.raises(ConfigError, match="does not exist.*tiny"):
    config_lib.load("nope.yaml")


def test_base_yaml_lists_every_key_with_its_default():
  base = yaml.safe_load((config_lib.CONFIG_DIR / "base.yaml").read_text())
  defaults = config_lib.to_dict(config_lib.Config())

  def flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
      nested = isinstance(v, dict) and v  # an empty mapping (eval.sets) is a value
      out.update(flatten(v, f"{prefix}{k}.") if nested else {f"{prefix}{k}": v})
    return out

  assert flatten(base) == flatten(defaults)
  text = (config_lib.CONFIG_DIR / "base.yaml").read_text()
  llama_only = set(config_lib.model_keys("llama")) - set(config_lib.model_keys("gpt"))
  assert all(f"#   {key}: " in text for key in llama_only)
  assert sorted([*flatten(base), *(f"model.{k}" for k in llama_only)]) == sorted(
    config_lib.valid_keys()
  )


def test_every_schema_field_is_commented_in_base_yaml():
  lines = (config_lib.CONFIG_DIR / "base.yaml").read_text().splitlines()
  leaf_lines = [
    line
    for line in lines
    if ":" in line and not line.rstrip().endswith(":") and not line.lstrip().startswith("#")
  ]
  assert all("  # " in line for line in leaf_lines)


@pytest.mark.parametrize("name", ["tiny", "small", "sft-chat", "gpt2-124m", "gpt-350m", "gpt-1.3b"])
def test_bundled_configs_load(name):
  cfg = config_lib.load(name)
  assert dataclasses.is_dataclass(cfg)


def test_dump_round_trips(tmp_path):
  cfg = config_lib.load(None, ["optim.lr=0.01"])
  path = tmp_path / "resolved.yaml"
  path.write_text(config_lib.dump(cfg))
  assert config_lib.load(path) == cfg


def test_cli_docs_list_every_config_key_and_flag():
  import pathlib

  doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
  assert (config_lib.CONFIG_DIR / "base.yaml").read_text() in doc  # verbatim, defaults too
  for flag in ("--config", "--debug", "--help", "key=value", "--resume-from", "--no-resume"):
    assert flag in doc


def test_a_partial_section_keeps_the_schemas_defaults():
  cfg = config_lib.load(None, ["model.d_model=64"])
  assert cfg.model.vocab_size == 0  # the schema's default (follow the tokenizer), not GPTConfig's
  assert cfg.model.n_layers == config_lib.Config().model.n_layers


@pytest.mark.parametrize(
  "override, message",
  [
    ("train.seed=-1", "train.seed must be in [0, 2**63), got -1"),
    (f"train.seed={2**63}", "train.seed must be in [0, 2**63)"),
    ("mesh.cpu_devices=100000", "mesh.cpu_devices must be at most 1024"),
    ("run_dir=runs/$JAXSTEP_UNSET_VARIABLE/x", "names the environment variable $JAXSTEP_UNSET"),
    ("data.path=${JAXSTEP_UNSET_VARIABLE}", "data.path '${JAXSTEP_UNSET_VARIABLE}' names"),
  ],
)
def test_values_out_of_reach_are_named(override, message, monkeypatch):
  monkeypatch.delenv("JAXSTEP_UNSET_VARIABLE", raising=False)
  with pytest.raises(ConfigError, match=re.escape(message)):
    config_lib.load(None, [override])


@pytest.mark.parametrize(
  "yaml_text, key",
  [
    ("optim:\n  groups: [{match: ln, lr_scale: .nan}]\n", "optim.groups[0].lr_scale"),
    ("optim:\n  groups: [{match: ln, weight_decay: -.inf}]\n", "optim.groups[0].weight_decay"),
    ("optim:\n  groups: [{match: ln, lr_scale: nan}]\n", "optim.groups[0].lr_scale"),  # a str
    ("rl:\n  reward_weights: [1.0, .inf]\n", "rl.reward_weights[1]"),
    ("data:\n  sources: [{name: a, path: b, weight: .nan}]\n", "data.sources[0].weight"),
  ],
  ids=["lr_scale", "weight_decay", "lr_scale_str", "reward_weights", "sources"],
)
def test_a_non_finite_number_inside_a_list_or_mapping_is_refused_naming_it(
  tmp_path, yaml_text, key
):
  """Every number of the config, however deep in a key's lists and mappings, is finite: a
  NaN ``lr_scale`` would otherwise train its group's leaves to NaN and exit 0."""
  path = tmp_path / "run.yaml"
  path.write_text(yaml_text)
  with pytest.raises(ConfigError, match=re.escape(key) + r"'? must be a finite number"):
    config_lib.load(path)


def test_an_error_line_quoting_a_huge_value_is_capped(tmp_path, capsys):
  from jaxstep.cli import train as train_cli

  path = tmp_path / "bomb.yaml"
  levels = ["&a [x, x, x, x, x, x, x, x, x, x]"] + [
    f"&{c} [{', '.join([f'*{p}'] * 10)}]" for p, c in zip("abcde", "bcdef", strict=True)
  ]
  path.write_text(f"train:\n  seed: [{', '.join(levels)}]\n")  # a million x's once expanded
  with pytest.raises(ConfigError, match="train.seed': expected int") as raised:
    config_lib.load(path)
  assert len(str(raised.value)) < 300  # the value is quoted, not expanded
  assert train_cli.main(["--config", str(path)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and len(err) < 1200, len(err)


def test_a_missing_init_from_folder_is_named_before_the_tokenizer_it_also_is(tmp_path):
  """A run trained from a folder records it as model.init_from and as data.tokenizer: when
  it is moved, the error names model.init_from (the key the user set), for a new run and
  for a run's own config.yaml alike."""
  gone = tmp_path / "moved-away"
  with pytest.raises(ConfigError, match=f"model.init_from {gone} is not a folder"):
    config_lib.load(None, [f"model.init_from={gone}", f"data.tokenizer={gone}"])
  saved = tmp_path / "config.yaml"
  saved.write_text(f"model:\n  init_from: {gone}\ndata:\n  tokenizer: {gone}\n")
  with pytest.raises(ConfigError, match="model.init_from .* is not a folder"):
    config_lib.load(saved)


@pytest.mark.parametrize(
  "given, depth",
  [
    (["model.lora.rank=4"], (True, "block")),
    (["optim.trainable=lora_"], (True, "block")),
    (["model.lora.rank=4", "model.remat=none"], (True, "none")),
    (["model.lora.rank=4", "model.scan_layers=false"], (False, "block")),
    ([], (False, "none")),  # full fine-tuning keeps the plain defaults
  ],
)
def test_a_folder_under_a_frozen_base_gets_scanned_blocks_with_remat(tmp_path, given, depth):
  """``model.init_from`` with LoRA or ``optim.trainable``: ``scan_layers`` true and ``remat``
  block unless the config names them."""
  cfg = config_lib.load(None, [f"model.init_from={tmp_path}", *given])
  assert (cfg.model.scan_layers, cfg.model.remat) == depth


def test_a_config_files_depth_settings_win_and_no_folder_keeps_the_defaults(tmp_path):
  file = tmp_path / "run.yaml"
  file.write_text(f"model:\n  init_from: {tmp_path}\n  remat: dots\n  lora: {{rank: 2}}\n")
  model = config_lib.load(file).model
  assert (model.scan_layers, model.remat) == (True, "dots")
  assert config_lib.load(None, ["model.lora.rank=4"]).model.remat == "none"  # no folder
