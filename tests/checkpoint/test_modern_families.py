"""Default targets of the model families people fine-tune now, on checkpoints transformers itself builds and saves.

Each family: a tiny random model from its real config class, written by ``save_pretrained`` (real tensor names and
layouts: per-expert tensors, Granite's 3-D expert stacks, multimodal wrappers), then scanned with defaults. Oracle:
the model's own modules, by walking ``model.named_modules()``: every nn.Linear in its numbered layers (routers and
the modules each family leaves out on purpose aside, named below) and each expert of its fused expert parameters.
Every chosen module must be one of those matrices (values and [d_out, d_in] shape), and each of them chosen once;
B and k of one module per family must match PLATE computed by definition in dense float64 numpy; config.json dims
contradicting the weights are refused, naming the tensor."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from oracles import dense_oracle, matrix_key, with_random_bf16_weights

import plate_inspect
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.cli.main import cli
from plate_inspect.errors import CheckpointError, CorruptCheckpointError
from plate_inspect.targets import load_target, select_targets

transformers = pytest.importorskip("transformers")

R, TAU, MAX_RANK = 4, 0.9, 16
#: Small dims, in the config keys most families share.
BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
            vocab_size=64, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip
NO_HEAD_DIM = {k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads")}
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
#: config.json dims of each causal-LM family (transformers' own keys): MoE families with dense first layers get 3.
CAUSAL = {
    "qwen3_next": {**BASE, **MOE, "num_experts": 4, "shared_expert_intermediate_size": 24, "num_hidden_layers": 4,
                   "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4},
    "glm": BASE,
    "glm4": BASE,
    "glm4_moe": {**BASE, **MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                 "num_hidden_layers": 3},
    "granite": BASE,
    "granitemoe": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "granitemoeshared": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 24},
    "granitemoehybrid": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 24,
                         "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 16,
                         "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_chunk_size": 16},
    "olmoe": {**BASE, "num_experts": 4, "num_experts_per_tok": 2},
    "phi": {k: v for k, v in BASE.items() if k != "head_dim"},
    "phimoe": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "smollm3": BASE,
    "cohere": BASE,
    "cohere2": BASE,
    "starcoder2": BASE,
    "gpt_neox": NO_HEAD_DIM,
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64),
    "ernie4_5": BASE,
    "ernie4_5_moe": {**BASE, **MOE, "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1,
                     "moe_layer_start_index": 1, "moe_layer_interval": 1, "num_hidden_layers": 3},
    "hunyuan_v1_dense": BASE,
    "hunyuan_v1_moe": {**BASE, "num_experts": 4, "moe_topk": 2, "num_shared_expert": 1},
    "seed_oss": BASE,
    "apertus": BASE,
    "exaone4": BASE,
    "dots1": {**BASE, **MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
              "num_hidden_layers": 3},
    "minimax": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "minimax_m2": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "olmo3": BASE,
    "ministral": BASE,
    "nemotron": BASE,
    "arcee": BASE,
    "deepseek_v32": {**BASE, **MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                     "v_head_dim": 8, "index_head_dim": 8, "index_n_heads": 2, "num_hidden_layers": 3},
    "glm4_moe_lite": {**BASE, **MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                      "num_hidden_layers": 3},
    "lfm2": {**BASE, "num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
             "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.5, "block_auto_adjust_ff_dim": True},
    "jamba": {**BASE, "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
              "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
              "mamba_d_state": 8, "mamba_expand": 2, "mamba_dt_rank": 4, "use_mamba_kernels": False},
    "falcon_h1": {**BASE, "mamba_d_ssm": 48, "mamba_n_heads": 4, "mamba_d_head": 12, "mamba_d_state": 8,
                  "mamba_n_groups": 1, "mamba_chunk_size": 16},
    "flex_olmo": {**BASE, "num_experts": 4, "num_experts_per_tok": 2},
    "gemma3n_text": {**BASE, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 0, "laurel_rank": 4,
                     "activation_sparsity_pattern": [0.0, 0.0], "altup_num_inputs": 2, "vocab_size_per_layer_input": 64,
                     "layer_types": ["sliding_attention", "full_attention"]},
}  # fmt: skip
#: Vision-language wrappers (their text_config gets BASE, their vision tower a one-layer tower).
WRAPPERS = {
    "mistral3": {},
    "llava": {},
    "qwen2_vl": {},
    "qwen2_5_vl": {},
    "qwen3_vl": {},
    "idefics3": {},
    "glm4v": {},
    "glm4v_moe": {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1},
}
FAMILIES = (*CAUSAL, *WRAPPERS)
#: Linear modules of the layers a family leaves out on purpose (not projections a fine-tune adapts): Gemma-3n's
#: AltUp predictions/corrections, LAuReL's low-rank residual and per-layer-input projections; DeepSeek-V3.2's
#: lightning indexer (a scorer of which tokens attention reads); MoE routers.
LEFT_OUT = {"gemma3n_text": re.compile(r"\.(altup|laurel)\.|per_layer_"), "deepseek_v32": re.compile(r"\.indexer\.")}
ROUTER = re.compile(r"(^|\.)(gate|router|shared_expert_gate|wg|modality_router)$|router\.layer$")
_VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2,
               embed_dim=16, image_size=16, patch_size=8, out_hidden_size=32, head_dim=8)  # fmt: skip


def tiny_model(family: str) -> torch.nn.Module:
    """transformers' tiny ``family`` model from its own config class, random bf16 weights (seeded)."""
    if family in CAUSAL:
        config = transformers.AutoConfig.for_model(family, **CAUSAL[family])
        build = transformers.AutoModelForCausalLM.from_config
    else:
        config = transformers.AutoConfig.for_model(family)
        for key, value in {**BASE, **WRAPPERS[family]}.items():
            setattr(config.text_config, key, value)
        for key, value in _VISION.items():
            if hasattr(config.vision_config, key):
                setattr(config.vision_config, key, value)
        if hasattr(config.vision_config, "deepstack_visual_indexes"):
            config.vision_config.deepstack_visual_indexes = [0]
        build = transformers.AutoModelForImageTextToText.from_config
    return with_random_bf16_weights(build(config))


