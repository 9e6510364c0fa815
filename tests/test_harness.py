"""jaxstep as an lm-evaluation-harness model: each request type equals an independent
computation (the log-softmax of the model's logits; the harness's own HF model on the same
folder; ``evaluate`` on the same text), tasks run offline only, and a run scores tasks at
its cadence."""

import json
import os
import pathlib
import sys

import jax
import numpy as np
import pytest
from harness_helpers import llama_folder, local_tasks, per_request

from jaxstep import models
from jaxstep.errors import ConfigError
from jaxstep.lmeval import require_harness, tasks
from jaxstep.lmeval.scoring import width_bucket
from jaxstep.trainer.config import loading
from jaxstep.trainer.saved_run.harness import register, saved_run_model
from jaxstep.trainer.saved_run.load import load_run

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("harness")
  return llama_folder(path / "llama"), local_tasks(path)


def harness_model(path, **options):
  """What ``--model jaxstep --model_args path=…`` builds."""
  return saved_run_model()(path=str(path), **options)


@pytest.fixture(scope="module")
def model(folder):
  return harness_model(folder[0], batch_size=4, max_length=24)


@pytest.fixture(scope="module")
def saved(folder):
  return load_run(folder[0])


@pytest.fixture(scope="module")
def forward(saved):
  """The saved model's forward pass, jitted once: ``forward(params, ids) -> logits``."""
  return jax.jit(models.decoder(saved.cfg.model).apply_fn)


def model_logits(forward, saved, ids, width: int = 24) -> np.ndarray:
  """``[len(ids), V]`` float64 logits of one sequence, run padded to ``width`` (a causal
  model: the padding changes no earlier position), so that one compiled shape serves all."""
  padded = np.zeros((1, width), np.int32)
  padded[0, : len(ids)] = ids
  return np.asarray(forward(saved.params, padded)[0, : len(ids)], np.float64)


