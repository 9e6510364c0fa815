"""Hugging Face mixture-of-experts folders in and out: Qwen3-MoE, Mixtral, OLMoE and
Qwen2-MoE, tiny random models saved locally by transformers (nothing is downloaded).

Each case is checked against transformers itself: the imported model's logits, the fused
expert layout (``gate_up_proj``) read into the same params as the per-expert one, an export
that transformers loads with the same logits, greedy decoding over the key/value cache
token for token, and the parity report. The config cases cover ``norm_topk_prob`` true and
false, a dense layer by ``decoder_sparse_step`` and one by ``mlp_only_layers``, Qwen2-MoE's
gated shared expert and q/k/v biases, Qwen3-MoE's per-head and OLMoE's whole-projection
q/k norms."""

import json
import shutil
import types

import jax
import numpy as np
import pytest
from conftest import TINY_HF_SHAPE
from tolerance import assert_close, assert_far

from jaxstep import Generator, models
from jaxstep.errors import ConfigError
from jaxstep.models import LlamaConfig, hf_config, hf_export, hf_moe, hf_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = {**TINY_HF_SHAPE, "num_experts_per_tok": 2}
V = SHAPE["vocab_size"]
IDS = np.random.default_rng(0).integers(0, V, size=(3, 12))
# the longest sum on the way to the logits: a dense MLP's down projection, once per layer
TERMS = SHAPE["intermediate_size"] * SHAPE["num_hidden_layers"]
# case -> (transformers config class, its settings beyond SHAPE)
CASES = {
  "qwen3_moe": (
    "Qwen3MoeConfig",
    {"num_experts": 4, "moe_intermediate_size": 24, "head_dim": 12, "norm_topk_prob": True},
  ),
  "qwen3_moe_sparse_step": (  # layer 0 dense (decoder_sparse_step 2), layer 1 MoE
    "Qwen3MoeConfig",
    {"num_experts": 4, "moe_intermediate_size": 24, "decoder_sparse_step": 2},
  ),
  "mixtral": ("MixtralConfig", {"num_local_experts": 4}),
  "olmoe": ("OlmoeConfig", {"num_experts": 4, "norm_topk_prob": True, "eos_token_id": 1}),
  "qwen2_moe": (  # layer 0 MoE with the gated shared expert, layer 1 dense (mlp_only_layers)
    "Qwen2MoeConfig",
    {
      "num_experts": 4,
      "moe_intermediate_size": 24,
      "shared_expert_intermediate_size": 40,
      "mlp_only_layers": [1],
    },
  ),
}


def save_tiny_moe(folder, case: str):
  """A random model of ``case`` saved with ``save_pretrained`` (fp32, every weight drawn,
  norms and biases included); returns the torch model in eval mode."""
  name, extra = CASES[case]
  cfg = getattr(transformers, name)(**SHAPE, **extra)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.2)
  model = model.float().eval()
  model.save_pretrained(folder)
  return model


