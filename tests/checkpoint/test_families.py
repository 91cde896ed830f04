"""Model families: default targets (exact sets, routers never), orientation of stacked experts, config shape
checks, and B/k/Q of scanned modules against dense float64 oracles on the weights read by safetensors' loader."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from oracles import (
    block_oracle,
    decode_e4m3,
    dense_oracle,
    load_all,
    mxfp4_oracle,
    stored_bytes,
    with_random_bf16_weights,
)

import plate_inspect
from plate_inspect.checkpoint import Checkpoint, parse_safetensors_header
from plate_inspect.cli.main import cli
from plate_inspect.errors import CheckpointError
from plate_inspect.targets import expert_of, load_target, modules_by_name, select_targets
from plate_inspect.testing.synthetic import FAMILY_DEFAULTS, write_family

R, TAU, MAX_RANK = 4, 0.9, 16
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
GLU = ("gate_proj", "up_proj", "down_proj")
MLA_Q_LORA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def names(prefix: str, *suffixes: str) -> set[str]:
    return {f"{prefix}.{s}" for s in suffixes}


def expected_targets(family: str, layers: int = 2) -> set[str]:
    """Every default target of the generated checkpoint, written out from the families' naming conventions."""
    c = FAMILY_DEFAULTS[family]
    out: set[str] = set()
    for i in range(layers):
        p = f"model.layers.{i}"
        if family in ("llama", "mistral", "qwen3", "olmo2"):
            out |= names(f"{p}.self_attn", *ATTN) | names(f"{p}.mlp", *GLU)
        elif family == "gemma3":
            p = f"language_model.model.layers.{i}"
            out |= names(f"{p}.self_attn", *ATTN) | names(f"{p}.mlp", *GLU)
        elif family == "phi3":
            out |= names(f"{p}.self_attn", "qkv_proj", "o_proj") | names(f"{p}.mlp", "gate_up_proj", "down_proj")
        elif family == "mixtral":
            out |= names(f"{p}.self_attn", *ATTN)
            for e in range(c["num_local_experts"]):
                out |= names(f"{p}.block_sparse_moe.experts.{e}", "w1", "w2", "w3")
        elif family in ("qwen2_moe", "qwen3_moe"):
            out |= names(f"{p}.self_attn", *ATTN)
            if i in c["mlp_only_layers"]:
                out |= names(f"{p}.mlp", *GLU)
                continue
            for e in range(c["num_experts"]):
                out |= names(f"{p}.mlp.experts.{e}", *GLU)
            if family == "qwen2_moe":
                out |= names(f"{p}.mlp.shared_expert", *GLU)
        elif family.startswith("deepseek"):
            q = MLA_Q_LORA if c["q_lora_rank"] else ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
            out |= names(f"{p}.self_attn", *q)
            if i < c["first_k_dense_replace"]:
                out |= names(f"{p}.mlp", *GLU)
                continue
            for e in range(c["n_routed_experts"]):
                out |= names(f"{p}.mlp.experts.{e}", *GLU)
            out |= names(f"{p}.mlp.shared_experts", *GLU)
        elif family == "llama4":
            p = f"language_model.model.layers.{i}"
            out |= names(f"{p}.self_attn", *ATTN)
            if i % 2 == 0:  # interleave_moe_layer_step 2: layers 1, 3, ... are MoE
                out |= names(f"{p}.feed_forward", *GLU)
                continue
            out |= names(f"{p}.feed_forward.shared_expert", *GLU)
            for e in range(c["num_local_experts"]):
                out |= names(f"{p}.feed_forward.experts", f"gate_up_proj.{e}", f"down_proj.{e}")
        elif family == "qwen3_vl_moe":
            p = f"model.language_model.layers.{i}"
            out |= names(f"{p}.self_attn", *ATTN)
            if i in c["mlp_only_layers"]:
                out |= names(f"{p}.mlp", *GLU)
                continue
            for e in range(c["num_experts"]):
                out |= names(f"{p}.mlp.experts", f"gate_up_proj.{e}", f"down_proj.{e}")
        elif family == "gpt_oss":
            out |= names(f"{p}.self_attn", *ATTN)
            for e in range(c["num_local_experts"]):
                out |= names(f"{p}.mlp.experts", f"gate_up_proj.{e}", f"down_proj.{e}")
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("families")
    return {f: write_family(base / f, f) for f in FAMILY_DEFAULTS}


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_default_targets_exact(ckpts, family):
    targets, note = select_targets(Checkpoint.open(ckpts[family].path))
    got = [t.name for t in targets]
    assert set(got) == expected_targets(family) and len(got) == len(set(got))
    assert f"model_type '{family}'" in note
    for t in targets:  # routers, router biases, vision towers, embeddings, heads: never
        assert not any(x in t.name for x in (".gate.", "router", "shared_expert_gate", "vision", "lm_head", "embed"))
        assert not t.name.endswith(".gate")


def oriented_weight(tensors: dict[str, torch.Tensor], name: str, family: str) -> torch.Tensor:
    """A module's [d_out, d_in] weight by hand: per-expert tensors as stored; 3-D stacks [E, d_in, d_out] sliced."""
    if name + ".weight" in tensors:
        return tensors[name + ".weight"]
    stack, expert = name.rsplit(".", 1)
    assert family in ("llama4", "gpt_oss", "qwen3_vl_moe")  # the families that store [experts, d_in, d_out]
    return tensors[stack][int(expert)].T


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_load_target_orientation_and_fingerprint(ckpts, family):
    ckpt = Checkpoint.open(ckpts[family].path)
    tensors = load_all(ckpts[family].path)
    for t in select_targets(ckpt)[0]:
        before = ckpt.bytes_read
        w, fingerprint = load_target(ckpt, t)
        want = oriented_weight(tensors, t.name, family)
        assert torch.equal(w, want), t.name
        assert tuple(w.shape) == t.shape
        stored_bytes = want.T.contiguous() if t.layout == "experts_in_major" else want.contiguous()
        assert ckpt.bytes_read - before == stored_bytes.numel() * stored_bytes.element_size() == t.nbytes
        assert fingerprint == "sha256:" + hashlib.sha256(stored_bytes.view(torch.uint8).numpy().tobytes()).hexdigest()