def model_matrices(model: torch.nn.Module, family: str) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """Oracle: the [d_out, d_in] matrices a fine-tune adapts, from the model's modules: every nn.Linear inside a
    numbered layer of an nn.ModuleList (a multimodal model's language model only), routers and LEFT_OUT aside; and
    each expert of a fused expert module (3-D gate_up_proj [E, 2 x inter, hidden] and down_proj, as its forward
    multiplies them), which a checkpoint may store whole or with gate and up as separate tensors (its two halves)."""
    modules = dict(model.named_modules())
    stacks = [n for n, m in modules.items() if isinstance(m, torch.nn.ModuleList)]
    text_only = getattr(model.config, "text_config", None) is not None
    skip = LEFT_OUT.get(family)
    linear: dict[str, torch.Tensor] = {}
    experts: list[tuple] = []  # (gate_up, down) per expert
    for name, module in modules.items():
        if not any(re.match(rf"{re.escape(s)}\.\d+\.", name) for s in stacks) or ROUTER.search(name):
            continue
        if text_only and not re.search(r"(language|text)_model\.", name) or (skip and skip.search(name)):
            continue
        if isinstance(module, torch.nn.Linear):
            linear[name] = module.weight.detach()
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
            assert gate_up.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2]  # [E, 2 x inter, hidden]: out-major
            experts += [(gate_up[e], down[e]) for e in range(gate_up.shape[0])]
    return linear, experts


