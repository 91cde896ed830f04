"""Target selection: family defaults, overrides, layers, fallback, and shape checks against config.json."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from plate_inspect.checkpoint import Checkpoint
from plate_inspect.errors import CheckpointError, ConfigError, UnsupportedWeightError
from plate_inspect.targets import layer_of, module_type_of, parse_layers, select_targets


def write(tmp_path, tensors, config):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if config is not None:  # None: no config.json at all
        (tmp_path / "config.json").write_text(json.dumps(config))
    return Checkpoint.open(tmp_path)


def phi3(tmp_path, qkv_rows=3 * 32):
    h, i = 32, 80
    t = {
        "model.embed_tokens.weight": torch.zeros(10, h),
        "model.layers.0.self_attn.qkv_proj.weight": torch.zeros(qkv_rows, h),
        "model.layers.0.self_attn.o_proj.weight": torch.zeros(h, h),
        "model.layers.0.mlp.gate_up_proj.weight": torch.zeros(2 * i, h),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(h, i),
        "model.layers.0.input_layernorm.weight": torch.zeros(h),
        "lm_head.weight": torch.zeros(10, h),
    }
    config = {"model_type": "phi3", "hidden_size": h, "intermediate_size": i, "num_attention_heads": 4}
    return write(tmp_path, t, config)


def test_phi3_fused_defaults(tmp_path):
    targets, note = select_targets(phi3(tmp_path))
    assert [t.module_type for t in targets] == [
        "mlp.down_proj",
        "mlp.gate_up_proj",
        "self_attn.o_proj",
        "self_attn.qkv_proj",
    ]
    assert "phi3" in note
    assert {t.name: t.shape for t in targets}["model.layers.0.mlp.gate_up_proj"] == (160, 32)


def test_phi3_fused_shape_checked_against_config(tmp_path):
    with pytest.raises(CheckpointError, match="qkv_proj"):
        select_targets(phi3(tmp_path, qkv_rows=2 * 32))


def test_lm_head_and_embeddings_only_when_asked(tmp_path):
    ckpt = phi3(tmp_path)
    assert all("lm_head" not in t.name for t in select_targets(ckpt)[0])
    asked, _ = select_targets(ckpt, ["lm_head"])
    assert [t.name for t in asked] == ["lm_head"]


def test_regex_and_layer_selection(tmp_path):
    t = {f"blocks.{i}.{m}.weight": torch.zeros(8, 8) for i in range(4) for m in ("attn.wq", "attn.wk", "ffn.w1")}
    ckpt = write(tmp_path, t, {"model_type": "mystery"})
    chosen, _ = select_targets(ckpt, [r"attn\.w[qk]"], layers=[1, 3])
    assert [x.name for x in chosen] == ["blocks.1.attn.wk", "blocks.1.attn.wq", "blocks.3.attn.wk", "blocks.3.attn.wq"]


def test_unknown_model_type_falls_back_and_says_so(tmp_path):
    t = {
        "enc.0.mix.weight": torch.zeros(8, 8),
        "enc.0.norm.weight": torch.zeros(8, 8),
        "embed.weight": torch.zeros(8, 8),
        "enc.0.bias_vec": torch.zeros(8),
    }
    chosen, note = select_targets(write(tmp_path, t, {"model_type": "mystery"}))
    assert [x.name for x in chosen] == ["enc.0.mix"]
    assert "unknown model_type 'mystery'" in note
    for config, why in (({"architectures": ["X"]}, "no model_type in config.json"), (None, "no config.json beside")):
        where = tmp_path / why.replace(" ", "-")
        where.mkdir()
        _, note = select_targets(write(where, t, config))
        assert note.startswith(why), note


def test_unknown_model_type_keeps_to_the_numbered_layers(tmp_path):
    """QA: the fallback targeted DistilBERT's MLM head `vocab_transform` (a layer-less 2-D weight) as a module.
    Oracle: the nn.Linear modules transformers builds inside DistilBERT's numbered transformer blocks. Without any
    numbered layer, every 2-D weight is still a candidate."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=48, vocab_size=64)
    model = transformers.DistilBertForMaskedLM(config)
    model.save_pretrained(tmp_path / "distilbert")
    want = {
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("distilbert.transformer.layer.")
    }
    assert len(want) == 12 and "vocab_transform" in dict(model.named_modules())
    config_path = tmp_path / "distilbert" / "config.json"  # distilbert has defaults of its own: as an unknown family
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "model_type": "my-distilbert"}))
    chosen, note = select_targets(Checkpoint.open(tmp_path / "distilbert"))
    assert {t.name for t in chosen} == want and "in the numbered layers" in note
    flat = write(tmp_path, {"fc1.weight": torch.zeros(8, 4), "fc2.weight": torch.zeros(4, 8)}, {"model_type": "x"})
    assert [t.name for t in select_targets(flat)[0]] == ["fc1", "fc2"]