def reference_logp(forward, saved, context, continuation, max_length):
  """Σ log softmax of the continuation's ids, from one forward pass of the whole sequence,
  summed in float64 on the host."""
  whole = (list(context) + list(continuation))[-(max_length + 1) :]
  logits = model_logits(forward, saved, whole[:-1])
  shifted = logits - logits.max(-1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  at = np.arange(len(whole) - 1)[-len(continuation) :]
  targets = np.asarray(whole[1:])[-len(continuation) :]
  return logp[at, targets].sum(), bool(np.all(logits[at].argmax(-1) == targets))


def test_a_loglikelihood_is_the_sum_of_its_continuations_log_probs(model, saved, forward):
  rng = np.random.default_rng(0)
  requests = []
  for length, cont in [(3, 1), (9, 4), (30, 2), (1, 1), (17, 7), (5, 3)]:  # 30 + 2 > 24: cut
    ids = rng.integers(3, 300, length + cont).tolist()
    requests.append((None, ids[:length], ids[length:]))
  got = model._loglikelihood_tokens(requests, disable_tqdm=True)
  for (_, context, cont), (logp, greedy) in zip(requests, got, strict=True):
    want, want_greedy = reference_logp(forward, saved, context, cont, 24)
    assert logp == pytest.approx(want, abs=1e-4) and greedy == want_greedy


def test_the_greedy_flag_is_true_for_the_models_own_argmax(model, saved, forward):
  context = [model.jax_tokenizer.BOS, 40, 41, 42]
  ids = list(context)
  for _ in range(3):
    ids.append(int(np.argmax(model_logits(forward, saved, ids)[-1])))
  (logp, greedy), (_, other) = model._loglikelihood_tokens(
    [(None, context, ids[4:]), (None, context, [*ids[4:6], (ids[6] + 1) % 300])], True
  )
  assert greedy and not other and logp < 0


def test_rows_are_scored_alike_in_any_batch_and_width(folder):
  """Rows of 3 to 60 inputs fall in width buckets 32 and 64; each row's answer is the same
  alone in a batch of one."""
  many, one = (harness_model(folder[0], batch_size=b, max_length=64) for b in (4, 1))
  rng = np.random.default_rng(1)
  lengths = (2, 59, 7, 40, 13, 33, 5)
  requests = [
    (None, rng.integers(3, 300, n).tolist(), [int(rng.integers(3, 300))]) for n in lengths
  ]
  batched = many._loglikelihood_tokens(requests, True)
  alone = one._loglikelihood_tokens(requests, True)
  np.testing.assert_allclose([b[0] for b in batched], [a[0] for a in alone], atol=1e-5)
  assert [width_bucket(n, 100) for n in (1, 32, 33, 99, 130)] == [32, 32, 64, 100, 100]


def test_text_starts_with_bos_once_as_the_folders_tokenizer_starts_it(model):
  tok = model.jax_tokenizer
  assert model.tok_encode("one plus two")[0] == tok.BOS
  assert model.tok_encode("<|begin_of_text|>one").count(tok.BOS) == 1  # written in the text
  assert tok.BOS not in model.tok_encode("one", add_special_tokens=False)
  assert model.prefix_token_id == tok.BOS


def test_results_are_flat_metric_names_without_standard_errors():
  results = {"t": {"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": "t", "em,strict": 1.0}}
  assert tasks.flatten(results) == {"harness/t/acc": 0.5, "harness/t/em/strict": 1.0}


def test_a_task_that_would_download_is_one_line_naming_it(tmp_path, model):
  (tmp_path / "hub.yaml").write_text(
    "task: hub_task\ndataset_path: someone/not_on_this_disk\noutput_type: multiple_choice\n"
    "test_split: test\ndoc_to_text: q\ndoc_to_choice: '{{c}}'\ndoc_to_target: 0\n"
  )
  hub = "task hub_task: its data is on the Hugging Face Hub .*--include-path"
  with pytest.raises(ConfigError, match=hub):
    tasks.run_tasks(model, ["hub_task"], include_path=str(tmp_path))


def test_a_task_file_that_is_not_yaml_is_named_with_its_error(tmp_path):
  """The harness skips a task YAML it cannot parse without a word; the task would read as
  unknown (after indexing the harness's own thousands, seconds). Named at once instead."""
  (tmp_path / "ok.yaml").write_text("task: ok_task\ndataset_path: json\n")
  (tmp_path / "mine.yaml").write_text("task: my_task\ndataset_path: json\n  test_split: [t\n")
  with pytest.raises(ConfigError) as raised:
    tasks.task_manager(["my_task"], str(tmp_path))
  message = str(raised.value)
  assert message.startswith(f"task my_task: {tmp_path / 'mine.yaml'} is not a task YAML")
  assert "at line 3, column 13" in message and "\n" not in message
  assert "ok_task" in tasks.task_manager(["ok_task"], str(tmp_path)).task_index  # others run


def test_the_harness_command_indexes_only_the_include_path_that_holds_its_tasks(
  tmp_path, monkeypatch
):
  """lm-eval's command line builds its own ``TaskManager``; inside ``same_index`` of a
  manager that found every task in ``--include-path``, that one indexes the folder alone,
  not the harness's thousands of task files; outside, or for tasks it did not hold, as
  lm-eval builds it."""
  import lm_eval.tasks
  from lm_eval.tasks._index import TaskIndex

  (tmp_path / "ok.yaml").write_text("task: ok_task\ndataset_path: json\n")
  local = tasks.task_manager(["ok_task"], str(tmp_path))
  built, real = [], TaskIndex.build

  def spy(paths, **kw):  # records what is indexed; indexes the folder only (the rest: 7 s)
    built.append([str(p) for p in paths])
    return real([p for p in paths if str(p) == str(tmp_path)], **kw)

  monkeypatch.setattr(TaskIndex, "build", staticmethod(spy))
  for manager in (local, None):
    with tasks.same_index(manager):
      lm_eval.tasks.TaskManager(include_path=str(tmp_path), metadata={"x": 1})
  lm_eval.tasks.TaskManager(include_path=str(tmp_path))
  defaults = str(pathlib.Path(lm_eval.tasks.__file__).parent)
  assert built == [[str(tmp_path)], [defaults, str(tmp_path)], [defaults, str(tmp_path)]]


def test_model_args_win_over_the_harness_settings_they_repeat(folder):
  from jaxstep.lmeval.model import JaxstepLM

  cls = saved_run_model()
  harness_settings = {"batch_size": 1, "device": "cpu"}
  given = cls.create_from_arg_string(f"path={folder[0]},batch_size=6", harness_settings)
  assert given.batch_size == 6 and issubclass(cls, JaxstepLM)
  assert cls.create_from_arg_string(f"path={folder[0]}", {"batch_size": 3}).batch_size == 3


def test_each_batch_of_sampled_generations_draws_anew(model):
  settings = {"until": ["."], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0}
  first, second = (model._generate(["one plus two is"] * 2, dict(settings), None) for _ in range(2))
  assert first != second  # a task's repeats are samples, not copies
  with pytest.raises(ConfigError, match="num_beams: not supported by --model jaxstep"):
    model._generate(["one"], {**settings, "num_beams": 4}, None)


def test_a_continuation_longer_than_a_request_is_one_line(model):
  with pytest.raises(ConfigError, match="continuation is 30 tokens, longer than the 24"):
    model._loglikelihood_tokens([(None, [5], list(range(5, 35)))], True)


def test_a_chat_without_a_generation_prompt_stops_after_its_final_message(model):
  """transformers' ``continue_final_message``, as the harness asks for a task's
  ``gen_prefix``; and without the system turn when the template refuses one."""
  chat = [
    {"role": "user", "content": "one plus two"},
    {"role": "assistant", "content": "The answer:"},
  ]
  open_turn = model.apply_chat_template(chat, add_generation_prompt=False)
  assert open_turn.endswith("The answer:") and open_turn.count("<|eot_id|>") == 1
  strict = harness_model(model.path, max_length=24)
  strict.template = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
    "{% endif %}{{ m['content'] }}{% endfor %}"
  )
  assert (
    strict.apply_chat_template([{"role": "system", "content": "s"}, *chat[:1]]) == "one plus two"
  )


