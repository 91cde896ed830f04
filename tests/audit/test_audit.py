"""plate-inspect audit: every score against a dense float64 oracle built with numpy (projector P formed explicitly)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_audit import oracle_scores
from helpers_train import BACKBONE, digits_bundle, digits_checkpoint, randomize_adapters
from oracles import dense_oracle, load_all
from safetensors.torch import save_file

from plate_inspect import scan
from plate_inspect.auditing import (
    AUDIT_KEYS,
    LowRankDelta,
    audit,
    audit_update,
    rank_by_risk,
    summarize,
)
from plate_inspect.cli.main import cli
from plate_inspect.errors import BundleError, CheckpointError
from plate_inspect.testing.synthetic import structured_weight, write_gpt2, write_llama_like
from plate_inspect.train.core import dense_delta


def bottom_basis(w: np.ndarray, b: np.ndarray, tau: float) -> np.ndarray:
    """Eigenvectors of W_f^T W_f outside the top m(tau): where a PLATE update lives (numpy float64)."""
    frozen = np.delete(np.asarray(w, np.float64), b, axis=0)
    evals, evecs = np.linalg.eigh(frozen.T @ frozen)
    desc = np.clip(evals[::-1], 0, None)
    m = int(np.argmax(np.cumsum(desc) >= tau * desc.sum())) + 1
    return evecs[:, : w.shape[1] - m]


def weight(d_out: int, d_in: int, seed: int = 0) -> torch.Tensor:
    w, _ = structured_weight(d_out, d_in, torch.Generator().manual_seed(seed))
    return w.double()


SHAPES = [(96, 40), (40, 96), (64, 64)]  # tall W_f, wide W_f, square (wide once B is removed)


# --------------------------------------------------------------------------- pure math
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tau", [0.5, 0.9, 0.99])
def test_dense_update_matches_projector_oracle(shape, tau):
    w = weight(*shape)
    g = torch.Generator().manual_seed(1)
    dw = torch.randn(*shape, generator=g, dtype=torch.float64)
    b = torch.tensor([1, 5, 6, 20, 33])
    rec = audit_update("m", w, dw, b, tau)
    want = oracle_scores(w.numpy(), dw.numpy(), b.numpy(), tau)
    assert rec.m == want["m"]
    for key in ("protected_input_share", "frozen_row_share", "delta_norm", "relative_delta"):
        assert getattr(rec, key) == pytest.approx(want[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("shape", SHAPES)
def test_plate_form_update_scores_zero(shape):
    """dW = E_B A Q^T with Q spanning the bottom eigenspace: both shares ~0 (float64 rounding)."""
    w = weight(*shape, seed=3)
    b = torch.tensor([0, 2, 9, 17, 30, 31])
    q = torch.from_numpy(bottom_basis(w.numpy(), b.numpy(), 0.9))
    a = torch.randn(b.numel(), q.shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    dense = torch.zeros(shape, dtype=torch.float64)
    dense[b] = a @ q.T
    for delta in (dense, LowRankDelta(0.5 * a, q.T.contiguous(), b)):
        rec = audit_update("m", w, delta, b, 0.9)
        assert rec.protected_input_share < 1e-20
        assert rec.frozen_row_share == 0.0
        assert rec.delta_norm > 0


@pytest.mark.parametrize("shape", SHAPES)
def test_dense_random_update_scores_chance(shape):
    """An isotropic Gaussian update: protected share in a 6-sigma band around m/d_in."""
    w = weight(*shape, seed=4)
    b = torch.arange(0, 12)
    rec = audit_update(
        "m", w, torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64), b, 0.9
    )
    p = rec.m / shape[1]
    sigma = math.sqrt(2 * p * (1 - p) / (shape[0] * shape[1]))
    assert abs(rec.protected_input_share - p) < 6 * sigma
    assert rec.chance_share == p
    assert abs(rec.frozen_row_share - (shape[0] - 12) / shape[0]) < 0.1


def test_low_rank_delta_equals_dense():
    w = weight(80, 48, seed=6)
    g = torch.Generator().manual_seed(7)
    left, right = (
        torch.randn(80, 4, generator=g, dtype=torch.float64),
        torch.randn(4, 48, generator=g, dtype=torch.float64),
    )
    b = torch.tensor([3, 4, 70])
    lr = audit_update("m", w, LowRankDelta(left, right), b, 0.8)
    dense = audit_update("m", w, left @ right, b, 0.8)
    for key in AUDIT_KEYS[1:]:
        assert getattr(lr, key) == pytest.approx(getattr(dense, key), rel=1e-10)
    rows = torch.tensor([1, 3, 50])
    full = torch.zeros(80, 48, dtype=torch.float64)
    full[rows] = left[:3] @ right
    lr = audit_update("m", w, LowRankDelta(left[:3], right, rows), b, 0.8)
    want = oracle_scores(w.numpy(), full.numpy(), b.numpy(), 0.8)
    assert lr.protected_input_share == pytest.approx(want["protected_input_share"], rel=1e-9)
    assert lr.frozen_row_share == pytest.approx(2 / 3, rel=0.5)  # rows 1 and 50 frozen, row 3 in B
    assert lr.frozen_row_share == pytest.approx(want["frozen_row_share"], rel=1e-10)


def test_zero_update_and_summary():
    w = weight(32, 24)
    rec = audit_update("z", w, torch.zeros(32, 24, dtype=torch.float64), torch.tensor([0, 1]), 0.9)
    assert (rec.protected_input_share, rec.frozen_row_share, rec.delta_norm, rec.risk) == (0.0, 0.0, 0.0, 0.0)
    g = torch.Generator().manual_seed(0)
    recs = [rec] + [
        audit_update(f"m{i}", w, torch.randn(32, 24, generator=g, dtype=torch.float64) * s, torch.tensor([0]), 0.9)
        for i, s in enumerate((0.1, 1.0))
    ]
    s = summarize(recs)
    assert s.touched == 2 and s.modules == 3
    num = sum(r.protected_input_share * r.delta_norm**2 for r in recs)
    assert s.protected_input_share == pytest.approx(num / sum(r.delta_norm**2 for r in recs))
    assert s.risk == pytest.approx(math.sqrt(num / sum(r.weight_norm**2 for r in recs)))
    assert [r.module for r in rank_by_risk(recs)] == ["m1", "m0", "z"]


# --------------------------------------------------------------------------- checkpoints on disk
@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    """A float32 Qwen2-layout base, and a fine-tune that changes 3 modules (one only on B-like rows)."""
    root = tmp_path_factory.mktemp("audit")
    base = write_llama_like(root / "base", layers=2, dtype=torch.float32, planted_fraction=0.15)
    tensors = load_all(base.path)
    g = torch.Generator().manual_seed(11)
    changed = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"]
    for name in changed:
        t = tensors[f"{name}.weight"]
        tensors[f"{name}.weight"] = t + 0.01 * torch.randn(t.shape, generator=g)
    (root / "tuned").mkdir()
    save_file(tensors, str(root / "tuned" / "model.safetensors"))
    (root / "tuned" / "config.json").write_text(json.dumps(base.config))
    return base.path, root / "tuned", changed


def test_checkpoint_audit_matches_oracle(qwen_pair, tmp_path):
    base, tuned, changed = qwen_pair
    records = audit(base, tuned, tau=0.9, r=8, precision="float64")
    assert len(records) == 14  # 2 layers x 7 module types, streamed
    base_t, tuned_t = load_all(base), load_all(tuned)
    for rec in records:
        w = base_t[f"{rec.module}.weight"].double().numpy()
        dw = tuned_t[f"{rec.module}.weight"].double().numpy() - w
        if rec.module not in changed:
            assert rec.delta_norm == 0.0 and rec.protected_input_share == 0.0
            continue
        _, b, _, _, _ = dense_oracle(w, r=8, tau=0.9, max_rank=512)  # B as the scan chooses it, by definition
        want = oracle_scores(w, dw, b, 0.9)
        for key in AUDIT_KEYS[1:]:
            assert getattr(rec, key) == pytest.approx(want[key], rel=1e-7), (rec.module, key)
    # the same B from a bundle scanned with the same settings; float32 agrees to float32 accuracy
    bundle = scan(base, tmp_path / "b", r=8, tau=0.9)
    with_bundle = {r.module: r for r in audit(base, tuned, bundle=bundle)}
    for rec in records:
        assert with_bundle[rec.module].protected_input_share == pytest.approx(rec.protected_input_share, abs=1e-5)
        assert with_bundle[rec.module].frozen_row_share == pytest.approx(rec.frozen_row_share, abs=1e-6)


def test_conv1d_checkpoint_is_oriented(tmp_path):
    base = write_gpt2(tmp_path / "base", layers=1)
    tensors = load_all(base.path)
    g = torch.Generator().manual_seed(3)
    name = "h.0.mlp.c_fc"
    stored = tensors[f"{name}.weight"]  # [d_in, d_out]
    tensors[f"{name}.weight"] = stored + 0.05 * torch.randn(stored.shape, generator=g)
    (tmp_path / "tuned").mkdir()
    save_file(tensors, str(tmp_path / "tuned" / "model.safetensors"))
    (tmp_path / "tuned" / "config.json").write_text(json.dumps(base.config))
    rec = {r.module: r for r in audit(base.path, tmp_path / "tuned", r=16, precision="float64")}[name]
    w = stored.double().numpy().T
    dw = tensors[f"{name}.weight"].double().numpy().T - w
    _, b, _, _, _ = dense_oracle(w, r=16, tau=0.9, max_rank=512)
    want = oracle_scores(w, dw, b, 0.9)
    assert rec.shape == (192, 48)
    assert rec.protected_input_share == pytest.approx(want["protected_input_share"], rel=1e-7)
    assert rec.frozen_row_share == pytest.approx(want["frozen_row_share"], rel=1e-7)


def write_lora_dir(path, base_tensors, modules, config, seed=0):
    """A PEFT-layout LoRA adapter dir by hand: adapter_config.json + adapter_model.safetensors."""
    g = torch.Generator().manual_seed(seed)
    tensors, factors = {}, {}
    for name, rank in modules.items():
        d_out, d_in = base_tensors[f"{name}.weight"].shape
        a = torch.randn(rank, d_in, generator=g) * 0.1
        b = torch.randn(d_out, rank, generator=g) * 0.1
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
        factors[name] = (a.double().numpy(), b.double().numpy())
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return factors


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_adapter_dir_matches_dense(qwen_pair, tmp_path, rslora):
    base, _, _ = qwen_pair
    base_t = load_all(base)
    modules = {"model.layers.0.self_attn.v_proj": 4, "model.layers.1.mlp.down_proj": 8}
    config = {
        "r": 4,
        "lora_alpha": 16,
        "use_rslora": rslora,
        "rank_pattern": {"down_proj": 8},
        "alpha_pattern": {"layers.1.mlp.down_proj": 4},
        "target_modules": ["v_proj", "down_proj"],
    }
    factors = write_lora_dir(tmp_path / "lora", base_t, modules, config)
    records = audit(base, tmp_path / "lora", r=8, precision="float64")
    assert sorted(r.module for r in records) == sorted(modules)
    for rec in records:
        a, b_lora = factors[rec.module]
        rank = modules[rec.module]
        alpha = 4 if "down_proj" in rec.module else 16
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        w = base_t[f"{rec.module}.weight"].double().numpy()
        _, b, _, _, _ = dense_oracle(w, r=8, tau=0.9, max_rank=512)
        want = oracle_scores(w, scale * b_lora @ a, b, 0.9)
        for key in AUDIT_KEYS[1:]:
            assert getattr(rec, key) == pytest.approx(want[key], rel=1e-7), (rec.module, key)


def test_plate_adapters_score_zero_and_match_merged(tmp_path):
    """A trained-looking PLATE adapter (random A): save_adapter file and PEFT dir both score ~0 on both shares."""
    from plate_inspect.train.layer import apply_bundle, merge_all, save_adapter

    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.8)
    params = apply_bundle(model, bundle, rho=0.5)
    randomize_adapters(params, seed=1)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    records = audit(ckpt.parent, adapter, tau=0.8)
    assert sorted(r.module for r in records) == BACKBONE
    for rec in records:
        assert rec.protected_input_share < 1e-6 and rec.frozen_row_share == 0.0 and rec.delta_norm > 0
    # equals the audit of the merged weights (dense dW), with the same bundle's B
    merge_all(model)
    state = {
        k.replace(".base.", "."): v.detach().contiguous() for k, v in model.state_dict().items() if "plate" not in k
    }
    (tmp_path / "merged").mkdir()
    save_file(state, str(tmp_path / "merged" / "model.safetensors"))
    merged = {r.module: r for r in audit(ckpt.parent, tmp_path / "merged", bundle=bundle, tau=0.8)}
    for rec in records:
        assert merged[rec.module].delta_norm == pytest.approx(rec.delta_norm, rel=1e-4)
        assert merged[rec.module].frozen_row_share == 0.0
        assert merged[rec.module].protected_input_share < 1e-5
    # a higher audit tau protects directions the tau=0.8 Q may use: the share can only grow
    strict = {r.module: r for r in audit(ckpt.parent, adapter, tau=0.99)}
    assert all(strict[n].protected_input_share >= merged[n].protected_input_share - 1e-6 for n in BACKBONE)


def test_plate_adapter_with_a_rho_per_module(tmp_path):
    """apply_bundle twice with different rhos: the adapter stores rho per module, and the audit's ||dW||_F of
    each module is rho_m ||A Q^T||_F with that module's rho (oracle: the layers' own A and Q)."""
    from plate_inspect.train.layer import apply_bundle, plate_layers, save_adapter

    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.8)
    rhos = {name: 0.5 if i % 2 else 2.0 for i, name in enumerate(BACKBONE)}
    for rho in sorted(set(rhos.values())):
        params = apply_bundle(model, bundle, rho, modules=[n for n in BACKBONE if rhos[n] == rho])
        randomize_adapters(params, seed=3)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    layers = plate_layers(model)
    records = {r.module: r for r in audit(ckpt.parent, adapter, tau=0.8)}
    assert sorted(records) == BACKBONE
    for name, layer in layers.items():
        want = rhos[name] * float(torch.linalg.matrix_norm(layer.plate_A.detach().double() @ layer.plate_Q.double().T))
        assert records[name].delta_norm == pytest.approx(want, rel=1e-5), name


def test_plate_peft_adapter_dir(tmp_path):
    from peft import get_peft_model

    from plate_inspect.train.peft import PlateConfig

    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.8)
    peft_model = get_peft_model(model, PlateConfig(bundle=str(bundle.path), rho=0.5))
    randomize_adapters([p for p in peft_model.parameters() if p.requires_grad], seed=2)
    peft_model.save_pretrained(tmp_path / "peft")
    records = audit(ckpt.parent, tmp_path / "peft", tau=0.8)
    assert sorted(r.module for r in records) == BACKBONE
    assert all(r.protected_input_share < 1e-6 and r.frozen_row_share == 0.0 and r.delta_norm > 0 for r in records)


def test_bad_inputs(qwen_pair, tmp_path):
    base, tuned, _ = qwen_pair
    other = write_llama_like(tmp_path / "other", layers=2, dtype=torch.float32, seed=5)
    wrong = scan(other.path, tmp_path / "wrong", r=8)
    with pytest.raises(BundleError, match="other weights"):
        audit(base, tuned, bundle=wrong)
    tensors = load_all(tuned)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "partial").mkdir()
    save_file(tensors, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        audit(base, tmp_path / "partial")
    result = CliRunner().invoke(cli, ["audit", str(base), str(tmp_path / "partial")])
    assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output


def test_cli_json_table_and_report(qwen_pair, tmp_path):
    base, tuned, changed = qwen_pair
    runner = CliRunner()
    result = runner.invoke(cli, ["audit", str(base), str(tuned), "--r", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data) == 14
    assert all(list(rec) == list(AUDIT_KEYS) for rec in data)
    api = {r.module: r.to_json() for r in audit(base, tuned, r=8)}
    assert {d["module"]: d for d in data} == api
    out = tmp_path / "audit.html"
    result = runner.invoke(cli, ["audit", str(base), str(tuned), "--r", "8", "--report", str(out), "-q"])
    assert result.exit_code == 0, result.output
    ranked = [line.split()[0] for line in result.output.splitlines() if line.strip().startswith("model.layers")]
    assert set(ranked[:3]) == set(changed)  # the changed modules rank first
    html = out.read_text()
    assert not re.search(r"<script[^>]+src=", html) and not re.search(r"<link[^>]+href=", html)  # self-contained
    assert "Plotly.newPlot" in html and "model.layers.1.mlp.down_proj" in html


def test_plate_adapter_of_another_bundle_and_dora_refused(tmp_path):
    from plate_inspect.errors import ConfigError
    from plate_inspect.train.layer import apply_bundle, save_adapter

    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.8)
    randomize_adapters(apply_bundle(model, bundle, rho=0.5), seed=1)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.9)  # the bundle dir now holds another Q
    with pytest.raises(BundleError, match="another bundle"):
        audit(ckpt.parent, adapter)
    (tmp_path / "dora").mkdir()
    save_file(
        {"base_model.model.fc1.lora_A.weight": torch.zeros(2, 64)}, str(tmp_path / "dora" / "adapter_model.safetensors")
    )
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "use_dora": True}))
    with pytest.raises(ConfigError, match="DoRA"):
        audit(ckpt.parent, tmp_path / "dora")


def test_plate_adapter_trained_on_a_plan_prefix(tmp_path):
    """An adapter whose layers use Q[:, :k] (a plan) is read with that prefix; dW matches the dense update."""
    from plate_inspect.train.layer import apply_bundle, plate_layers, save_adapter

    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.8)
    plan = {
        "format": "plate-plan",
        "format_version": 1,
        "bundle": {"identity": bundle.manifest.identity},
        "modules": {name: {"k": max(1, bundle.record(name).k // 2)} for name in bundle.modules},
    }
    apply_bundle(model, bundle, rho=0.5, plan=plan)
    g = torch.Generator().manual_seed(3)
    dense = {}
    for layer in plate_layers(model).values():
        assert layer.k == plan["modules"][layer.bundle_name]["k"]
        layer.plate_A = torch.nn.Parameter(torch.randn(layer.r, layer.k, generator=g))
        delta = dense_delta(layer.plate_B_idx, layer.plate_A, layer.plate_Q, layer.rho, layer.d_out)
        dense[layer.bundle_name] = delta.double().numpy()
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    for rec in audit(ckpt.parent, adapter, tau=0.8, precision="float64"):
        assert rec.delta_norm == pytest.approx(float(np.linalg.norm(dense[rec.module])), rel=1e-6)
        assert rec.protected_input_share < 1e-6 and rec.frozen_row_share == 0.0


@pytest.mark.parametrize("rslora", [False, True])
def test_real_peft_lora_dir_matches_its_merged_weights(tmp_path, rslora):
    """A LoRA adapter saved by peft itself: its audit equals the audit of peft's merge_and_unload weights."""
    import peft

    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=BACKBONE, use_rslora=rslora, rank_pattern={"fc2": 2})
    pm = peft.get_peft_model(model, cfg)
    randomize_adapters([p for p in pm.parameters() if p.requires_grad], seed=4, scale=0.1)
    pm.save_pretrained(tmp_path / "lora")
    merged = pm.merge_and_unload()
    (tmp_path / "merged").mkdir()
    save_file(
        {k: v.detach().contiguous() for k, v in merged.state_dict().items()},
        str(tmp_path / "merged" / "model.safetensors"),
    )
    from_adapter = {r.module: r for r in audit(ckpt.parent, tmp_path / "lora", r=16, precision="float64")}
    from_merged = {r.module: r for r in audit(ckpt.parent, tmp_path / "merged", r=16, precision="float64")}
    assert sorted(from_adapter) == BACKBONE
    for name, rec in from_adapter.items():
        for key in AUDIT_KEYS[1:]:
            assert getattr(rec, key) == pytest.approx(getattr(from_merged[name], key), rel=1e-4, abs=1e-9), (name, key)