def test_packed_gptq_weights_are_unsupported(tmp_path):
    t = {
        "model.layers.0.self_attn.q_proj.qweight": torch.zeros(8, 32, dtype=torch.int32),
        "model.layers.0.self_attn.q_proj.scales": torch.zeros(1, 32),
    }
    with pytest.raises(UnsupportedWeightError, match="q_proj.qweight"):
        select_targets(write(tmp_path, t, {"model_type": "llama"}))


def test_parse_layers_and_names():
    assert parse_layers("0-2,7") == [0, 1, 2, 7]
    assert parse_layers(None) is None
    with pytest.raises(ConfigError):
        parse_layers("a-b")
    assert module_type_of("model.layers.12.mlp.up_proj") == "mlp.up_proj"
    assert layer_of("h.3.attn.c_attn") == 3 and layer_of("fc1") is None


# --------------------------------------------------------------------------- which layers are MoE, per config.json
def _with_config(path, text_config=False, **changes):
    """Rewrite the checkpoint's config.json with ``changes`` (in text_config for multimodal wrappers); reopen it."""
    config = json.loads((path / "config.json").read_text())
    (config["text_config"] if text_config else config).update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return Checkpoint.open(path)


def _experts_by_layer(path) -> dict[int, bool]:
    """Oracle: whether each decoder layer (DeepSeek's multi-token-prediction layer left out, as a scan leaves it)
    holds routed experts, from the tensor names safetensors lists."""
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    n_layers = config.get("text_config", config)["num_hidden_layers"]
    out: dict[int, bool] = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                parts = name.split(".")
                if "layers" in parts and "vision_model" not in parts:
                    layer = int(parts[parts.index("layers") + 1])
                    out[layer] = out.get(layer, False) or ".experts." in name
    return {layer: moe for layer, moe in out.items() if layer < n_layers}


@pytest.mark.parametrize(
    ("family", "written", "contradiction", "match"),
    [
        # Qwen-MoE: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
        (
            "qwen2_moe",
            {},
            {"mlp_only_layers": []},
            r"layer 0: config.json makes it a mixture-of-experts layer \(mlp_only_layers = \[\] does not list it, "
            r"and decoder_sparse_step = 1\), but the checkpoint holds a dense feed-forward "
            r"\('model.layers.0.mlp.down_proj.weight'\)",
        ),
        (
            "qwen2_moe",
            {},
            {"mlp_only_layers": [0, 1]},
            r"layer 1: model.safetensors holds routed experts there "
            r"\('model.layers.1.mlp.experts.0.down_proj.weight'\), but config.json makes layer 1 a dense layer "
            r"\(mlp_only_layers = \[0, 1\] lists it\)",
        ),
        (
            "qwen3_moe",
            {"mlp_only_layers": [0], "decoder_sparse_step": 2},
            {"decoder_sparse_step": 3},
            r"layer 1: .*holds routed experts there .*a dense layer \(decoder_sparse_step = 3: MoE layers are those "
            r"with \(index \+ 1\) % 3 == 0\)",
        ),
        (
            "qwen3_moe",
            {},
            {"decoder_sparse_step": 2},
            r"layer 0: .*holds routed experts there .*a dense layer "
            r"\(decoder_sparse_step = 2: MoE layers are those with \(index \+ 1\) % 2 == 0\)",
        ),
        # DeepSeek: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0
        (
            "deepseek_v3",
            {},
            {"first_k_dense_replace": 2},
            r"layer 1: .*holds routed experts there .*a dense layer "
            r"\(first_k_dense_replace = 2: layers 0-1 are dense\)",
        ),
        (
            "deepseek_v3",
            {},
            {"first_k_dense_replace": 0},
            r"layer 0: config.json makes it a mixture-of-experts layer "
            r"\(first_k_dense_replace = 0, moe_layer_freq = 1\), but the checkpoint holds a dense feed-forward",
        ),
        (
            "deepseek_v2",
            {},
            {"moe_layer_freq": 2},
            r"layer 1: .*a dense layer \(moe_layer_freq = 2: MoE layers are "
            r"those with index % 2 == 0\)",
        ),
        # Llama-4: layer i is MoE iff i in moe_layers (default: (i + 1) % interleave_moe_layer_step == 0)
        (
            "llama4",
            {},
            {"interleave_moe_layer_step": 1},
            r"layer 0: config.json makes it a mixture-of-experts layer "
            r"\(interleave_moe_layer_step = 1\), but the checkpoint holds a dense feed-forward "
            r"\('language_model.model.layers.0.feed_forward.down_proj.weight'\)",
        ),
        (
            "llama4",
            {},
            {"moe_layers": [0]},
            r"layer 0: config.json makes it a mixture-of-experts layer "
            r"\(moe_layers = \[0\] lists it\)",
        ),
    ],
)
def test_moe_layers_checked_against_the_config(tmp_path, family, written, contradiction, match):
    """QA: a layer config.json says is dense but that holds experts (or the reverse) scanned silently. Now it is
    refused naming the layer and the config field, as transformers would build the layer otherwise; a checkpoint
    written as its config says (the generator follows the same fields) scans as before."""
    from plate_inspect.errors import CorruptCheckpointError
    from plate_inspect.testing.synthetic import MULTIMODAL, write_family

    ckpt = write_family(tmp_path / "m", family, **written)
    sparse = _experts_by_layer(ckpt.path)
    chosen, _ = select_targets(Checkpoint.open(ckpt.path))
    assert {t.layer for t in chosen if t.expert is not None} == {i for i, moe in sparse.items() if moe}
    broken = _with_config(ckpt.path, text_config=family in MULTIMODAL, **contradiction)
    with pytest.raises(CorruptCheckpointError, match=match) as err:
        select_targets(broken)
    assert "config.json do not match: use the config.json that came with these weights" in str(err.value)
    # only the layers whose feed-forward modules are scanned are checked: attention alone still scans
    assert select_targets(broken, [r"^(language_model\.)?model\.layers\.\d+\.self_attn\.o_proj$"])[0]