def check_against_oracle(bundle, tensors, family, modules):
    for name in modules:
        rec = bundle.record(name)
        w = oriented_weight(tensors, name, family).double().numpy()
        scores, b, evals, k, gram = dense_oracle(w, R, TAU, MAX_RANK)
        assert rec.shape == list(w.shape)
        assert bundle.b_idx(name).tolist() == b.tolist(), name
        assert rec.k == k, name
        np.testing.assert_allclose(bundle.redundancy(name).numpy(), scores, rtol=1e-4, atol=1e-5)
        q = bundle.q(name, torch.float64).numpy()
        np.testing.assert_allclose(q.T @ q, np.eye(k), atol=2e-5)
        # Q captures the optimum: the k smallest eigenvalues of G = W_f^T W_f
        assert np.trace(q.T @ gram @ q) <= 1.01 * evals[:k].sum() + 1e-6 * evals.sum(), name


SAMPLES = {  # a few modules per family: attention, dense and expert MLPs, 3-D expert slices
    "mixtral": ["model.layers.0.self_attn.k_proj", "model.layers.1.block_sparse_moe.experts.2.w2"],
    "qwen2_moe": [
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.experts.3.up_proj",
        "model.layers.1.mlp.shared_expert.gate_proj",
    ],
    "qwen3_moe": ["model.layers.1.self_attn.o_proj", "model.layers.0.mlp.experts.1.down_proj"],
    "deepseek_v3": [
        "model.layers.0.self_attn.q_b_proj",
        "model.layers.1.self_attn.kv_a_proj_with_mqa",
        "model.layers.1.self_attn.kv_b_proj",
        "model.layers.1.mlp.experts.0.gate_proj",
        "model.layers.1.mlp.shared_experts.down_proj",
    ],
    "deepseek_v2": ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts.2.down_proj"],
    "llama4": [
        "language_model.model.layers.1.feed_forward.experts.gate_up_proj.2",
        "language_model.model.layers.1.feed_forward.experts.down_proj.0",
        "language_model.model.layers.0.feed_forward.up_proj",
    ],
    "gpt_oss": ["model.layers.0.mlp.experts.gate_up_proj.1", "model.layers.1.mlp.experts.down_proj.2"],
    "qwen3_vl_moe": [
        "model.language_model.layers.1.mlp.experts.gate_up_proj.2",
        "model.language_model.layers.1.mlp.experts.down_proj.0",
        "model.language_model.layers.0.mlp.down_proj",
    ],
    "gemma3": ["language_model.model.layers.1.self_attn.q_proj"],
    "phi3": ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"],
    "olmo2": ["model.layers.0.mlp.down_proj"],
    "qwen3": ["model.layers.1.self_attn.k_proj"],
}


@pytest.mark.parametrize("family", sorted(SAMPLES))
def test_scan_matches_dense_oracle(ckpts, family, tmp_path):
    ckpt = ckpts[family]
    bundle = plate_inspect.scan(ckpt.path, tmp_path / "b", r=R, tau=TAU, max_rank=MAX_RANK)
    assert set(bundle.modules) == expected_targets(family)
    tensors = load_all(ckpt.path)
    check_against_oracle(bundle, tensors, family, SAMPLES[family])
    for rec in bundle:  # module types carry no expert index; the expert sits in the name
        assert rec.module_type.split(".")[-1].isdigit() is False
    layouts = {rec.layout for rec in bundle}
    stacked = family in ("llama4", "gpt_oss", "qwen3_vl_moe")
    assert layouts == ({"linear", "experts_in_major"} if stacked else {"linear"})


def test_deepseek_mtp_layer_only_when_asked(ckpts, tmp_path):
    ckpt = Checkpoint.open(ckpts["deepseek_v3"].path)
    default, note = select_targets(ckpt)
    assert all(t.layer != 2 for t in default) and "multi-token-prediction layer 2 skipped" in note
    with_mtp, _ = select_targets(ckpt, include_mtp=True)
    extra = {t.name for t in with_mtp} - {t.name for t in default}
    mtp = "model.layers.2"
    want = names(f"{mtp}.self_attn", *MLA_Q_LORA) | names(f"{mtp}.mlp.shared_experts", *GLU) | {f"{mtp}.eh_proj"}
    for e in range(4):
        want |= names(f"{mtp}.mlp.experts.{e}", *GLU)
    assert extra == want
    assert {t.name: t.shape for t in with_mtp}[f"{mtp}.eh_proj"] == (32, 64)
    out = tmp_path / "mtp"
    res = CliRunner().invoke(
        cli,
        ["scan", str(ckpts["deepseek_v3"].path), "-o", str(out), "--r", "4", "--max-rank", "8", "--layers", "2",
         "--include-mtp", "-q"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert set(plate_inspect.Bundle.load(out).modules) == want
    assert json.loads((out / "manifest.json").read_text())["config"]["include_mtp"] is True  # the CLI's settings


def test_include_mtp_is_a_setting_of_the_bundle(ckpts, tmp_path):
    """include_mtp is recorded in the manifest, is part of the settings digest and the identity, and a rescan
    with the other value never reuses the bundle (nor its part files) silently."""
    from plate_inspect.errors import BundleError

    path, out = ckpts["deepseek_v3"].path, tmp_path / "b"
    small = dict(r=R, max_rank=8, layers=[1, 2])
    without = plate_inspect.scan(path, out, **small)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["include_mtp"] is False
    assert all(not n.startswith("model.layers.2.") for n in without.modules)
    with pytest.raises(BundleError, match="other settings"):
        plate_inspect.scan(path, out, include_mtp=True, **small)
    with_mtp = plate_inspect.scan(path, out, include_mtp=True, overwrite=True, **small)
    assert json.loads((out / "manifest.json").read_text())["config"]["include_mtp"] is True
    assert {n for n in with_mtp.modules if n.startswith("model.layers.2.")} == {
        t.name for t in select_targets(Checkpoint.open(path), include_mtp=True)[0] if t.layer == 2
    }
    assert with_mtp.stats()["modules_resumed"] == 0
    # identity oracle: sha256 of the canonical JSON of settings (now with include_mtp), variant and modules
    stored = load_all(path)
    sha = {n: "sha256:" + hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in stored.items()}
    modules = sorted([rec.name, sha[rec.name + ".weight"], rec.dtype, rec.shape, rec.layout] for rec in with_mtp)
    config = json.loads((out / "manifest.json").read_text())["config"]
    oracle = json.dumps({"settings": config, "variant": None, "modules": modules}, sort_keys=True)
    assert with_mtp.manifest.identity == "sha256:" + hashlib.sha256(oracle.encode()).hexdigest()
    # the same layer-1 modules, other include_mtp: the layer-1 part of the MTP bundle vouches for nothing
    layer1 = plate_inspect.scan(path, tmp_path / "l1", r=R, max_rank=8, layers=[1])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "layer-00001.safetensors").write_bytes((out / "layer-00001.safetensors").read_bytes())
    again = plate_inspect.scan(path, mixed, r=R, max_rank=8, layers=[1])
    assert again.stats()["modules_resumed"] == 0
    assert again.manifest.identity == layer1.manifest.identity


def test_include_mtp_that_plans_the_same_modules_rescans(ckpts, tmp_path):
    """QA: include_mtp was compared strictly on a rescan, so `--include-mtp` on a model without an MTP layer (or
    with it outside --layers) was refused as "other settings" though it plans the same modules. It is compared by
    the modules it plans, like layers and target_modules: nothing is recomputed, the bundle keeps its own setting
    (files and identity untouched); where it does add the MTP layer it is still refused."""
    from plate_inspect.errors import BundleError

    llama, out = ckpts["llama"].path, tmp_path / "llama"
    first = plate_inspect.scan(llama, out, r=R, max_rank=8)
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "scan_stats.json"}
    again = plate_inspect.scan(llama, out, r=R, max_rank=8, include_mtp=True)
    assert again.stats()["modules_resumed"] == len(expected_targets("llama")) and again.stats()["modules_scanned"] == 0
    assert again.settings.include_mtp is False and again.manifest.identity == first.manifest.identity
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "scan_stats.json"} == files
    # DeepSeek-V3 with its MTP layer (2) outside --layers: the same plan both ways, in both directions
    dsv3 = ckpts["deepseek_v3"].path
    for before, after in ((False, True), (True, False)):
        out = tmp_path / f"dsv3-{before}"
        made = plate_inspect.scan(dsv3, out, r=R, max_rank=8, layers=[1], include_mtp=before)
        again = plate_inspect.scan(dsv3, out, r=R, max_rank=8, layers=[1], include_mtp=after)
        assert again.stats()["modules_scanned"] == 0 and again.manifest.identity == made.manifest.identity
        assert again.settings.include_mtp is before
    # where it adds the MTP layer's modules: refused, naming the setting and the module counts
    with_mtp = len({t.name for t in select_targets(Checkpoint.open(dsv3), include_mtp=True)[0] if t.layer in (1, 2)})
    without = len({t.name for t in select_targets(Checkpoint.open(dsv3))[0] if t.layer == 1})
    plate_inspect.scan(dsv3, tmp_path / "d", r=R, max_rank=8, layers=[1, 2])
    with pytest.raises(BundleError, match=rf"include_mtp False there, True here; {without} modules there, {with_mtp}"):
        plate_inspect.scan(dsv3, tmp_path / "d", r=R, max_rank=8, layers=[1, 2], include_mtp=True)