# --------------------------------------------------------------------------- QA: wrong inputs named plainly
def _cli(*args):
    return CliRunner().invoke(cli, ["audit", *map(str, args)])


def test_bundle_of_another_model_is_refused_naming_it(qwen_pair, tmp_path):
    """QA: `audit BASE TUNED --bundle B` with B of another model said "no 2-D weight 'model.layers...'"; now it
    says the bundle was made for another model, which (its source and model_type, from its manifest), and what to
    do, before any weight is read. Two cases: other module names (GPT-2) and same names, other shapes."""
    base, tuned, _ = qwen_pair
    gpt2 = write_gpt2(tmp_path / "gpt2", layers=1)
    wider = write_llama_like(tmp_path / "wider", layers=2, hidden=96, intermediate=192, dtype=torch.float32)
    for other, model_type in ((gpt2.path, "gpt2"), (wider.path, "qwen2")):
        bundle = scan(other, tmp_path / f"bundle-{other.name}", r=8)
        source = bundle.manifest.source["id"]
        assert source == str(other.resolve())  # the oracle: what the manifest says it was scanned from
        with pytest.raises(BundleError) as err:
            audit(base, tuned, bundle=bundle)
        msg = str(err.value)
        assert "made for another model" in msg and source in msg and f"model_type {model_type}" in msg, msg
        assert f"plate-inspect scan {base}" in msg  # what to do
        result = _cli(base, tuned, "--bundle", bundle.path)
        assert result.exit_code == 2 and "made for another model" in result.output
        assert "Traceback" not in result.output and "no 2-D weight" not in result.output


