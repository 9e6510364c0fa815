"""Sample prompts that cannot run are refused as a config error before the run dir exists."""

import pytest
from conftest import SMALL_MODEL, make_cfg

from jaxstep import trainer
from jaxstep.cli import train as train_cli
from jaxstep.errors import ConfigError

LONG = "12 + 34 = 46, 56 + 78 = 134"  # 27 bytes: 28 tokens with BOS, over max_seq_len 16
SAMPLING = ("train.sample_every=1", "train.max_steps=2")


def test_an_empty_prompt_list_is_refused_before_anything_is_written(tmp_path):
  cfg = make_cfg(tmp_path, *SAMPLING, "train.sample_prompts=[]")
  with pytest.raises(ConfigError, match=r"train.sample_prompts is empty.*train.sample_every"):
    trainer.train(cfg)
  assert not (tmp_path / "run").exists()


def test_a_prompt_longer_than_the_model_is_named_by_index_and_count(tmp_path):
  cfg = make_cfg(tmp_path, *SAMPLING, f'train.sample_prompts=["the ", "{LONG}"]')
  match = r"train.sample_prompts\[1\] is 28 tokens.*model.max_seq_len 16"
  with pytest.raises(ConfigError, match=match):
    trainer.train(cfg)
  assert not (tmp_path / "run").exists()


def test_the_cli_exits_2_with_one_line_and_no_run_dir(tmp_path, capfd):
  make_cfg(tmp_path)  # writes the corpus
  argv = [
    *SMALL_MODEL,
    *SAMPLING,
    f"data.path={tmp_path / 'corpus.txt'}",
    f"run_dir={tmp_path / 'run'}",
    f'train.sample_prompts=["{LONG}"]',
  ]
  code = train_cli.main(argv)
  err = capfd.readouterr().err
  assert code == 2, err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "train.sample_prompts[0] is 28 tokens" in errors[0], err
  assert "Traceback" not in err
  assert not (tmp_path / "run").exists()