def test_routers_only_when_named(ckpts):
    ckpt = Checkpoint.open(ckpts["qwen2_moe"].path)
    chosen, _ = select_targets(ckpt, ["mlp.gate", "shared_expert_gate"])
    assert {t.name for t in chosen} == {"model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate"}
    gpt, _ = select_targets(Checkpoint.open(ckpts["gpt_oss"].path), ["mlp.router"])
    assert [t.name for t in gpt] == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]


def test_unknown_family_fallback_skips_routers_and_stacks(tmp_path):
    ckpt = write_family(tmp_path / "m", "mixtral")
    config = json.loads((ckpt.path / "config.json").read_text())
    (ckpt.path / "config.json").write_text(json.dumps({**config, "model_type": "mystery-moe"}))
    chosen, note = select_targets(Checkpoint.open(ckpt.path))
    assert "unknown model_type" in note
    assert {t.name for t in chosen} == expected_targets("mixtral")  # gate (router) left out


@pytest.mark.parametrize(
    ("family", "override", "tensor"),
    [
        ("qwen2_moe", {"moe_intermediate_size": 20}, "mlp.experts.0.down_proj.weight"),
        ("mixtral", {"intermediate_size": 40}, "block_sparse_moe.experts.0.w1.weight"),
        ("deepseek_v3", {"kv_lora_rank": 12}, "self_attn.kv_a_proj_with_mqa.weight"),
        ("deepseek_v3", {"q_lora_rank": None}, "self_attn.q_a_proj.weight"),
        ("qwen3", {"head_dim": 8}, "self_attn.k_proj.weight"),
        ("gemma3", {"num_key_value_heads": 2}, "self_attn.k_proj.weight"),
        ("llama4", {"intermediate_size_mlp": 48}, "feed_forward.down_proj.weight"),
        ("gpt_oss", {"intermediate_size": 16}, "mlp.experts.down_proj"),
    ],
)
def test_config_shape_checks(tmp_path, family, override, tensor):
    """Weights written with the defaults, config.json saying otherwise: refused, naming the first such tensor."""
    ckpt = write_family(tmp_path / "m", family)
    config = json.loads((ckpt.path / "config.json").read_text())
    inner = config.get("text_config", config)
    inner.update(override)
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"tensor '[^']*{tensor}'"):
        select_targets(Checkpoint.open(ckpt.path))


def test_a_one_row_router_gets_r_zero_and_info_says_so(ckpts, tmp_path):
    """qwen2_moe's shared_expert_gate is [1, hidden]: r = floor(0.9 * 1) = 0; info notes that PLATE trains nothing
    there instead of listing it silently."""
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli
    from plate_inspect.scanner import scan

    bundle = scan(ckpts["qwen2_moe"].path, tmp_path / "b", r=4, target_modules=["shared_expert_gate", "q_proj"])
    zero = sorted(rec.name for rec in bundle if rec.r == 0)
    assert zero and all(n.endswith("shared_expert_gate") and bundle.record(n).d_out == 1 for n in zero)
    assert all(rec.r == 4 for rec in bundle if rec.name not in zero)
    result = CliRunner().invoke(cli, ["info", str(bundle.path)])
    assert result.exit_code == 0 and f"{len(zero)} module" in result.output and "r = 0" in result.output


