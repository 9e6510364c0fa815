"""``jaxstep generate`` and ``jaxstep evaluate`` on a Hugging Face model folder (and
``--chat`` with its template), checked against transformers on a tiny random Qwen3 saved
locally (nothing is downloaded)."""

import json

import numpy as np
import pytest
from test_hf_folder import tokenizer_files  # noqa: F401 - fixture
from test_pretrained import folder  # noqa: F401 - fixture
from tolerance import assert_close, assert_far

import jaxstep
from jaxstep.cli import run as run_command
from jaxstep.cli.generate import chat_prompt_ids
from jaxstep.generation import Generator
from jaxstep.trainer.saved_run import evaluate as evaluation

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

TEXT = "The cat sat on the mat.\n\nA dog ran in the park, and the cat watched it.\n\n" * 4


def command(capsys, name, *args):
  code = run_command(name, [str(a) for a in args])
  out, err = capsys.readouterr()
  return code, out, err


def one_error_line(code, out, err):
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  return code == 2 and out == "" and len(errors) == 1 and len(err.strip().splitlines()) == 1


def hf_tokenizer(path, monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return transformers.AutoTokenizer.from_pretrained(str(path))


def test_generate_on_a_folder_gives_transformers_greedy_tokens(folder, capsys):  # noqa: F811
  path, model = folder
  args = ["--prompt", "The cat sat", "--prompt", "A dog", "--temperature", 0, "--json"]
  code, out, err = command(capsys, "generate", path, *args, "--max-new-tokens", 8)
  assert code == 0, err
  lines = [json.loads(line) for line in out.splitlines()]
  tok = jaxstep.load_pretrained(path).tokenizer
  assert not tok.has_bos  # Qwen: the prompt is its text's ids alone
  for line in lines:
    prompt = tok.encode(line["prompt"])
    with torch.no_grad():
      expected = model.generate(
        torch.tensor(prompt[None], dtype=torch.long),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=list(tok.stop_ids),
        pad_token_id=tok.PAD,
        suppress_tokens=[tok.PAD],  # jaxstep never samples PAD (BOS here is EOS: a stop)
      )
    assert line["tokens"] == expected[0, len(prompt) :].tolist()
    reply = line["tokens"][:-1] if line["stop_reason"] == "eos" else line["tokens"]
    assert line["text"] == tok.decode(reply)


def test_chat_renders_with_the_template_as_transformers_does(folder, monkeypatch):  # noqa: F811
  path, _ = folder
  saved = jaxstep.load_run(path)
  prompts = ["What is 2 + 2?", "  naïve <b>café</b> "]
  theirs = hf_tokenizer(path, monkeypatch)
  for prompt, ids in zip(prompts, chat_prompt_ids(saved, prompts, path), strict=True):
    chat = [{"role": "user", "content": prompt}]
    expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert ids.tolist() == list(expected)


def room_for_the_system_turn(path):
  """256 positions instead of the fixture's 64 (RoPE: no weight changes): the template's
  system turn alone is about 60 of this tokenizer's ids."""
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))


def force_end_of_turn(path, token_id):
  """The folder edited so that every next token is ``token_id``: the blocks add nothing
  (zero output projections), every embedding and the final norm are ones, and only
  ``token_id``'s row of the head is not zero."""
  room_for_the_system_turn(path)
  tensors = safetensors_numpy.load_file(path / "model.safetensors")
  for name, value in tensors.items():
    if name.endswith(("o_proj.weight", "down_proj.weight")):
      tensors[name] = np.zeros_like(value)
  tensors["model.embed_tokens.weight"][:] = 1.0
  tensors["model.norm.weight"][:] = 1.0
  tensors["lm_head.weight"][:] = 0.0
  tensors["lm_head.weight"][token_id] = 1.0
  safetensors_numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.slow
def test_chat_generates_from_the_rendered_ids_and_stops_at_end_of_turn(
  folder,  # noqa: F811
  monkeypatch,
  capsys,
):
  path, _ = folder
  tok = jaxstep.load_pretrained(path).tokenizer
  end = tok.stop_ids[0]
  assert tok.decode([end]) in ("", "<|im_end|>")  # decode may drop the special token
  force_end_of_turn(path, end)
  used = []
  original = Generator.generate_ids

  def recording(self, prompts, **kwargs):
    used.extend(np.asarray(p).tolist() for p in prompts)
    return original(self, prompts, **kwargs)

  monkeypatch.setattr(Generator, "generate_ids", recording)
  prompt = "What is 2 + 2?"
  code, out, err = command(capsys, "generate", path, "--chat", "--prompt", prompt, "--json")
  assert code == 0, err
  (line,) = [json.loads(x) for x in out.splitlines()]
  assert line == {"prompt": prompt, "text": "", "tokens": [end], "stop_reason": "eos"}
  chat = [{"role": "user", "content": prompt}]
  expected = hf_tokenizer(path, monkeypatch).apply_chat_template(
    chat, add_generation_prompt=True, tokenize=True
  )
  expected = expected if isinstance(expected, list) else expected["input_ids"]
  assert used == [list(expected)]  # the template's ids, no BOS added
  code, out, err = command(capsys, "generate", path, "--chat", "--prompt", prompt)
  assert code == 0 and out == "--- sample 1 (model folder, stop: eos)\n\n", err  # reply only