def test_a_bundle_or_model_in_the_wrong_place_is_named(qwen_pair, tmp_path):
    """QA: a bundle dir passed as TUNED was opened as a checkpoint ("the fine-tuned checkpoint has no tensor ..."),
    as BASE it gave "no target modules matched"; a TUNED of another model failed on its first module only."""
    base, tuned, _ = qwen_pair
    bundle = scan(base, tmp_path / "b", r=8)
    for args, role in (((base, bundle.path), "TUNED"), ((bundle.path, tuned), "BASE")):
        result = _cli(*args)
        assert result.exit_code == 2 and "is a PLATE init bundle" in result.output and role in result.output
        assert "--bundle" in result.output
    gpt2 = write_gpt2(tmp_path / "gpt2", layers=1)
    with pytest.raises(CheckpointError, match=r"has none of the 14 modules audited .*not a fine-tune of that model"):
        audit(base, gpt2.path, r=8)


def test_lora_of_another_model_is_refused_before_reading(qwen_pair, tmp_path):
    """QA: a LoRA trained on a wider model of the same family failed with "the update does not fit the base
    weight" and no hint; now the adapter, the module, both shapes and base_model_name_or_path are named."""
    base, _, _ = qwen_pair
    wider = write_llama_like(tmp_path / "wider", layers=1, hidden=96, intermediate=192, dtype=torch.float32)
    config = {"r": 2, "lora_alpha": 4, "base_model_name_or_path": "org/wider-model"}
    write_lora_dir(tmp_path / "lora", load_all(wider.path), {"model.layers.0.self_attn.q_proj": 2}, config)
    with pytest.raises(CheckpointError, match=r"does not fit BASE's weight .*\[64, 64\].*org/wider-model"):
        audit(base, tmp_path / "lora", r=8)