def some_slow(fast: str) -> list:
  """Every case, the ones other than ``fast`` in the slow tier only (the fast tier keeps one
  case of each check that compiles a program of its own)."""
  return [c if c == fast else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``saved(case)``: ``(case, folder, torch model)``, each case saved once per module."""
  made = {}

  def get(case: str):
    if case not in made:
      path = tmp_path_factory.mktemp(case)
      made[case] = case, path, save_tiny_moe(path, case)
    return made[case]

  return get


@pytest.fixture(params=sorted(CASES))
def folder(request, saved):
  """Every case."""
  return saved(request.param)


def imported(folder, **options):
  """``(LlamaConfig, params as jax arrays)`` of a folder, read as ``load_pretrained`` does."""
  cfg = hf_config.model_config(hf_config.read_config(folder), attention="xla", **options)
  return cfg, jax.device_put(hf_weights.read_params(folder, cfg))


def our_logits(folder, ids=IDS, **options) -> np.ndarray:
  cfg, params = imported(folder, **options)
  apply_fn, _ = models.build(cfg, 0, abstract=True)
  return np.asarray(jax.jit(apply_fn)(params, ids))


def their_logits(model, ids=IDS) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.numpy()


def loaded(folder):
  """The folder loaded by transformers, after checking every tensor matched a parameter."""
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
    folder, attn_implementation="eager", output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  return model.float().eval()


def tensors(folder) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  return load_file(folder / hf_weights.SINGLE)


def write_fused(src, out):
  """``src`` with each MoE layer's per-expert tensors stacked into the layout transformers
  5 keeps in memory: ``mlp.experts.gate_up_proj`` ``[E, 2f, d]`` (each expert's gate rows,
  then its up rows), ``mlp.experts.down_proj`` ``[E, d, f]``, the router as ``mlp.gate``
  (Mixtral's ``block_sparse_moe``, ``w1``/``w3``/``w2``, renamed as its loader does)."""
  from safetensors.numpy import save_file

  shutil.copytree(src, out)
  old, new = tensors(src), {}
  stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
  for name, array in old.items():
    name = name.replace(".block_sparse_moe.", ".mlp.")
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
      new[name] = array
      continue
    expert, kind, _ = tail.split(".")
    kind = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(kind, kind)
    stacks.setdefault((head, kind), {})[int(expert)] = array
  for head in sorted({h for h, _ in stacks}):
    gate, up, down = (
      np.stack([a for _, a in sorted(stacks[(head, kind)].items())])
      for kind in ("gate_proj", "up_proj", "down_proj")
    )
    new[f"{head}.mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
    new[f"{head}.mlp.experts.down_proj"] = down
  save_file(new, out / hf_weights.SINGLE, metadata={"format": "pt"})
  return out


def export(src, out, *, base=True):
  hf = hf_config.read_config(src)
  cfg, params = imported(src)
  return hf_export.save_pretrained(
    out,
    cfg,
    params,
    architecture=hf["architectures"][0],
    base_config=hf if base else None,
  )


def test_logits_equal_transformers(folder):
  _, path, model = folder
  ours, theirs = our_logits(path), their_logits(model)
  assert_close(ours, theirs, terms=TERMS)
  assert np.abs(ours - theirs).max() <= 1e-5


@pytest.mark.parametrize("case", [c for c in some_slow("qwen3_moe") if c != "mixtral"])
def test_a_flipped_norm_topk_would_be_caught(saved, case):
  """The comparison above catches a router that renormalizes when the folder says not to
  (or the other way round): the experts' weights change by a fraction, not a rounding.
  (Mixtral always renormalizes: there is no setting to flip.)"""
  case, path, model = saved(case)
  cfg, _ = imported(path)
  assert_far(our_logits(path, norm_topk=not cfg.norm_topk), their_logits(model), terms=TERMS)


def test_the_config_reads_the_families_settings(folder):
  case, path, _ = folder
  cfg = hf_config.model_config(hf_config.read_config(path))
  common = {"num_experts": 4, "experts_per_token": 2, "router_scores": "softmax"}
  expected = {
    "qwen3_moe": dict(
      qk_norm=True, qk_norm_scope="head", head_dim=12, norm_topk=True, expert_size=24,
      moe_layers=(True, True), router_aux_loss=0.001,
    ),
    "qwen3_moe_sparse_step": dict(
      moe_every=2, norm_topk=False, moe_layers=(False, True), intermediate_size=48,
    ),
    "mixtral": dict(
      qk_norm=False, norm_topk=True, expert_size=48, moe_layers=(True, True), rope_theta=1e6,
    ),
    "olmoe": dict(
      qk_norm=True, qk_norm_scope="projection", norm_topk=True, expert_size=48,
      router_aux_loss=0.01,
    ),
    "qwen2_moe": dict(
      attention_bias=True, shared_width=40, shared_expert_gate=True, norm_topk=False,
      dense_layers=(1,), moe_layers=(True, False), expert_size=24,
    ),
  }[case]  # fmt: skip
  assert {k: getattr(cfg, k) for k in {**common, **expected}} == {**common, **expected}


def test_the_fused_expert_layout_reads_the_same_params(folder, tmp_path):
  """A folder whose experts are stacked as transformers 5 holds them (``gate_up_proj``,
  gate rows first) reads into the per-expert folder's params bit for bit, with every tensor
  used and a fingerprint hashed from the read equal to the files' own. transformers loads
  that folder with the same logits: the stacking above is the layout it reads."""
  _, path, model = folder
  fused = write_fused(path, tmp_path / "fused")
  assert any(n.endswith("experts.gate_up_proj") for n in tensors(fused))
  cfg = hf_config.model_config(hf_config.read_config(path))
  digest = hf_weights.FingerprintDigest()
  got = hf_weights.read_params(fused, cfg, digest=digest)
  want = hf_weights.read_params(path, cfg)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  assert hf_weights.unused_tensors(fused, cfg) == []
  assert digest.value == hf_weights.fingerprint(fused) != hf_weights.fingerprint(path)
  np.testing.assert_array_equal(their_logits(loaded(fused)), their_logits(model))


def test_a_fused_gate_up_read_the_wrong_way_round_would_be_caught(folder, tmp_path):
  """The check above tells gate from up: a file with each expert's halves swapped reads
  into other params (each leaf is a different draw)."""
  _, path, _ = folder
  fused = write_fused(path, tmp_path / "fused")
  swapped = dict(tensors(fused))
  for name in [n for n in swapped if n.endswith("gate_up_proj")]:
    gate, up = np.split(swapped[name], 2, axis=1)
    swapped[name] = np.concatenate([up, gate], axis=1)
  from safetensors.numpy import save_file

  save_file(swapped, fused / hf_weights.SINGLE, metadata={"format": "pt"})
  cfg = hf_config.model_config(hf_config.read_config(path))
  got, want = hf_weights.read_params(fused, cfg), hf_weights.read_params(path, cfg)
  layer = cfg.moe_layers.index(True)
  mine, theirs = got["blocks"][layer]["mlp"]["experts"], want["blocks"][layer]["mlp"]["experts"]
  np.testing.assert_array_equal(mine["gate_proj"], theirs["up_proj"])
  assert not np.array_equal(mine["gate_proj"], theirs["gate_proj"])


def test_an_export_loads_in_transformers_with_the_same_logits(folder, tmp_path):
  """Import → export (the folder's config.json as the base, and one built from the model
  alone) → transformers: the same tensor names and shapes as the folder, every tensor
  matched to a parameter, transformers' own logits on the original."""
  case, path, model = folder
  reference = their_logits(model)
  names = {n: a.shape for n, a in tensors(path).items()}
  for base in (True, False):
    out = export(path, tmp_path / f"base-{base}", base=base)
    assert {n: a.shape for n, a in tensors(out).items()} == names
    np.testing.assert_array_equal(their_logits(loaded(out)), reference)
    hf = json.loads((out / hf_config.CONFIG).read_text())
    assert hf_config.model_config(hf) == hf_config.model_config(hf_config.read_config(path))
    assert hf["router_aux_loss_coef"] == hf_config.read_config(path)["router_aux_loss_coef"]


def test_scanned_moe_params_export_the_same_tensors(saved):
  """Params stacked by ``model.scan_layers`` (``[L, E, …]`` expert leaves) give each
  expert's tensor of each layer as the per-block tree does."""
  from jaxstep.models import layers

  _, path, _ = saved("qwen3_moe")
  cfg = hf_config.model_config(hf_config.read_config(path))
  params = hf_weights.read_params(path, cfg)
  stacked = jax.jit(layers.convert_layout, static_argnums=1)(params, True)
  arch = "Qwen3MoeForCausalLM"
  flat, scanned = hf_export.tensors_of(cfg, params, arch), hf_export.tensors_of(cfg, stacked, arch)
  assert [t.name for t in flat] == [t.name for t in scanned]
  assert "model.layers.1.mlp.experts.3.up_proj.weight" in {t.name for t in flat}
  for a, b in zip(flat, scanned, strict=True):
    np.testing.assert_array_equal(np.asarray(a.fetch()), np.asarray(b.fetch()))


def test_an_export_writes_the_routers_settings_and_the_users_loss_weight(tmp_path):
  """A model built here (no base folder) exports as the MoE architecture its settings
  name, with norm_topk_prob, the expert counts and the run's load-balancing weight."""
  cfg = LlamaConfig(
    vocab_size=32, d_model=16, n_layers=2, n_heads=2, intermediate_size=24, qk_norm=True,
    num_experts=4, experts_per_token=2, moe_intermediate_size=8, norm_topk=False,
    router_aux_loss=0.05, dense_layers=(0,),
  )  # fmt: skip
  _, params = models.build(cfg, 0)
  from jaxstep.trainer.saved_run.export import architecture_of

  arch = architecture_of(cfg, None)
  assert arch == "Qwen3MoeForCausalLM"
  out = hf_export.save_pretrained(tmp_path / "m", cfg, params, architecture=arch)
  hf = json.loads((out / hf_config.CONFIG).read_text())
  assert {k: hf[k] for k in ("norm_topk_prob", "router_aux_loss_coef", "mlp_only_layers")} == {
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.05,
    "mlp_only_layers": [0],
  }
  assert hf["num_experts"] == hf["num_local_experts"] == 4 and hf["moe_intermediate_size"] == 8
  names = tensors(out)
  assert names["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (16, 8)
  assert "model.layers.0.mlp.gate_proj.weight" in names
  back = hf_weights.read_params(out, hf_config.model_config(hf))
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", some_slow("qwen2_moe"))
def test_greedy_decoding_gives_transformers_generate_tokens(saved, case):
  _, path, model = saved(case)
  cfg, params = imported(path)
  tokenizer = types.SimpleNamespace(vocab_size=V, PAD=0, BOS=0, EOS=1)
  prompts = [np.array([5, 17, 3, 40, 2]), np.array([9, 60]), np.array([33, 7, 21])]
  ids, _ = Generator(cfg, params, tokenizer).generate_ids(
    prompts, max_new_tokens=12, temperature=0.0
  )
  for prompt, got in zip(prompts, ids, strict=True):
    with torch.no_grad():
      out = model.generate(
        torch.tensor(prompt[None]),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=1,
        pad_token_id=0,
        suppress_tokens=[0],  # jaxstep never samples PAD or BOS
      )
    assert got == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", some_slow("qwen3_moe_sparse_step"))
def test_the_parity_report_passes_and_names_a_broken_moe_block(saved, case, monkeypatch):
  """Every stage passes, the MoE blocks included; two experts of the first MoE block read
  into each other's places (a conversion bug on jaxstep's side) fail first at that block."""
  from jaxstep.models import hf_parity

  _, path, _ = saved(case)
  report = hf_parity.parity_report(path)
  assert report.passed, report
  layer = hf_config.model_config(hf_config.read_config(path)).moe_layers.index(True)
  read = hf_parity.read_model

  def swapped_experts(folder, seq_len):
    config, params = read(folder, seq_len)
    experts = params["blocks"][layer]["mlp"]["experts"]
    experts["down_proj"] = experts["down_proj"][[1, 0, 2, 3]]
    return config, params

  monkeypatch.setattr(hf_parity, "read_model", swapped_experts)
  report = hf_parity.parity_report(path)
  assert report.first_divergence == f"block {layer}", report


def hf_dict(case: str, **changes) -> dict:
  """The ``config.json`` dict of ``case`` as transformers writes it, with ``changes``."""
  name, extra = CASES[case]
  hf = getattr(transformers, name)(**SHAPE, **extra).to_dict()
  return {**hf, "architectures": [name.replace("Config", "ForCausalLM")], **changes}


@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe"])
def test_both_expert_count_keys_are_read(case):
  hf = hf_dict(case)
  count = hf.pop("num_local_experts", None) or hf.pop("num_experts")
  for key in hf_moe.EXPERT_KEYS:
    assert hf_config.model_config({**hf, key: count}).num_experts == count
  with pytest.raises(ConfigError, match="num_local_experts 4 and num_experts 5 disagree"):
    hf_config.model_config({**hf, "num_local_experts": 4, "num_experts": 5})


@pytest.mark.parametrize(
  ("case", "changes", "message"),
  [
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported for OlmoeForCausalLM"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=true is not supported for Qwen3Moe"),
    ("olmoe", {"attention_bias": True}, "attention_bias=true is not supported for Olmoe"),
    ("olmoe", {"head_dim": 16}, "needs head_dim × num_attention_heads = hidden_size"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
  ],
)
def test_what_the_model_does_not_compute_is_refused_by_name(case, changes, message):
  with pytest.raises(ConfigError, match=message):
    hf_config.model_config(hf_dict(case, **changes))


def test_mixtrals_rope_theta_defaults_to_its_classs():
  hf = {k: v for k, v in hf_dict("mixtral").items() if k not in ("rope_parameters", "rope_theta")}
  assert hf_config.model_config(hf).rope_theta == 1e6
  assert hf_config.model_config({**hf, "rope_theta": 5e5}).rope_theta == 5e5


def test_the_load_balancing_weight_is_the_folders_unless_the_user_sets_one():
  hf = hf_dict("olmoe", router_aux_loss_coef=0.02)
  assert hf_config.model_config(hf).router_aux_loss == 0.02
  assert hf_config.model_config(hf, router_aux_loss=0.0).router_aux_loss == 0.0
  assert hf_config.model_config(hf).router_z_loss == 0.0  # OLMoE has no z-loss coefficient
  assert hf_config.model_config({**hf, "router_z_loss_coef": 0.003}).router_z_loss == 0.003


def test_a_run_from_a_folder_keeps_the_routers_weights_it_sets(tmp_path):
  """``model.init_from``: the folder's coefficient unless the config sets another value;
  a mixture of experts' training settings (capacity, matmul) stay the config's."""
  from jaxstep.trainer.config import loading
  from jaxstep.trainer.plan import init_from

  (tmp_path / "m").mkdir()
  hf = hf_dict("qwen3_moe", router_aux_loss_coef=0.002)
  (tmp_path / "m" / hf_config.CONFIG).write_text(json.dumps(hf))

  def resolved(*overrides):
    given = [f"model.init_from={tmp_path / 'm'}", "train.seq_len=32", *overrides]
    cfg = loading.load(None, given)
    return init_from.resolve(cfg).model

  assert resolved().router_aux_loss == 0.002
  mine = resolved("model.router_aux_loss=0.03", "model.capacity_factor=1.5")
  assert (mine.router_aux_loss, mine.capacity_factor, mine.num_experts) == (0.03, 1.5, 4)


@pytest.mark.parametrize(
  ("architecture", "change", "message"),
  [
    ("MixtralForCausalLM", {"norm_topk": False}, "norm_topk=false"),
    ("MixtralForCausalLM", {"moe_intermediate_size": 8}, "experts 8 wide"),
    ("Qwen2MoeForCausalLM", {}, "a gated shared expert missing"),
    ("OlmoeForCausalLM", {}, "q/k norms none"),
    ("Qwen3ForCausalLM", {}, "cannot hold this model's experts"),
    ("Qwen3MoeForCausalLM", {"router_scores": "sigmoid", "qk_norm": True}, "softmax only"),
  ],
)
def test_an_architecture_that_cannot_hold_the_model_is_refused(architecture, change, message):
  base = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=2, intermediate_size=24)
  cfg = LlamaConfig(**base, num_experts=4, **change)
  with pytest.raises(ConfigError, match=message):
    hf_export.check_architecture(cfg, architecture)
