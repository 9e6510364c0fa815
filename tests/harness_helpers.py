"""A tiny random Llama folder and local lm-evaluation-harness tasks over it: a 20-item
multiple-choice task, a generate_until task and a loglikelihood_rolling task, each reading
a JSONL file written here (no download anywhere)."""

from __future__ import annotations

import json
import random

WORDS = "zero one two three four five six seven eight nine".split()
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|endoftext|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip


def llama_folder(path):
  """A tiny random Llama (vocabulary 320, 128 positions) whose byte-level BPE tokenizer
  starts every text with BOS, with Llama 3's chat template."""
  import torch
  import transformers
  from test_hf_folder import LLAMA3_TEMPLATE
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=320,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator([" ".join(WORDS) + " plus is the answer"] * 8, trainer=trainer)
  ids = {t: tok.token_to_id(t) for t in SPECIALS}
  bos = ("<|begin_of_text|>", ids["<|begin_of_text|>"])
  tok.post_processor = processors.TemplateProcessing(
    single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[bos]
  )
  cfg = transformers.LlamaConfig(
    vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
    pad_token_id=ids["<|endoftext|>"],
  )  # fmt: skip
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  model.eval().save_pretrained(path)
  tok.save(str(path / "tokenizer.json"))
  specials = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2]}
  config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  (path / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
  return path


def local_tasks(path, items: int = 20):
  """``path/tasks``: ``tiny_mc`` (four choices), ``tiny_gen`` (until "."), ``tiny_roll``
  (a whole text's log-likelihood), all over ``path/items.jsonl``."""
  rng = random.Random(0)
  rows = []
  for _ in range(items):
    a, b = rng.randrange(5), rng.randrange(5)
    choices = [WORDS[(a + b + k) % 10] for k in range(4)]
    rng.shuffle(choices)
    answer = choices.index(WORDS[a + b])
    question = f"{WORDS[a]} plus {WORDS[b]} is"
    rows.append({"question": question, "choices": choices, "answer": answer})
  (path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  tasks = path / "tasks"
  tasks.mkdir()
  data = (
    f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path / 'items.jsonl'}\n"
    "test_split: test\n"
  )
  (tasks / "mc.yaml").write_text(
    f"task: tiny_mc\n{data}output_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
    "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
    "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
  )
  (tasks / "gen.yaml").write_text(
    f"task: tiny_gen\n{data}output_type: generate_until\ndoc_to_text: '{{{{question}}}}'\n"
    "doc_to_target: '{{choices[answer]}}'\n"
    "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 6\n  do_sample: false\n"
    "metric_list:\n  - metric: exact_match\n"
  )
  (tasks / "roll.yaml").write_text(
    f"task: tiny_roll\n{data}output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
    "doc_to_target: \"{{question}} {{choices|join(' ')}}\"\n"
    "metric_list:\n  - metric: word_perplexity\n"
  )
  return tasks


def per_request(samples: dict) -> dict:
  """``simple_evaluate(log_samples=True)["samples"]`` → ``{task: [each document's raw
  responses]}``: log-likelihoods (floats) or generated texts."""
  out = {}
  for task, docs in samples.items():
    out[task] = [[r[0] if isinstance(r, list | tuple) else r for r in d["resps"]] for d in docs]
  return out