def test_layers_and_target_modules_narrow_a_bundle_or_adapter_audit(qwen_pair, tmp_path):
    """QA: with --bundle (or an adapter) --layers and --target-modules were silently ignored: every module of the
    bundle was audited. Now they narrow the audit, and the numbers are those of the full audit's records."""
    base, tuned, _ = qwen_pair
    bundle = scan(base, tmp_path / "b", r=8)
    full = {r.module: r for r in audit(base, tuned, bundle=bundle, precision="float64")}
    layer1 = audit(base, tuned, bundle=bundle, layers=[1], precision="float64")
    assert sorted(r.module for r in layer1) == sorted(n for n in full if ".layers.1." in n)
    for rec in layer1:
        assert rec.to_json() == full[rec.module].to_json()
    picked = audit(base, tuned, bundle=bundle, target_modules=["down_proj", "q_proj"], layers=[0])
    assert sorted(r.module for r in picked) == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    modules = {"model.layers.0.self_attn.v_proj": 2, "model.layers.1.mlp.down_proj": 2}
    write_lora_dir(tmp_path / "lora", load_all(base), modules, {"r": 2, "lora_alpha": 4})
    assert [r.module for r in audit(base, tmp_path / "lora", r=8, layers=[1])] == ["model.layers.1.mlp.down_proj"]
    from plate_inspect.errors import ConfigError

    with pytest.raises(ConfigError, match="keeps none of the 14 modules of the bundle"):
        audit(base, tuned, bundle=bundle, layers=[7])
    result = _cli(base, tuned, "--bundle", bundle.path, "--layers", "1", "--json")
    assert result.exit_code == 0 and len(json.loads(result.output)) == 7