def test_module_types_as_printed_select_their_modules(ckpts):
    """The module types scan/info print select exactly their modules: DeepSeek's routed experts' gate projections
    without the shared experts' or the dense layer's; Mixtral's w1 of every expert."""
    ckpt = Checkpoint.open(ckpts["deepseek_v3"].path)
    everything = {t.name: t for t in select_targets(ckpt, [".*"])[0]}
    chosen, _ = select_targets(ckpt, ["mlp.experts.gate_proj"])
    want = {n for n, t in everything.items() if t.module_type == "mlp.experts.gate_proj"}
    assert {t.name for t in chosen} == want and len(want) >= 2
    assert all(".mlp.experts." in n and ".shared_experts." not in n for n in want)
    mixtral = Checkpoint.open(ckpts["mixtral"].path)
    w1, _ = select_targets(mixtral, ["block_sparse_moe.experts.w1"])
    assert w1 and all(t.name.endswith(".w1") and t.module_type == "block_sparse_moe.experts.w1" for t in w1)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_per_expert_tensors_checked_against_the_configs_expert_count(tmp_path, family):
    """One tensor per expert: a config claiming more experts than stored, or a missing expert, is refused like a
    3-D stack of the wrong size (QA: both scanned silently, the bundle lacking experts)."""
    from safetensors.torch import load_file, save_file

    from plate_inspect.targets import EXPERT_COUNT_KEYS

    ckpt = write_family(tmp_path / "m", family)
    config = json.loads((ckpt.path / "config.json").read_text())
    key = EXPERT_COUNT_KEYS[family]
    n = config[key]
    assert select_targets(Checkpoint.open(ckpt.path))[0]  # as written: consistent
    (ckpt.path / "config.json").write_text(json.dumps({**config, key: n + 2}))
    with pytest.raises(CheckpointError, match=rf"has experts 0-{n - 1} but config.json says {key} = {n + 2}"):
        select_targets(Checkpoint.open(ckpt.path))
    (ckpt.path / "config.json").write_text(json.dumps(config))
    files = sorted(ckpt.path.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(str(files[0]))
    dropped = [name for name in tensors if f".experts.{n - 1}." in name]
    assert dropped
    save_file({k: v for k, v in tensors.items() if k not in dropped}, str(files[0]))
    with pytest.raises(CheckpointError, match=rf"has experts 0-{n - 2} but config.json says {key} = {n}"):
        select_targets(Checkpoint.open(ckpt.path))


def test_expert_count_and_transposed_stack_refused(tmp_path):
    ckpt = write_family(tmp_path / "m", "llama4")
    config = json.loads((ckpt.path / "config.json").read_text())
    config["text_config"]["num_local_experts"] = 5
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="stacks 3 experts but config.json says 5"):
        select_targets(Checkpoint.open(ckpt.path))
    # a gpt-oss stack stored [E, d_out, d_in] where the family stores [E, d_in, d_out]
    from safetensors.torch import load_file, save_file

    g = write_family(tmp_path / "g", "gpt_oss")
    tensors = load_file(str(g.path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(g.path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"stored transposed\?"):
        select_targets(Checkpoint.open(g.path))


def open_quantized(path) -> Checkpoint:
    """A quantized release opened from its headers and config.json (dequantizing reads are the inputs layer's)."""
    tensors, _ = parse_safetensors_header(path / "model.safetensors")
    return Checkpoint(path, [path / "model.safetensors"], tensors, json.loads((path / "config.json").read_text()))


def test_fp8_scale_companions_never_targets(tmp_path):
    plain = {t.name for t in select_targets(Checkpoint.open(write_family(tmp_path / "bf16", "deepseek_v3").path))[0]}
    ckpt = open_quantized(write_family(tmp_path / "fp8", "deepseek_v3", fp8=True).path)
    assert any(n.endswith("weight_scale_inv") for n in ckpt.tensors)
    targets, _ = select_targets(ckpt)
    assert {t.name for t in targets} == plain
    assert all(t.tensor.dtype == "F8_E4M3" for t in targets)


def test_mxfp4_experts_named_and_oriented(tmp_path):
    """gpt-oss's release: *_blocks [E, d_out, d_in/32, 16] + *_scales: one logical weight, output-major slices."""
    ckpt = open_quantized(write_family(tmp_path / "mx", "gpt_oss", mxfp4=True).path)
    targets = {t.name: t for t in select_targets(ckpt)[0]}
    assert set(targets) == expected_targets("gpt_oss")
    t = targets["model.layers.1.mlp.experts.gate_up_proj.2"]
    assert t.tensor.name == "model.layers.1.mlp.experts.gate_up_proj_blocks" and t.expert == 2
    assert t.logical_name == "model.layers.1.mlp.experts.gate_up_proj"
    assert t.layout == "experts_out_major" and t.logical_shape == (3, 64, 96) and t.shape == (64, 96)
    assert targets["model.layers.0.mlp.experts.down_proj.0"].shape == (96, 32)
    assert not any("scales" in n or n.endswith("_bias") for n in targets)


def test_modules_by_name_finds_expert_slices(ckpts):
    ckpt = Checkpoint.open(ckpts["llama4"].path)
    found = modules_by_name(ckpt)
    t = found["language_model.model.layers.1.feed_forward.experts.down_proj.2"]
    assert t.expert == 2 and t.layout == "experts_in_major" and t.shape == (32, 24)
    assert "language_model.model.layers.1.feed_forward.router" in found  # every module, not only targets


# --------------------------------------------------------------------------- batched eigensolves of experts
def projector(q: torch.Tensor) -> torch.Tensor:
    q = q.double()
    return q @ q.T


@pytest.mark.parametrize(("d_out", "d_in", "r"), [(48, 20, 6), (24, 40, 4), (16, 64, 4)])  # tall, wide, mostly null
def test_batched_geometry_matches_per_module(d_out, d_in, r):
    from plate_inspect.batched import batched_plate_geometry
    from plate_inspect.geometry import plate_geometry
    from plate_inspect.testing.synthetic import structured_weight

    gen = torch.Generator().manual_seed(3)
    weights = torch.stack([structured_weight(d_out, d_in, gen, planted=5)[0] for _ in range(5)]).double()
    seeds = [11 * e + 1 for e in range(5)]
    batched = batched_plate_geometry(weights, r, 0.9, 12, seeds=seeds, n_anchors=16)
    for e, got in enumerate(batched):
        one = plate_geometry(weights[e].clone(), r, 0.9, 12, n_anchors=16, seed=seeds[e])
        assert got.b_idx.tolist() == one.b_idx.tolist()
        torch.testing.assert_close(got.redundancy, one.redundancy)
        assert got.k == one.k and got.k_by_tau == one.k_by_tau
        torch.testing.assert_close(got.basis.spectrum, one.basis.spectrum, rtol=1e-5, atol=1e-7)
        assert got.basis.q.dtype == torch.float64 and got.basis.q.shape == (d_in, one.k)
        torch.testing.assert_close(got.basis.q.T @ got.basis.q, torch.eye(one.k, dtype=torch.float64))
        # both are exact bottom-k eigenspaces of G = W_f^T W_f (float64 oracle); where the null space is larger than
        # k, any k of its directions are exact, so the two paths may pick different ones (same energy, ~0)
        frozen = np.delete(weights[e].numpy(), one.b_idx.numpy(), axis=0)
        gram = frozen.T @ frozen
        optimum = np.sort(np.linalg.eigvalsh(gram))[: one.k].clip(min=0).sum()
        for q in (got.basis.q.numpy(), one.basis.q.double().numpy()):
            assert np.trace(q.T @ gram @ q) <= 1.01 * optimum + 1e-10 * np.trace(gram)
        if optimum > 1e-8 * np.trace(gram):  # a unique bottom-k eigenspace: the same subspace
            torch.testing.assert_close(projector(got.basis.q), projector(one.basis.q), atol=1e-8, rtol=0)
        assert got.basis.captured_energy == pytest.approx(one.basis.captured_energy, abs=1e-10)


def test_expert_groups_by_part_type_and_size(ckpts):
    from plate_inspect.batched import expert_groups
    from plate_inspect.scanner import part_name

    targets, _ = select_targets(Checkpoint.open(ckpts["mixtral"].path))
    todo = [(part_name(t), t) for t in targets]
    items = expert_groups(todo, max_group=2)
    assert [t.name for _, g in items for t in g] != [t.name for t in targets]  # experts regrouped by type ...
    assert sorted(t.name for _, g in items for t in g) == sorted(t.name for t in targets)  # ... none lost
    for part, group in items:
        assert len(group) <= 2 and {part_name(t) for t in group} == {part}
        assert len({(t.module_type, t.shape) for t in group}) == 1
        assert len(group) == 1 or all(t.expert is not None for t in group)
    parts = [p for p, _ in items]
    assert parts == sorted(parts)  # parts stay contiguous
    w1 = [[t.expert for t in g] for _, g in items if g[0].module_type == "block_sparse_moe.experts.w1"]
    assert w1 == [[0, 1], [2], [0, 1], [2]]
    assert all(len(g) == 1 for _, g in expert_groups(todo, max_group=1))
    assert all(len(g) == 1 for _, g in expert_groups(todo, max_group=8, max_bytes=targets[-1].nbytes))


@pytest.mark.parametrize("family", ["llama4", "mixtral"])
def test_batched_scan_matches_per_module_scan(ckpts, family, tmp_path, monkeypatch):
    """The scanner's batched path (forced on CPU with expert_group) against its per-module path and the oracle."""
    from plate_inspect import scanner
    from plate_inspect.bundle import ScanSettings
    from plate_inspect.scanner import plan_scan, run_scan

    batch_sizes = []
    real = scanner.batched_plate_geometry
    monkeypatch.setattr(
        scanner, "batched_plate_geometry", lambda w, *a, **kw: batch_sizes.append(len(w)) or real(w, *a, **kw)
    )
    path = ckpts[family].path
    settings = ScanSettings(r=R, tau=TAU, max_rank=MAX_RANK, precision="float64")
    one = run_scan(plan_scan(path, settings), tmp_path / "one")
    assert batch_sizes == []  # CPU default: one module at a time
    grouped = run_scan(plan_scan(path, settings), tmp_path / "grouped", expert_group=8)
    n_experts = 3  # per MoE layer, both families' defaults
    assert batch_sizes == [n_experts] * (2 if family == "llama4" else 6)  # one eigensolve per projection and layer
    assert grouped.modules == one.modules
    for rec in grouped:
        other = one.record(rec.name)
        assert (rec.k, rec.r, rec.fingerprint, rec.shape) == (other.k, other.r, other.fingerprint, other.shape)
        assert grouped.b_idx(rec.name).tolist() == one.b_idx(rec.name).tolist()
        # Q: both exact bottom-k eigenspaces (checked against the oracle below); where the null space is larger
        # than k the two paths may pick different null directions, with the same (zero) energy
        assert rec.captured_energy == pytest.approx(other.captured_energy, abs=1e-9)
    experts = [n for n in grouped.modules if ".experts." in n]
    check_against_oracle(grouped, load_all(path), family, experts)


def test_verify_finds_expert_slices(ckpts, tmp_path):
    """verify checks every module's fingerprint, 3-D expert slices included; a changed expert is caught."""
    from safetensors.torch import load_file, save_file

    from plate_inspect import verify

    src = ckpts["gpt_oss"].path
    bundle = plate_inspect.scan(src, tmp_path / "b", r=R, tau=TAU, max_rank=MAX_RANK, layers=[0])
    report = verify(bundle, src)
    assert report.ok and report.modules_checked == len(bundle) == 4 + 6, report.problems
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.down_proj"][1, 0, 0] += 1.0  # expert 1 only
    save_file(tensors, str(changed / "model.safetensors"))
    problems = verify(bundle, changed).problems
    assert len(problems) == 1 and "mlp.experts.down_proj.1'" in problems[0] and "fingerprint differs" in problems[0]


# --------------------------------------------------------------------------- quantized releases, scanned end to end
def _scan_quantized_against_oracle(path, tmp_path, decode) -> None:
    """Scan a quantized release; every target's B, k and Q against the dense oracle on independently decoded weights."""
    from safetensors.torch import load_file

    bundle = plate_inspect.scan(path, tmp_path / "bundle", r=R, tau=TAU, max_rank=MAX_RANK, precision="float64")
    stored = load_file(str(path / "model.safetensors"))
    assert len(bundle.modules) > 0
    for name in bundle.modules:
        w = decode(stored, bundle.record(name))
        scores, b, evals, k, gram = dense_oracle(w, R, TAU, MAX_RANK)
        assert bundle.record(name).shape == list(w.shape), name
        assert bundle.b_idx(name).tolist() == b.tolist(), name
        assert bundle.record(name).k == k, name
        q = bundle.q(name, torch.float64).numpy()
        assert np.trace(q.T @ gram @ q) <= 1.01 * evals[:k].sum() + 1e-6 * evals.sum(), name


def test_mxfp4_gpt_oss_release_scans_against_the_decoded_oracle(tmp_path):
    def decode(stored, rec):
        stack, expert = rec.name.rsplit(".", 1)
        blocks, scales = stored[f"{stack}_blocks"], stored[f"{stack}_scales"]
        full = mxfp4_oracle(stored_bytes(blocks).reshape(blocks.shape), stored_bytes(scales).reshape(scales.shape))
        return full[int(expert)].astype(np.float64)  # [E, d_out, d_in]: output-major, as gpt-oss stores blocks

    ckpt = write_family(tmp_path / "mx", "gpt_oss", mxfp4=True)
    _scan_quantized_against_oracle(
        ckpt.path,
        tmp_path,
        lambda s, rec: decode(s, rec) if "experts" in rec.name else s[f"{rec.name}.weight"].double().numpy(),
    )


def test_fp8_block_scaled_deepseek_release_scans_against_the_decoded_oracle(tmp_path):
    def decode(stored, rec):
        raw = stored[f"{rec.name}.weight"]
        if raw.dtype != torch.float8_e4m3fn:
            return raw.double().numpy()
        values = decode_e4m3(stored_bytes(raw).reshape(raw.shape))
        scale = stored[f"{rec.name}.weight_scale_inv"].double().numpy()
        return block_oracle(values, scale, (128, 128)).astype(np.float64)

    ckpt = write_family(tmp_path / "fp8", "deepseek_v3", fp8=True)
    _scan_quantized_against_oracle(ckpt.path, tmp_path, decode)


def test_ablation_variants_of_3d_expert_slices(ckpts, tmp_path):
    """Variants read expert slices through the same seam as the scan: Random-B rows are the seeded draw, Q unchanged."""
    from plate_inspect.geometry import module_seed, random_rows
    from plate_inspect.train.variants import make_variant

    path = ckpts["llama4"].path
    base = plate_inspect.scan(path, tmp_path / "base", r=R, tau=TAU, max_rank=MAX_RANK)
    variant = make_variant(base, path, "random_b", tmp_path / "random_b", seed=5)
    experts = [n for n in base.modules if ".experts." in n]
    assert experts and variant.modules == base.modules
    for name in experts:
        rec = base.record(name)
        assert variant.record(name).fingerprint == rec.fingerprint
        assert variant.b_idx(name).tolist() == random_rows(rec.d_out, rec.r, module_seed(5, name)).tolist()
        torch.testing.assert_close(variant.q(name), base.q(name))


def test_experts_are_split_into_bounded_part_files(ckpts, tmp_path, monkeypatch):
    """A part is held in memory whole: experts of a layer go to parts of EXPERTS_PER_PART experts each."""
    from plate_inspect import scanner

    monkeypatch.setattr(scanner, "EXPERTS_PER_PART", 2)
    bundle = plate_inspect.scan(ckpts["mixtral"].path, tmp_path / "b", r=R, tau=TAU, max_rank=MAX_RANK)
    for rec in bundle:
        if rec.layer is None:
            continue
        expert = expert_of(rec.name)
        want = f"layer-{rec.layer:05d}" + ("" if expert is None else f"-experts-{expert // 2:04d}") + ".safetensors"
        assert rec.file == want, rec.name
    files = {rec.file for rec in bundle}
    assert {p.name for p in bundle.path.glob("*.safetensors")} == files
    assert any("-experts-0001" in f for f in files)  # 3 experts per layer: two expert parts


def test_every_part_name_is_recognised_as_a_bundle_part(ckpts):
    """The bundle refuses foreign safetensors files by name: every name the scanner gives a part must pass."""
    from plate_inspect.bundle import PART_FILE_NAME
    from plate_inspect.scanner import part_name

    for family, ckpt in ckpts.items():
        targets = select_targets(Checkpoint.open(ckpt.path))[0]
        names = {part_name(t) for t in targets}
        assert all(PART_FILE_NAME.fullmatch(n) for n in names), (family, sorted(names))
        assert any("experts" in n for n in names) or family not in ("mixtral", "qwen2_moe", "deepseek_v3")


# --------------------------------------------------------------------------- models built and saved by transformers
#: transformers' names of an expert's projections in its per-expert checkpoint format -> part of its fused parameter
_HF_PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
HF_FAMILIES = ("llama", "mistral", "qwen3", "olmo2", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2",
               "deepseek_v3", "gpt_oss", "gpt2", "bert", "llama_tied", "llama4", "llama4_text", "gemma3",
               "gemma3_text", "distilbert", "roberta", "xlm-roberta", "electra", "deberta-v2", "deberta-v3",
               "modernbert", "t5", "mt5", "umt5", "camembert", "xlm-roberta-xl", "bart", "mbart")  # fmt: skip
#: Small encoder dims (transformers' own config keys), shared by the encoder families' configs.
_ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=64,
                max_position_embeddings=64)  # fmt: skip


def _hf_config_and_class(family: str):
    """transformers' config and model class of a tiny ``family`` model (the class its hub checkpoints are saved as:
    the masked-LM or conditional-generation head included, so heads must be left out by name)."""
    t = pytest.importorskip("transformers")
    if family == "gpt2":
        return t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32), t.GPT2LMHeadModel
    if family == "bert":
        return t.BertConfig(**_ENCODER), t.BertModel
    if family in ("llama4", "llama4_text"):  # layer 1 MoE (interleave_moe_layer_step 2), layer 0 dense
        text = {**FAMILY_DEFAULTS["llama4"], "num_hidden_layers": 2, "vocab_size": 64}
        if family == "llama4_text":
            return t.Llama4TextConfig(**text), t.Llama4ForCausalLM
        vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=8, projector_input_dim=16, projector_output_dim=32, vision_output_dim=16)  # fmt: skip
        return t.Llama4Config(text_config=text, vision_config=vision), t.Llama4ForConditionalGeneration
    if family in ("gemma3", "gemma3_text"):
        text = {**FAMILY_DEFAULTS["gemma3"], "num_hidden_layers": 2, "vocab_size": 300}
        if family == "gemma3_text":
            return t.Gemma3TextConfig(**text), t.Gemma3ForCausalLM
        vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=4)  # fmt: skip
        config = t.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        return config, t.Gemma3ForConditionalGeneration
    if family == "distilbert":
        config = t.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=48, vocab_size=64,
                                    max_position_embeddings=64)  # fmt: skip
        return config, t.DistilBertForMaskedLM
    if family == "roberta":
        return t.RobertaConfig(**_ENCODER), t.RobertaForMaskedLM
    if family == "xlm-roberta":
        return t.XLMRobertaConfig(**_ENCODER), t.XLMRobertaForSequenceClassification
    if family == "electra":
        return t.ElectraConfig(embedding_size=16, **_ENCODER), t.ElectraForMaskedLM
    if family == "deberta-v2":  # relative attention with its own position projections (share_att_key false)
        config = t.DebertaV2Config(**_ENCODER, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                   share_att_key=False, position_buckets=8, max_relative_positions=16)  # fmt: skip
        return config, t.DebertaV2ForMaskedLM
    if family == "deberta-v3":  # DeBERTa-v3's layout: shared position keys, layer-normed relative embeddings
        config = t.DebertaV2Config(**_ENCODER, relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=True,
                                   position_buckets=8, norm_rel_ebd="layer_norm")  # fmt: skip
        return config, t.DebertaV2ForMaskedLM
    if family == "modernbert":  # layer 0 global attention, layer 1 local, layer 2 global
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
        config = t.ModernBertConfig(**{**_ENCODER, "num_hidden_layers": 3}, **ids, global_attn_every_n_layers=2)
        return config, t.ModernBertForMaskedLM
    if family == "t5":  # ReLU feed-forward (wi), a deeper decoder than encoder
        config = t.T5Config(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                            vocab_size=64)  # fmt: skip
        return config, t.T5ForConditionalGeneration
    if family == "mt5":  # gated-GELU feed-forward (wi_0, wi_1), untied head
        config = t.MT5Config(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, vocab_size=64)
        return config, t.MT5ForConditionalGeneration
    if family == "umt5":  # a relative_attention_bias in every block, not only the first
        config = t.UMT5Config(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, vocab_size=64)
        return config, t.UMT5ForConditionalGeneration
    if family == "camembert":
        return t.CamembertConfig(**_ENCODER), t.CamembertForMaskedLM
    if family == "xlm-roberta-xl":
        return t.XLMRobertaXLConfig(**_ENCODER), t.XLMRobertaXLForMaskedLM
    if family in ("bart", "mbart"):
        heads = dict(encoder_attention_heads=4, decoder_attention_heads=4)
        dims = dict(d_model=32, encoder_layers=2, decoder_layers=3, vocab_size=64, max_position_embeddings=64, **heads)
        if family == "bart":
            return t.BartConfig(**dims, encoder_ffn_dim=48, decoder_ffn_dim=48), t.BartForConditionalGeneration
        # encoder and decoder feed-forwards of other widths: fc1 / fc2 shapes cannot be checked by module type
        return t.MBartConfig(**dims, encoder_ffn_dim=48, decoder_ffn_dim=40), t.MBartForConditionalGeneration
    from plate_inspect.testing.synthetic import family_config

    base = "llama" if family == "llama_tied" else family
    config = family_config(base, 2, 64, torch.bfloat16, tie_word_embeddings=family == "llama_tied", pad_token_id=0)
    config.pop("num_nextn_predict_layers", None)  # transformers builds no MTP layer
    return t.AutoConfig.for_model(config.pop("model_type"), **config), t.AutoModelForCausalLM.from_config