def check_against_the_model(model, family, targets, ckpt) -> dict[str, torch.Tensor]:
    """Each chosen module is one of the model's matrices (values and shape), each matrix is chosen once; nn.Linear
    modules keep the names they are saved under. Returns the chosen weights by name."""
    linear, experts = model_matrices(model, family)
    assert linear or experts
    read = {}
    for t in targets:
        w, _ = load_target(ckpt, t)
        assert tuple(w.shape) == t.shape
        read[t.name] = w
    by_value: dict[tuple, list[str]] = {}
    for name, w in read.items():
        by_value.setdefault(matrix_key(w), []).append(name)
    assert all(len(names) == 1 for names in by_value.values()), "two modules read the same matrix"
    found = {matrix_key(w) for w in read.values()}
    for name, w in linear.items():  # under its own name, unless save_pretrained renamed it (Mistral-3's wrapper)
        assert (
            by_value.get(matrix_key(w)) == [name]
            if f"{name}.weight" in ckpt.tensors
            else len(by_value[matrix_key(w)]) == 1
        )
    halves = []
    for gate_up, down in experts:
        inter = down.shape[1]
        assert matrix_key(down) in found
        split = (gate_up[:inter], gate_up[inter:])
        assert matrix_key(gate_up) in found or all(matrix_key(h) in found for h in split), (
            "an expert's gate/up not chosen"
        )
        halves += [matrix_key(gate_up), *map(matrix_key, split), matrix_key(down)]
    assert found <= {matrix_key(w) for w in linear.values()} | set(halves), "a chosen module the model does not adapt"
    return read


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_are_the_models_own_projections(saved_tiny_model, family):
    model, path = saved_tiny_model(family)
    ckpt = Checkpoint.open(path)
    targets, note = select_targets(ckpt)
    assert note.startswith(f"defaults for model_type '{family}'"), note
    check_against_the_model(model, family, targets, ckpt)


#: One module per family compared with PLATE by definition (an expert where the family has them).
SAMPLE = {
    "qwen3_next": "model.layers.0.linear_attn.in_proj_qkvz",
    "glm4_moe": "model.layers.1.mlp.experts.2.down_proj",
    "granitemoehybrid": "model.layers.1.block_sparse_moe.input_linear.3",
    "phi": "model.layers.1.mlp.fc1",
    "falcon": "transformer.h.0.self_attention.query_key_value",
    "minimax": "model.layers.1.self_attn.qkv_proj",
    "glm4v": "model.language_model.layers.1.mlp.gate_up_proj",
    "lfm2": "model.layers.0.conv.in_proj",
    "jamba": "model.layers.1.feed_forward.experts.2.up_proj",
}


@pytest.mark.parametrize("family", sorted(SAMPLE))
def test_scan_with_defaults_matches_the_dense_oracle(saved_tiny_model, family, tmp_path):
    """``plate-inspect scan`` with defaults on the saved model: exactly the default modules, and B, k of a sample
    module equal to PLATE by definition on the model's own weight (float64)."""
    model, path = saved_tiny_model(family)
    result = CliRunner().invoke(cli, ["scan", str(path), "--out", str(tmp_path / "b"), "--r", str(R),
                                      "--max-rank", str(MAX_RANK), "--tau", str(TAU), "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    bundle = plate_inspect.Bundle.load(tmp_path / "b")
    targets, _ = select_targets(Checkpoint.open(path))
    assert set(bundle.modules) == {t.name for t in targets}
    name = SAMPLE[family]
    w = check_against_the_model(model, family, targets, Checkpoint.open(path))[name].double().numpy()
    _, b, _, k, _ = dense_oracle(w, R, TAU, MAX_RANK)
    assert bundle.record(name).shape == list(w.shape)
    assert bundle.b_idx(name).tolist() == b.tolist() and bundle.record(name).k == k


def T(tensor: str) -> str:
    """The refusal naming a tensor (a regex) whose shape contradicts config.json."""
    return f"tensor '[^']*{tensor}' has \\[d_out, d_in\\] = .* but config.json implies"


@pytest.mark.parametrize(
    ("family", "override", "tensor"),
    [
        ("qwen3_next", {"linear_num_value_heads": 2}, T(r"linear_attn\.in_proj_ba\.weight")),
        ("qwen3_next", {"moe_intermediate_size": 8}, T(r"mlp\.experts\.0\.(gate|up|down)_proj\.weight")),
        ("glm4_moe", {"n_shared_experts": 2}, T(r"mlp\.shared_experts\.(gate|up|down)_proj\.weight")),
        ("granitemoehybrid", {"mamba_d_state": 4}, T(r"mamba\.in_proj\.weight")),
        ("granitemoe", {"intermediate_size": 40}, T(r"block_sparse_moe\.input_linear\.weight")),
        ("phi", {"intermediate_size": 40}, T(r"mlp\.fc1\.weight")),
        ("falcon", {"multi_query": False}, T(r"self_attention\.query_key_value\.weight")),
        ("gpt_neox", {"intermediate_size": 40}, T(r"mlp\.dense_(h_to_4h|4h_to_h)\.weight")),
        (
            "minimax",
            {"num_local_experts": 3},
            r"layer 0: block_sparse_moe\.experts\.w1 has experts 0-3 but config\.json says num_local_experts = 3",
        ),
        ("ernie4_5_moe", {"moe_intermediate_size": 8}, T(r"mlp\.experts\.0\.(gate|up|down)_proj\.weight")),
        ("hunyuan_v1_moe", {"intermediate_size": 40}, T(r"mlp\.experts\.0\.(gate|up|down)_proj\.weight")),
        ("glm4", {"intermediate_size": 40}, T(r"mlp\.(gate_up|down)_proj\.weight")),
        ("starcoder2", {"intermediate_size": 40}, T(r"mlp\.c_(fc|proj)\.weight")),
        ("lfm2", {"block_multiple_of": 32}, T(r"feed_forward\.w[123]\.weight")),
        ("jamba", {"mamba_dt_rank": 8}, T(r"mamba\.(x|dt)_proj\.weight")),
        ("falcon_h1", {"mamba_n_groups": 2}, T(r"mamba\.in_proj\.weight")),
    ],
)
def test_config_dims_checked_against_the_weights(saved_tiny_model, tmp_path, family, override, tensor):
    """The same saved weights under a config.json that says other dims (or another expert count): refused, naming a
    tensor that contradicts it."""
    _, path = saved_tiny_model(family)
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **override}))
    with pytest.raises(CheckpointError, match=tensor):
        select_targets(Checkpoint.open(tmp_path))