@pytest.mark.parametrize("with_bundle", [False, True])
def test_expert_stacks_are_audited_expert_by_expert(tmp_path, with_bundle):
    """QA: a gpt-oss checkpoint (experts as 3-D [E, d_in, d_out] stacks) crashed with a torch RuntimeError
    (the tuned stack was read whole, not one expert's slice); with its bundle it said "no 2-D weight". Now each
    expert is audited against the dense float64 oracle on tensors read by safetensors itself."""
    from plate_inspect.testing.synthetic import write_family

    base = write_family(tmp_path / "base", "gpt_oss", layers=1, dtype=torch.float32)
    tensors = load_all(base.path)
    stack = "model.layers.0.mlp.experts.gate_up_proj"
    noise = 0.02 * torch.randn(tensors[stack][1].shape, generator=torch.Generator().manual_seed(9))
    tensors[stack] = tensors[stack].clone()
    tensors[stack][1] += noise
    (tmp_path / "tuned").mkdir()
    save_file(tensors, str(tmp_path / "tuned" / "model.safetensors"))
    (tmp_path / "tuned" / "config.json").write_text(json.dumps(base.config))
    bundle = scan(base.path, tmp_path / "bundle", r=4) if with_bundle else None
    records = {r.module: r for r in audit(base.path, tmp_path / "tuned", bundle=bundle, r=4, precision="float64")}
    assert {f"{stack}.{e}" for e in range(3)} <= set(records)
    for name, rec in records.items():
        if name != f"{stack}.1":
            assert rec.delta_norm == 0.0, name
    w = load_all(base.path)[stack][1].double().numpy().T  # [d_out, d_in]
    dw = noise.double().numpy().T
    b = bundle.b_idx(f"{stack}.1").numpy() if with_bundle else dense_oracle(w, r=4, tau=0.9, max_rank=512)[1]
    want = oracle_scores(w, dw, b, 0.9)
    for key in AUDIT_KEYS[1:]:
        assert getattr(records[f"{stack}.1"], key) == pytest.approx(want[key], rel=1e-6), key


