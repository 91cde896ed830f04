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