def _hf_model(family: str) -> torch.nn.Module:
    """A tiny model of ``family`` built by transformers from its config, random bf16 weights."""
    config, build = _hf_config_and_class(family)
    return with_random_bf16_weights(build(config))


def _transformers_weights(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Oracle: every module PLATE should adapt, as transformers computes with it ([d_out, d_in]): the nn.Linear and
    GPT-2 Conv1D modules inside its stacks of layers (an nn.ModuleList: heads, poolers, classifiers and embedding
    projections outside them left out; a multimodal model's language model only), routers aside, and each expert of
    its fused expert parameters. Named as transformers' save_pretrained wrote them (``saved``): a module whose name
    it renamed on saving (Gemma-3's model.language_model. -> language_model.model.) by the one saved tensor with its
    weight's values; experts as one tensor per expert (gate and up are the halves of the fused ``gate_up_proj``, in
    that order, as its forward chunks them), or 3-D stacks [E, d_in, d_out]."""
    import re

    from transformers.pytorch_utils import Conv1D

    modules = dict(model.named_modules())
    stacks = [n for n, m in modules.items() if isinstance(m, torch.nn.ModuleList)]
    text_only = getattr(model.config, "text_config", None) is not None
    want: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        in_layers = any(re.match(rf"{re.escape(s)}\.\d+\.", name) for s in stacks)
        if not in_layers or re.search(r"(gate|router)$", name) or (text_only and "language_model." not in name):
            continue
        if isinstance(module, torch.nn.Linear):
            want[name] = module.weight
        elif isinstance(module, Conv1D):
            want[name] = module.weight.T
    renamed = {}
    for name, weight in want.items():
        if name + ".weight" in saved:
            continue
        same = [k for k, t in saved.items() if t.shape == weight.shape and torch.equal(t, weight.detach())]
        assert len(same) == 1 and same[0].endswith(".weight"), (name, same)
        renamed[name] = same[0].removesuffix(".weight")
    want = {renamed.get(n, n): w for n, w in want.items()}
    for key, tensor in saved.items():
        per_expert = re.match(r"(.*)\.experts\.(\d+)\.(\w+)\.weight$", key)
        if per_expert:
            base, e, proj = per_expert.group(1), int(per_expert.group(2)), _HF_PROJ[per_expert.group(3)]
            experts = modules[base.replace("block_sparse_moe", "mlp") + ".experts"]
            fused = experts.down_proj[e] if proj == "down" else experts.gate_up_proj[e]
            half = fused.shape[0] // 2
            want[key.removesuffix(".weight")] = {"down": fused, "gate": fused[:half], "up": fused[half:]}[proj]
        elif tensor.dim() == 3 and re.search(r"experts\.(gate_up_proj|down_proj)$", key):
            stack = getattr(modules[key.rsplit(".", 1)[0]], key.rsplit(".", 1)[1])
            want.update({f"{key}.{e}": stack[e].T for e in range(tensor.shape[0])})
    return want


def _saved_by_transformers(family: str, path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny model and what its save_pretrained wrote to ``path`` (every tensor, by name)."""
    from safetensors.torch import load_file

    model = _hf_model(family)
    model.save_pretrained(path)
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        saved.update(load_file(f))
    return model, saved


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_targets_match_what_transformers_builds_and_saves(family, tmp_path):
    """The default targets of a checkpoint written by transformers' own save_pretrained are exactly the modules
    its model computes with in its layers (names), and each weight read is the one that model uses (values,
    orientation: Conv1D transposed, fused experts split as transformers' forward splits them, Llama-4's stacks
    [E, d_in, d_out] transposed). Heads, poolers and classifiers (BERT's pooler, RoBERTa's lm_head, DistilBERT's
    vocab_transform, ELECTRA's embeddings_project), T5's relative_attention_bias and multimodal vision towers and
    projectors are left out on purpose; the selection note names the family (no fallback)."""
    model, saved = _saved_by_transformers(family, tmp_path)
    want = _transformers_weights(model, saved)
    if family == "llama_tied":
        assert "lm_head.weight" not in saved  # tied: the head is the embedding, saved once
    ckpt = Checkpoint.open(tmp_path)
    targets, note = select_targets(ckpt)
    assert note.startswith(f"defaults for model_type '{ckpt.config['model_type']}'"), note
    assert {t.name for t in targets} == set(want)
    for t in targets:
        w, _ = load_target(ckpt, t)
        assert w.dtype == torch.bfloat16 and torch.equal(w, want[t.name].detach()), t.name


@pytest.mark.parametrize(
    ("family", "override", "tensor"),
    [
        ("distilbert", {"hidden_dim": 40}, "ffn.lin1.weight"),
        ("roberta", {"intermediate_size": 40}, "intermediate.dense.weight"),
        ("deberta-v2", {"attention_head_size": 4}, "layer.0.attention.output.dense.weight"),
        ("modernbert", {"intermediate_size": 40}, "mlp.Wi.weight"),
        ("t5", {"d_kv": 4}, "decoder.block.0.layer.0.SelfAttention.k.weight"),
        ("mt5", {"d_ff": 40}, "DenseReluDense.wi_0.weight"),
        ("bart", {"encoder_ffn_dim": 40, "decoder_ffn_dim": 40}, "decoder.layers.0.fc1.weight"),
    ],
)
def test_encoder_shapes_checked_against_the_config(tmp_path, family, override, tensor):
    """A transformers-saved encoder checkpoint whose config.json then says other dims: refused, naming the tensor."""
    _saved_by_transformers(family, tmp_path)
    select_targets(Checkpoint.open(tmp_path))  # as saved: fits
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **override}))
    with pytest.raises(CheckpointError, match=f"tensor '[^']*{tensor}' has .*config.json implies"):
        select_targets(Checkpoint.open(tmp_path))