def test_report_path_is_checked_before_the_audit_runs(qwen_pair, tmp_path, monkeypatch):
    """QA: `--report` into a directory (or under a file) failed only after the whole audit (minutes at 7B)."""
    import plate_inspect.auditing as auditing

    base, tuned, _ = qwen_pair

    def must_not_run(*args, **kwargs):
        raise AssertionError("the audit ran before the report path was checked")

    monkeypatch.setattr(auditing, "audit", must_not_run)
    (tmp_path / "a-file").write_text("x")
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "a-file" / "audit.html", "a-file is a file")):
        result = _cli(base, tuned, "--report", bad)
        assert result.exit_code == 2 and why in result.output and "--report" in result.output, result.output


def test_model_summary_is_one_line(qwen_pair):
    """QA: the model-level line wrapped before its risk value in piped output (160 columns)."""
    base, tuned, _ = qwen_pair
    result = _cli(base, tuned, "--r", "8", "-q")
    assert result.exit_code == 0, result.output
    risk = summarize(audit(base, tuned, r=8)).risk
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("model:")]
    assert line.endswith(f"= {risk:.3e}")


def test_plate_adapter_against_another_base_names_its_bundles_model(qwen_pair, tmp_path):
    """QA: a PLATE adapter of the digits MLP audited against a Qwen2 BASE said "module 'fc1' matches no module of
    the base checkpoint"; now it names the adapter's bundle, the model it was scanned from, and what to do."""
    from plate_inspect.train.layer import apply_bundle, save_adapter

    base, _, _ = qwen_pair
    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.8)
    randomize_adapters(apply_bundle(model, bundle, rho=0.5), seed=1)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    with pytest.raises(BundleError) as err:
        audit(base, adapter)
    msg = str(err.value)
    assert f"the bundle of the PLATE adapter {adapter}" in msg and bundle.manifest.source["id"] in msg, msg
    assert "made for another model" in msg and "pass it as BASE" in msg