@pytest.mark.parametrize(
    ("family", "override", "layer"),
    [
        ("glm4_moe", {"first_k_dense_replace": 2}, 1),
        ("glm4_moe_lite", {"first_k_dense_replace": 2}, 1),
        ("ernie4_5_moe", {"moe_layer_start_index": 0}, 0),
        ("jamba", {"expert_layer_offset": 0}, 0),
    ],
)
def test_dense_first_layers_checked_against_the_config(saved_tiny_model, tmp_path, family, override, layer):
    """GLM-4.5 / ERNIE-4.5-MoE: which layers are dense is config.json's; weights that say otherwise are refused."""
    _, path = saved_tiny_model(family)
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **override}))
    with pytest.raises(CorruptCheckpointError, match=f"^layer {layer}: "):
        select_targets(Checkpoint.open(tmp_path))


def test_unknown_wrapper_uses_its_language_models_defaults(saved_tiny_model, tmp_path):
    """A vision-language wrapper not in the table whose text_config names a known family (LLaVA-style): that
    family's defaults and shape checks, on the language model only (its vision tower's q_proj left out)."""
    model, path = saved_tiny_model("llava")
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "my_llava"}))
    targets, note = select_targets(Checkpoint.open(tmp_path))
    assert note.startswith("defaults for model_type 'my_llava' (its language model's, 'llama')"), note
    check_against_the_model(model, "llava", targets, Checkpoint.open(tmp_path))
    broken = {**config, "model_type": "my_llava", "text_config": {**config["text_config"], "intermediate_size": 40}}
    (tmp_path / "config.json").write_text(json.dumps(broken))
    with pytest.raises(CheckpointError, match="mlp.(gate|up|down)_proj.weight' has"):
        select_targets(Checkpoint.open(tmp_path))