def test_moe_layer_fields_of_the_wrong_type_are_refused(tmp_path):
    from plate_inspect.errors import CorruptCheckpointError
    from plate_inspect.testing.synthetic import write_family

    ckpt = write_family(tmp_path / "m", "qwen2_moe")
    written = (ckpt.path / "config.json").read_text()
    for key, value, match in [
        ("mlp_only_layers", "0", "mlp_only_layers must be a list of layer indices, got '0'"),
        ("decoder_sparse_step", 0, "decoder_sparse_step must be an integer >= 1, got 0"),
        ("decoder_sparse_step", True, "decoder_sparse_step must be an integer >= 1, got True"),
    ]:
        with pytest.raises(CorruptCheckpointError, match=match):
            select_targets(_with_config(ckpt.path, **{key: value}))
        (ckpt.path / "config.json").write_text(written)
    # absent fields: nothing to check against (as before)
    config = json.loads((ckpt.path / "config.json").read_text())
    del config["mlp_only_layers"], config["decoder_sparse_step"]
    (ckpt.path / "config.json").write_text(json.dumps(config))
    assert select_targets(Checkpoint.open(ckpt.path))[0]


def test_peft_adapter_dir_is_refused_as_a_model_and_tied_heads_are_explained(tmp_path):
    """QA: `scan ./lora-output` (what PEFT's save_pretrained writes) scanned its lora_A / lora_B matrices as 8 model
    modules; it is now refused naming the base model to scan. And `--target-modules lm_head` on a model with tied
    embeddings (no lm_head stored) said only "no target modules matched": it now names the embedding to scan."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "tied")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path / "lora")
    adapter_config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = "org/base-model"
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(adapter_config))
    for source in (tmp_path / "lora", tmp_path / "lora" / "adapter_model.safetensors"):
        adapter = Checkpoint.open(source)  # its tensors stay readable (audit reads LoRA adapters this way)
        assert any(".lora_A." in n for n in adapter.tensors)
        with pytest.raises(CheckpointError, match=r"PEFT adapter .* scan its base model \(org/base-model, as"):
            select_targets(adapter)
    tied = Checkpoint.open(tmp_path / "tied")
    assert not any("lm_head" in n for n in tied.tensors)
    with pytest.raises(ConfigError, match=r"no lm_head: .* tied to the input embedding, stored once as 'model.embed"):
        select_targets(tied, ["lm_head"])
    assert [t.name for t in select_targets(tied, ["model.embed_tokens"])[0]] == ["model.embed_tokens"]
