"""``train.profile_steps``: a jax.profiler trace of chosen update steps in run_dir/profile."""

import logging

import pytest
from conftest import make_cfg

from jaxstep import ConfigError
from jaxstep.trainer.config.schema import parse_profile_steps as parse_steps


def test_profile_steps_parse_or_name_the_key():
  assert parse_steps("") is None and parse_steps("2:5") == (2, 5) and parse_steps("3:3") == (3, 3)
  for bad in ("5", "0:2", "4:2", "a:b", "2:"):
    with pytest.raises(ConfigError, match="train.profile_steps must be 'A:B'"):
      parse_steps(bad)


@pytest.mark.slow
def test_a_run_writes_a_trace_of_the_chosen_steps(tmp_path, caplog):
  from jaxstep import trainer

  cfg = make_cfg(tmp_path, "train.max_steps=4", "train.profile_steps=2:3", "train.eval_every=0")
  with caplog.at_level(logging.INFO, logger="jaxstep"):
    trainer.train(cfg)
  profile = tmp_path / "run" / "profile"
  for pattern in ("*.xplane.pb", "*.trace.json.gz"):  # TensorBoard's and Perfetto's
    traces = list(profile.rglob(pattern))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
  assert "profile of update steps 2-3 written to" in caplog.text


@pytest.mark.slow
def test_a_run_shorter_than_the_profile_closes_its_trace(tmp_path):
  from jaxstep import trainer

  trainer.train(make_cfg(tmp_path, "train.max_steps=2", "train.profile_steps=2:9"))
  assert list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
  # a second trace in the same process works: the first one was stopped
  trainer.train(make_cfg(tmp_path / "b", "train.max_steps=1", "train.profile_steps=1:1"))
  assert list((tmp_path / "b" / "run" / "profile").rglob("*.xplane.pb"))


@pytest.mark.slow
def test_no_profile_by_default(tmp_path):
  from jaxstep import trainer

  trainer.train(make_cfg(tmp_path, "train.max_steps=1"))
  assert not (tmp_path / "run" / "profile").exists()