def test_bundle_keeps_3d_granite_experts_apart(saved_tiny_model, tmp_path):
    """Granite MoE's experts (one 3-D tensor per projection) become one module per expert, each its own slice."""
    model, path = saved_tiny_model("granitemoe")
    targets, _ = select_targets(Checkpoint.open(path))
    experts = [t for t in targets if "block_sparse_moe" in t.name]
    assert {t.expert for t in experts} == set(range(4))
    assert {t.module_type for t in experts} == {"block_sparse_moe.input_linear", "block_sparse_moe.output_linear"}
    assert all(t.layout == "experts_out_major" for t in experts)
    stack = model.model.layers[1].block_sparse_moe.experts.gate_up_proj.detach()
    t = next(t for t in experts if t.name == "model.layers.1.block_sparse_moe.input_linear.2")
    assert torch.equal(load_target(Checkpoint.open(path), t)[0], stack[2])


def test_unknown_model_type_says_what_to_pass(saved_tiny_model, tmp_path):
    """A model_type the table does not know: the fallback's note says that no shape check ran, which 3-D expert
    stacks it left out, and to choose with --target-modules; naming the stacks then scans each expert."""
    _, path = saved_tiny_model("granitemoe")
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "granite-next"}))
    ckpt = Checkpoint.open(tmp_path)
    targets, note = select_targets(ckpt)
    assert note.startswith("unknown model_type 'granite-next': every 2-D weight in the numbered layers"), note
    assert "4 3-D expert stacks left out (e.g. model.layers.0.block_sparse_moe.input_linear)" in note
    assert note.endswith("(no shape checks against config.json; choose modules with --target-modules)")
    assert not any("input_linear" in t.name for t in targets)
    chosen, _ = select_targets(ckpt, "input_linear")
    assert len(chosen) == 2 * 4 and {t.expert for t in chosen} == set(range(4))


def test_glm45_mtp_layer_only_when_asked(saved_tiny_model, tmp_path):
    """GLM-4.5 ships a multi-token-prediction layer (index num_hidden_layers, DeepSeek-V3's layout: a decoder layer
    plus eh_proj [hidden, 2 x hidden]), which transformers does not build: skipped by default, scanned with
    include_mtp, eh_proj's shape checked. The layer is planted from layer 2's tensors (a MoE layer)."""
    from safetensors.torch import load_file, save_file

    _, path = saved_tiny_model("glm4_moe")
    tensors = load_file(str(path / "model.safetensors"))
    layer2 = {k: v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in layer2.items()}
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(32, 64, dtype=torch.bfloat16)
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["num_nextn_predict_layers"] == 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    default, note = select_targets(Checkpoint.open(tmp_path))
    assert {t.layer for t in default} == {0, 1, 2} and "multi-token-prediction layer 3 skipped" in note
    with_mtp, _ = select_targets(Checkpoint.open(tmp_path), include_mtp=True)
    added = {t.name for t in with_mtp} - {t.name for t in default}
    assert "model.layers.3.eh_proj" in added and all(".layers.3." in n for n in added)
    assert len(added) == len([t for t in default if t.layer == 2]) + 1
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(32, 32, dtype=torch.bfloat16)
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=T(r"model\.layers\.3\.eh_proj\.weight")):
        select_targets(Checkpoint.open(tmp_path), include_mtp=True)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_release_config_without_text_config(saved_tiny_model, tmp_path, family):
    """Qwen2-VL / Qwen2.5-VL as released: config.json flat (the language model's dims at the top, no text_config)
    and the weights under model.layers / visual.blocks (transformers 5 writes that layout too). The same modules as
    with text_config (the vision tower's blocks and merger left out), its dims checked."""
    model, path = saved_tiny_model(family)
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    flat = {**{k: v for k, v in config.items() if k != "text_config"}, **config["text_config"]}
    flat["model_type"] = family
    (tmp_path / "config.json").write_text(json.dumps(flat))
    ckpt = Checkpoint.open(tmp_path)
    assert any(n.startswith("visual.blocks.") for n in ckpt.tensors)
    targets, note = select_targets(ckpt)
    assert note.startswith(f"defaults for model_type '{family}'"), note
    check_against_the_model(model, family, targets, ckpt)
    (tmp_path / "config.json").write_text(json.dumps({**flat, "intermediate_size": 40}))
    with pytest.raises(CheckpointError, match=T(r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight")):
        select_targets(Checkpoint.open(tmp_path))