@pytest.mark.parametrize("as_released", [True, False])
def test_qwen3_vl_moe_stacks_in_either_orientation_against_transformers(tmp_path, as_released):
    """Qwen3-VL-MoE (a model_type that fell back to "every 2-D weight": its 3-D experts were skipped and its vision
    tower targeted) keeps experts as 3-D stacks: its release stores [E, hidden, 2 x moe] (transformers transposes them
    on load), transformers 5 re-saves its own [E, 2 x moe, hidden]. Oracle: the model transformers builds, whose
    forward is linear(x, gate_up_proj[e]) (so [d_out, d_in] = its parameter's slice), saved by its save_pretrained;
    the release layout is that file with each stack transposed."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    text = {**FAMILY_DEFAULTS["qwen3_vl_moe"], "num_hidden_layers": 2, "vocab_size": 64}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 1e4}
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])  # fmt: skip
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    params = dict(model.named_parameters())
    want = {
        n.removesuffix(".weight"): p
        for n, p in params.items()
        if ".language_model.layers." in n and n.endswith("_proj.weight")
    }
    for n, p in params.items():
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            want.update({f"{n}.{e}": p[e] for e in range(p.shape[0])})
    (shard,) = tmp_path.glob("*.safetensors")
    if as_released:
        tensors = load_file(shard)
        for n, t in tensors.items():
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[n] = t.transpose(1, 2).contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})
    ckpt = Checkpoint.open(tmp_path)
    targets, note = select_targets(ckpt)
    assert "qwen3_vl_moe" in note and {t.name for t in targets} == set(want)
    layouts = {t.layout for t in targets if t.expert is not None}
    assert layouts == {"experts_in_major" if as_released else "experts_out_major"}
    for t in targets:
        w, _ = load_target(ckpt, t)
        assert torch.equal(w, want[t.name].detach()), t.name


def test_qwen3_vl_moe_mixed_stack_orientations_are_refused(tmp_path):
    """One checkpoint, one orientation: a Qwen3-VL-MoE file with one stack transposed against the others cannot be
    read both ways; the shape check names that tensor (stored transposed?) instead of guessing."""
    from safetensors.torch import load_file, save_file

    path = write_family(tmp_path / "m", "qwen3_vl_moe").path
    tensors = load_file(path / "model.safetensors")
    odd = "model.language_model.layers.1.mlp.experts.down_proj"
    tensors[odd] = tensors[odd].transpose(1, 2).contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"'{odd}' has \[d_out, d_in\] = .* \(stored transposed\?\)"):
        select_targets(Checkpoint.open(path))


def test_mtp_note_names_the_cli_option_that_scans_it(tmp_path):
    """QA: `plate-inspect scan` of a DeepSeek-V3 checkpoint printed "multi-token-prediction layer 2 skipped
    (include_mtp to scan it)": the Python keyword, which the CLI does not take. The note now names `--include-mtp`
    (and the keyword), and that option does scan the layer the note names."""
    ckpt = write_family(tmp_path / "dsv3", "deepseek_v3", layers=2)
    mtp = ckpt.config["num_hidden_layers"]  # the MTP layer's index: num_hidden_layers (one of them here)
    assert ckpt.config["num_nextn_predict_layers"] == 1
    runner = CliRunner()
    skipped = runner.invoke(cli, ["scan", str(ckpt.path), "--out", str(tmp_path / "b"), "--r", "4", "-q"])
    assert skipped.exit_code == 0, skipped.output
    assert f"multi-token-prediction layer {mtp} skipped (scan it with --include-mtp" in skipped.output
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert all(rec["layer"] != mtp for rec in manifest["modules"].values())
    option = "--include-mtp"
    assert option in runner.invoke(cli, ["scan", "--help"]).output
    with_mtp = runner.invoke(cli, ["scan", str(ckpt.path), "--out", str(tmp_path / "m"), "--r", "4", option, "-q"])
    assert with_mtp.exit_code == 0, with_mtp.output
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert any(rec["layer"] == mtp for rec in manifest["modules"].values())