def test_offline_restores_what_it_switched_off(monkeypatch):
  import datasets.config

  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  before = datasets.config.HF_HUB_OFFLINE
  with tasks.offline():
    assert datasets.config.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
  assert datasets.config.HF_HUB_OFFLINE == before and "HF_HUB_OFFLINE" not in os.environ


def test_model_args_that_are_not_options_are_one_line(folder):
  with pytest.raises(ConfigError, match="pretrained: not options of --model jaxstep"):
    harness_model(folder[0], pretrained="gpt2")
  with pytest.raises(ConfigError, match="the model takes 1 to 128 positions"):
    harness_model(folder[0], max_length=4096)


def test_without_the_harness_installed_the_error_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "lm_eval", None)
  with pytest.raises(ConfigError, match=r"pip install 'jaxstep\[eval\]'"):
    require_harness()


def test_harness_tasks_in_a_config_are_a_list_of_names():
  cfg = loading.load(None, ["eval.harness_tasks=[arc_easy, hellaswag]", "eval.harness_every=5"])
  assert cfg.eval.harness_tasks == ("arc_easy", "hellaswag") and cfg.eval.harness_every == 5
  assert loading.load(None, ["eval.harness_tasks=a,b"]).eval.harness_tasks == ("a", "b")
  with pytest.raises(ConfigError, match="eval.harness_every must be >= 0"):
    loading.load(None, ["eval.harness_every=-1"])


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_the_tasks_give_what_the_harness_hf_model_gives(folder, chat):
  """Every request's answer, and the accuracies, as the harness's HF model gives them; with
  ``apply_chat_template`` each request is the folder's chat template rendered."""
  import lm_eval
  from lm_eval.tasks import TaskManager

  path, task_dir = folder
  register()
  names = ["tiny_mc", "tiny_gen"] + ([] if chat else ["tiny_roll"])
  runs = {}
  for name, args in (("hf", f"pretrained={path},dtype=float32"), ("jaxstep", f"path={path}")):
    runs[name] = lm_eval.simple_evaluate(
      model=name, model_args=args, tasks=names, device="cpu", apply_chat_template=chat,
      task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
      batch_size=8, log_samples=True,
    )  # fmt: skip
  hf, ours = (per_request(runs[n]["samples"]) for n in ("hf", "jaxstep"))
  for task in names[:1] + names[2:]:
    want = np.array([[r[0] if isinstance(r, list) else r for r in d] for d in hf[task]], float)
    got = np.array([[r[0] if isinstance(r, list) else r for r in d] for d in ours[task]], float)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert ours["tiny_gen"] == hf["tiny_gen"] and any(d[0] for d in ours["tiny_gen"])
  for metric in ("acc,none", "acc_norm,none"):
    assert runs["jaxstep"]["results"]["tiny_mc"][metric] == runs["hf"]["results"]["tiny_mc"][metric]
  prompts = [d["arguments"] for d in runs["jaxstep"]["samples"]["tiny_gen"]]
  assert chat == all("<|start_header_id|>" in str(p) for p in prompts)


@pytest.mark.slow
def test_a_rolling_loglikelihood_is_evaluate_with_windows_side_by_side(folder, tmp_path, capsys):
  """The harness's disjoint windows of ``max_length`` are ``evaluate``'s plain windows of
  that length for a text of whole windows (a last partial window of the harness's takes a
  whole window of context); ``evaluate`` also scores the text's EOS, the harness not."""
  from jaxstep.cli import evaluate

  path, window = folder[0], 16
  lm = harness_model(path, max_length=window, add_bos_token=False)
  long = " ".join(["one plus two is three", "four plus five is nine"] * 8)
  text = next(
    t for t in (long[:n].strip() for n in range(60, len(long)))
    if len(lm.tok_encode(t)) % window == 0
  )  # fmt: skip
  (tmp_path / "t.txt").write_text(text)
  assert evaluate.main([str(path), "--data", str(tmp_path / "t.txt"), "--seq-len", str(window),
                        "--stride", str(window), "--json"]) == 0  # fmt: skip
  scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

  class Request:
    args = (text,)

  rolling = lm.loglikelihood_rolling([Request()], disable_tqdm=True)[0]
  ids = [lm.jax_tokenizer.BOS, *lm.tok_encode(text)]  # the document: BOS, text, EOS
  eos, _ = lm._loglikelihood_tokens([(None, ids[-1:], [lm.eot_token_id])], True)[0]
  assert scored["tokens"] == len(ids) and scored["windows"] == len(ids) // window + 1
  assert -scored["loss"] * scored["tokens"] == pytest.approx(rolling + eos, abs=1e-3)