def test_evaluate_on_a_folder_is_transformers_mean_nll_on_the_same_windows(
  folder,  # noqa: F811
  tmp_path,
  capsys,
):
  path, model = folder
  text = tmp_path / "held_out.txt"
  text.write_text(TEXT)
  code, out, err = command(capsys, "evaluate", path, "--data", text, "--json")
  assert code == 0, err
  got = json.loads(out)
  saved = jaxstep.load_run(path)
  assert saved.model_folder and saved.step == got["step"] == 0
  assert saved.cfg.train.seq_len == 64  # the default 128, cut to the model's 64 positions
  dataset = evaluation.load_data(saved, path, str(text), "file")  # one text file: one text
  rows = dataset.train.rows(np.arange(len(dataset.train)), len(dataset.train), dataset.pad_id)
  assert got["windows"] == len(dataset.train) > 1
  with torch.no_grad():
    logits = model(torch.tensor(np.asarray(rows["inputs"]), dtype=torch.long)).logits
    nll = torch.nn.functional.cross_entropy(
      logits.transpose(1, 2), torch.tensor(np.asarray(rows["targets"]), dtype=torch.long),
      reduction="none",
    ).numpy()  # fmt: skip
  mask = np.asarray(rows["loss_mask"], bool)
  assert got["tokens"] == mask.sum()
  # per-token NLLs (the longest sum: the softmax over the folder's vocabulary of 320) summed
  # over the windows' tokens
  terms = saved.cfg.model.vocab_size * int(mask.sum())
  assert_close(got["loss"], nll[mask].mean(), terms=terms)
  # the margin: the sum divided by the windows instead of the tokens is far outside it
  assert_far(got["loss"] * got["tokens"] / got["windows"], nll[mask].mean(), terms=terms)
  code, out, err = command(capsys, "evaluate", path, "--data", text)
  assert code == 0, err
  assert out.startswith(f"model folder on {text} (format file, windows of 64 tokens, stride 64)")


def test_bad_paths_and_options_are_one_error_line_exit_2(folder, tmp_path, capsys):  # noqa: F811
  path, _ = folder
  empty = tmp_path / "empty"
  empty.mkdir()
  for name, extra in (("generate", []), ("evaluate", ["--data", "bundled:text"])):
    code, out, err = command(capsys, name, empty, *extra)
    assert one_error_line(code, out, err) and "neither config.yaml" in err, err
    code, out, err = command(capsys, name, path, "--step", 3, *extra)
    assert one_error_line(code, out, err) and "drop --step" in err, err
  (path / "chat_template.jinja").unlink()
  code, out, err = command(capsys, "generate", path, "--chat", "--prompt", "hi")
  assert one_error_line(code, out, err) and "no chat template" in err, err
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
  for name, extra in (("generate", []), ("evaluate", ["--data", "bundled:text"])):
    code, out, err = command(capsys, name, path, *extra)
    assert one_error_line(code, out, err) and "GPT2LMHeadModel" in err, err


@pytest.mark.slow
def test_chat_works_on_a_run_trained_from_a_folder(folder, tmp_path, capsys):  # noqa: F811
  path, _ = folder
  room_for_the_system_turn(path)
  text = tmp_path / "corpus.txt"
  text.write_text(TEXT * 4)
  code, _, err = command(
    capsys,
    "train",
    f"model.init_from={path}",
    f"data.path={text}",
    f"run_dir={tmp_path / 'run'}",
    "train.max_steps=1",
    "train.global_batch_size=2",
    "train.grad_accum_steps=1",
    "train.seq_len=32",
    "train.eval_every=0",
    "train.sample_every=0",
    "mesh.cpu_devices=1",
  )
  assert code == 0, err
  saved = jaxstep.load_run(tmp_path / "run")
  assert saved.chat_template == (path / "chat_template.jinja").read_text()
  args = ["--chat", "--prompt", "What is 2 + 2?", "--temperature", 0, "--max-new-tokens", 2]
  code, out, err = command(capsys, "generate", tmp_path / "run", *args, "--json")
  assert code == 0, err
  (line,) = [json.loads(x) for x in out.splitlines()]
  ids = chat_prompt_ids(saved, ["What is 2 + 2?"], tmp_path / "run")
  gen = Generator(saved.cfg.model, saved.params, saved.tokenizer)
  expected, _ = gen.generate_ids(ids, max_new_tokens=2, temperature=0.0)
  assert line["tokens"] == expected[0]