@pytest.mark.slow
def test_a_run_scores_its_tasks_at_their_cadence(folder, tmp_path):
  from conftest import SMALL_MODEL

  from jaxstep.cli import train

  task_dir = folder[1]
  run_dir = tmp_path / "run"
  args = ["--config", "tiny", *SMALL_MODEL, "train.max_steps=6", "train.eval_every=0",
          "eval.harness_tasks=[tiny_mc, tiny_gen]", f"eval.harness_include_path={task_dir}",
          "eval.harness_every=3", "eval.harness_limit=8", f"run_dir={run_dir}"]  # fmt: skip
  assert train.main(args) == 0
  lines = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
  harness = [x for x in lines if x["set"] == "harness"]
  assert [x["step"] for x in harness] == [3, 6]
  for record in harness:
    assert 0 <= record["harness/tiny_mc/acc"] <= 1 and "harness/tiny_gen/exact_match" in record


@pytest.mark.slow
def test_a_run_with_a_task_it_cannot_score_stops_before_training(folder, tmp_path, capsys):
  from jaxstep.cli import train

  args = ["--config", "tiny", "eval.harness_tasks=[no_such_task]",
          f"eval.harness_include_path={folder[1]}", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
  assert train.main(args) != 0
  assert "no_such_task: not a task" in capsys.readouterr().err
  assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_the_harness_command_and_evaluate_tasks_print_the_results(folder, tmp_path):
  import subprocess

  path, task_dir = folder
  common = ["--include_path", str(task_dir), "--tasks", "tiny_mc", "--limit", "8"]
  out = subprocess.run(
    [sys.executable, "-m", "jaxstep", "harness", "--model_args", f"path={path}", *common],
    capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  assert "|tiny_mc|" in out.stdout and "acc" in out.stdout
  results = []
  for tensor in ("1", "2"):  # 2: the model split over two devices, the same scores
    out = subprocess.run(
      [sys.executable, "-m", "jaxstep", "evaluate", str(path), "--tasks", "tiny_mc",
       "--include-path", str(task_dir), "--limit", "8", "--json", "--tensor", tensor],
      capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    results.append(json.loads(out.stdout.strip().splitlines()[-1]))
  assert 0 <= results[0]["harness/tiny_mc/acc"] <= 1
  assert results[1]["harness/tiny_mc/acc"] == results[0]["harness/tiny_mc/acc"]


@pytest.mark.slow
def test_four_devices_score_what_one_device_scores(folder, tmp_path):
  import os
  import subprocess

  script = (
    "import sys, json; from jaxstep.trainer.saved_run.harness import saved_run_model; "
    f"m = saved_run_model()(path={str(folder[0])!r}, batch_size=6, max_length=24); "
    "r = [(None, [m.jax_tokenizer.BOS] + list(range(5, 5 + n)), [7, 8]) for n in range(1, 10)]; "
    "print(json.dumps([len(__import__('jax').devices()), m._loglikelihood_tokens(r, True)]))"
  )
  got = {}
  for devices in (1, 4):
    flags = f"--xla_force_host_platform_device_count={devices}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-c", script]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    count, got[devices] = json.loads(out.stdout.strip().splitlines()[-1])
    assert count == devices
  np.testing.assert_allclose([x[0] for x in got[4]], [x[0] for x in got[1]], atol=1e-5)
  assert [x[1] for x in got[4]] == [x[1] for x in got[1]]


@pytest.mark.slow
def test_the_documented_training_hook_reports_the_tasks(folder, model, saved):
  import pathlib
  import re
  import types

  import jaxstep

  doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "evaluation.md").read_text()
  (snippet,) = [s for s in re.findall(r"```python\n(.*?)```", doc, re.S) if "HarnessHook" in s]
  space = {"jaxstep": jaxstep}
  exec(snippet, space)
  hook = space["HarnessHook"](model, ["tiny_mc"], str(folder[1]))
  reported = []
  loop = types.SimpleNamespace(
    step=500,
    state=types.SimpleNamespace(params=saved.params),
    report_eval=lambda *a: reported.append(a),
  )
  hook.on_step(loop)
  ((name, record),) = reported
  assert name == "harness" and record["step"] == 500 and 0 <= record["harness/tiny_mc/acc"] <= 1
