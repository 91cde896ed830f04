"""audit: an MXFP4-stored TUNED (gpt-oss's release format) is BASE rounded to TUNED's own MXFP4 grid.

Oracles: TUNED written by this file's own dense MXFP4 quantizer (per 32-element block of a row: an E8M0 power-of-two
scale, each element the nearest E2M1 value found by brute force over the 8 magnitudes, ties to the even code,
saturating at 6), decoded by the independent MXFP4 decoder of tests/oracles.py, and every score recomputed densely in
float64 numpy with P formed explicitly (helpers_audit.oracle_scores).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_audit import audit_json, oracle_scores
from oracles import dense_oracle, mxfp4_oracle
from safetensors.torch import load_file, save_file

from plate_inspect.auditing import AUDIT_KEYS, ROUNDING_KEYS, audit, rounding_reference
from plate_inspect.cli.main import cli
from plate_inspect.reports.audit import audit_section
from plate_inspect.testing.synthetic import write_family

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitude by 3-bit code; code parity = "even"
R, TAU = 4, 0.9
STACKS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")


# --------------------------------------------------------------------------- the test's own MXFP4
def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """4-bit codes (sign << 3 | magnitude code) of the nearest E2M1 values to x: brute force, ties to the even code,
    |x| above 6 saturating to 6."""
    dist = np.abs(np.minimum(np.abs(x), 6.0)[..., None] - E2M1)
    ties = dist == dist.min(axis=-1, keepdims=True)
    magnitude = np.argmin(np.where(ties, np.arange(8) % 2, 2), axis=-1)  # an even code among the nearest, if any
    return (np.signbit(x).astype(np.int64) << 3) | magnitude


def quantize(w: np.ndarray, convention: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> MXFP4 blocks uint8 [..., rows, cols / 32, 16] and E8M0 scales uint8 [..., rows, cols / 32].

    ``ocp``: scale 2^(floor(log2 amax) - 2) (OCP MX v1.0: block amax in [4, 8) x scale, the top saturates to 6);
    ``ceil``: the smallest power of two with amax <= 6 x scale (nothing saturates). An all-zero block: scale 1."""
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    safe = np.where(amax > 0, amax, 1.0)
    exponent = np.floor(np.log2(safe)) - 2 if convention == "ocp" else np.ceil(np.log2(safe / 6.0))
    exponent = np.where(amax > 0, exponent, 0).astype(np.int64)
    codes = e2m1_codes(blocks / np.ldexp(1.0, exponent)[..., None])
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # low nibble: the earlier element
    scales = np.ascontiguousarray(exponent + 127, np.uint8)
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(scales)


def rounded_base(w: np.ndarray, scales: torch.Tensor) -> np.ndarray:
    """BASE rounded to TUNED's MXFP4 grid at TUNED's scales (values beyond 8 x scale keep BASE), float32 as read."""
    scale = np.ldexp(1.0, scales.numpy().astype(np.int64) - 127).repeat(32, axis=-1)
    x = w.astype(np.float64) / scale
    rounded = (E2M1[e2m1_codes(x) & 7] * np.where(np.signbit(x), -1.0, 1.0) * scale).astype(np.float32)
    return np.where(np.abs(x) < 8, rounded, w).astype(np.float64)


def half_step(v: np.ndarray, scales: torch.Tensor) -> np.ndarray:
    """Half of E2M1's grid step at |v| / scale (0.5 below 2, 1 below 4, else 2), times TUNED's scale."""
    scale = np.ldexp(1.0, scales.numpy().astype(np.int64) - 127).repeat(32, axis=-1)
    a = np.abs(v) / scale
    return 0.5 * np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0)) * scale


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A one-layer gpt-oss BASE in float32: expert stacks [E, d_in, d_out] (gate_up 64x96, down 96x32 per expert)."""
    ckpt = write_family(tmp_path_factory.mktemp("mx16") / "base", "gpt_oss", layers=1, dtype=torch.float32)
    return ckpt.path


def write_mxfp4(root, tensors: dict[str, torch.Tensor], config: dict, convention: str = "ocp") -> dict[str, tuple]:
    """TUNED as gpt-oss's release stores it: each expert stack as ``<stack>_blocks`` [E, d_out, d_in / 32, 16] +
    ``<stack>_scales`` [E, d_out, d_in / 32] (rows = outputs), every other tensor as is."""
    root.mkdir()
    out, codes = {}, {}
    for name, w in tensors.items():
        if name in STACKS:
            blocks, scales = quantize(w.transpose(1, 2).double().numpy(), convention)  # [E, d_out, d_in]
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            codes[name] = (blocks, scales)
        else:
            out[name] = w
    save_file(out, str(root / "model.safetensors"))
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return codes


def base_tensors(root) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(root / "model.safetensors")), json.loads((root / "config.json").read_text())


def expert_weight(tensors, stack: str, e: int) -> np.ndarray:
    """BASE's expert e as d_out x d_in, float64."""
    return tensors[stack][e].T.double().numpy()


# --------------------------------------------------------------------------- tests
def test_mxfp4_half_step_rule_by_hand():
    """E2M1 at scale 0.25 (steps 0.5 / 1 / 2 scaled units below 2 / 4 / 8): ties go to the even code, 6-8 saturates
    to 6, beyond 8 BASE is kept; a TUNED tie rounded the other way is rounding, one step more is an update."""
    scale = torch.full((9,), 0.25)
    # scaled units (value / 0.25): 0.25 and 2.5 and 5.0 are ties (even: 0, 2, 4); 7 saturates; 9 is beyond 8
    base = torch.tensor([0.0625, 0.625, 1.25, 1.75, 2.25, -0.1875, 0.625, 0.3, 0.625])
    tuned = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.25, -0.25, 0.75, 0.25, 1.0])
    ref = rounding_reference(base, tuned, "mxfp4", scale)
    # 0.25 -> 0; 2.5 -> 2 (0.5); 5 -> 4 (1.0); 7 -> 6 (1.5); 9 kept; -0.75 -> -1 (-0.25); TUNED 3 for 2.5 is the tie
    # rounded up (rounding); 1.2 -> 1 (0.25), TUNED 0.25 equal; TUNED 4 for 2.5: one step past round(BASE) = 2
    assert ref.tolist() == [0.0, 0.5, 1.0, 1.5, 2.25, -0.25, 0.75, 0.25, 0.5]
    assert (tuned - ref).tolist() == [0.0] * 8 + [0.5]
    # BASE exactly on the grid, TUNED a step away: an update of that step
    assert rounding_reference(torch.tensor([1.0]), torch.tensor([1.5]), "mxfp4", torch.tensor([0.25])).item() == 1.0


@pytest.mark.parametrize("convention", ["ocp", "ceil"])
@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_an_mxfp4_copy_of_base_is_no_update(base, tmp_path, convention, base_dtype):
    """gpt-oss's expert stacks quantized to MXFP4 (OCP's saturating scale and the round-up scale; an fp32 and a bf16
    BASE): no update beyond the quantization error, rounding_floor = the test's own ||dequant - W||; attention (not
    quantized, same dtype) carries no rounding keys. Before: every expert 'changed' by its quantization error."""
    tensors, config = base_tensors(base)
    if base_dtype == torch.bfloat16:
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
        (tmp_path / "b16").mkdir()
        save_file(tensors, str(tmp_path / "b16" / "model.safetensors"))
        (tmp_path / "b16" / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
        base = tmp_path / "b16"
    codes = write_mxfp4(tmp_path / "mx", tensors, config, convention)
    records = audit(base, tmp_path / "mx", r=R, tau=TAU, precision="float64")
    experts = [rec for rec in records if ".experts." in rec.module]
    assert len(experts) == 6 and len(records) > len(experts)
    for rec in records:
        assert rec.delta_norm == 0.0, rec
        if rec not in experts:
            assert rec.base_rounded_to is None, rec
            continue
        stack, e = rec.module.rsplit(".", 1)
        blocks, scales = codes[stack]
        w = expert_weight(tensors, stack, int(e))
        floor = float(np.linalg.norm(mxfp4_oracle(blocks[int(e)].numpy(), scales[int(e)].numpy()) - w))
        assert rec.base_rounded_to == "mxfp4" and floor > 1e-2 * rec.weight_norm, rec
        assert rec.rounding_floor == pytest.approx(floor, rel=1e-6), rec
    html = audit_section(records)
    assert "No update beyond MXFP4 quantization error" in html and "Note: TUNED stores 6 modules in mxfp4" in html
    res = CliRunner().invoke(cli, ["audit", str(base), str(tmp_path / "mx"), "--r", str(R), "-q"])
    assert res.exit_code == 0, res.output
    assert f"model: 0/{len(records)} modules changed: no update beyond MXFP4 quantization error" in res.output
    assert "note: TUNED stores 6 modules in mxfp4" in res.output and "at TUNED's own MXFP4 scales" in res.output
    for rec in audit_json(base, tmp_path / "mx", "--r", R):
        assert rec["delta_norm"] == 0.0, rec
        keys = AUDIT_KEYS + ROUNDING_KEYS if ".experts." in rec["module"] else AUDIT_KEYS
        assert list(rec) == list(keys) and rec.get("base_rounded_to", "mxfp4") == "mxfp4", rec


def test_an_mxfp4_fine_tune_of_one_expert_scores_its_update(base, tmp_path):
    """A rank-2 update of gate_up_proj's expert 1 (3x its MXFP4 quantization error), then MXFP4: that expert alone
    changes, and its scores equal the dense float64 oracle on dW = dequant(TUNED) - BASE rounded at TUNED's own
    scales. Before, all 6 experts 'changed' (their quantization error) and expert 1's dW held BASE's error too."""
    tensors, config = base_tensors(base)
    stack, e = STACKS[0], 1
    w = expert_weight(tensors, stack, e)
    blocks, scales = quantize(w, "ocp")
    floor = float(np.linalg.norm(mxfp4_oracle(blocks.numpy(), scales.numpy()) - w))
    gen = torch.Generator().manual_seed(11)
    d = (torch.randn(w.shape[0], 2, generator=gen) @ torch.randn(2, w.shape[1], generator=gen)).double()
    d *= 3 * floor / float(torch.linalg.vector_norm(d))
    tuned = dict(tensors)
    tuned[stack] = tensors[stack].clone()
    tuned[stack][e] += d.T.float()
    codes = write_mxfp4(tmp_path / "ft", tuned, config)
    records = {r.module: r for r in audit(base, tmp_path / "ft", r=R, tau=TAU, precision="float64")}
    assert {m for m, r in records.items() if r.delta_norm > 0} == {f"{stack}.{e}"}
    assert sum(r.base_rounded_to == "mxfp4" for r in records.values()) == 6

    blocks, scales = codes[stack][0][e], codes[stack][1][e]
    dequant = mxfp4_oracle(blocks.numpy(), scales.numpy()).astype(np.float64)
    reference = rounded_base(w, scales)
    # no element where TUNED is within half a step of BASE (at the finer side) but not round(BASE), i.e. a tie
    # rounded the other way, which audit counts as rounding: so the plain round(BASE) oracle is exact here
    within = np.abs(dequant - w) <= half_step(np.minimum(np.abs(dequant), np.abs(w)), scales)
    assert not (within & (dequant != reference)).any()
    _, b, _, _, _ = dense_oracle(w, r=R, tau=TAU, max_rank=512)  # B as the scan chooses it, by definition
    rec = records[f"{stack}.{e}"]
    for key, want in oracle_scores(w, dequant - reference, b, TAU).items():
        assert getattr(rec, key) == pytest.approx(want, rel=1e-6, abs=1e-9), key
    assert rec.rounding_floor == pytest.approx(float(np.linalg.norm(reference - w)), rel=1e-6)
    assert rec.delta_norm == pytest.approx(3 * floor, rel=0.5)  # the planted update, give or take MXFP4's noise


def test_mxfp4_two_dimensional_weights(base, tmp_path):
    """MXFP4 outside the expert stacks: q/k/v_proj stored as ``<name>.weight_blocks`` [d_out, d_in / 32, 16] +
    ``_scales`` (2-D, rows = outputs; the stacks' path was the only one tested). A planted rank-2 update of q_proj
    (3x its quantization error) is that module's only change, scored as the dense float64 oracle on
    dequant(TUNED) - BASE rounded at TUNED's scales; k/v are no update, their floor the test's own ||dequant - W||."""
    tensors, config = base_tensors(base)
    names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    w = tensors[names[0]].double().numpy()
    blocks, scales = quantize(w, "ocp")
    floor = float(np.linalg.norm(mxfp4_oracle(blocks.numpy(), scales.numpy()) - w))
    gen = torch.Generator().manual_seed(5)
    d = (torch.randn(w.shape[0], 2, generator=gen) @ torch.randn(2, w.shape[1], generator=gen)).double()
    d *= 3 * floor / float(torch.linalg.vector_norm(d))
    tuned, codes = dict(tensors), {}
    tuned[names[0]] = (tensors[names[0]].double() + d).float()
    for name in names:
        codes[name] = quantize(tuned.pop(name).double().numpy(), "ocp")
        tuned[name + "_blocks"], tuned[name + "_scales"] = codes[name]
    (tmp_path / "mx2").mkdir()
    save_file(tuned, str(tmp_path / "mx2" / "model.safetensors"))
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["experts", "router"]}
    (tmp_path / "mx2" / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))

    records = {r.module: r for r in audit(base, tmp_path / "mx2", r=R, tau=TAU, precision="float64")}
    attn = {m: r for m, r in records.items() if ".self_attn." in m and not m.endswith("o_proj")}
    assert sorted(attn) == sorted(n.removesuffix(".weight") for n in names)
    assert {m for m, r in records.items() if r.delta_norm > 0} == {names[0].removesuffix(".weight")}
    for name in names:
        rec, (blk, sc) = attn[name.removesuffix(".weight")], codes[name]
        assert rec.base_rounded_to == "mxfp4", rec
        dequant = mxfp4_oracle(blk.numpy(), sc.numpy()).astype(np.float64)
        base_w = tensors[name].double().numpy()
        reference = rounded_base(base_w, sc)
        assert rec.rounding_floor == pytest.approx(float(np.linalg.norm(reference - base_w)), rel=1e-6), rec
        if name != names[0]:
            assert rec.rounding_floor == pytest.approx(float(np.linalg.norm(dequant - base_w)), rel=1e-6)
            continue
        within = np.abs(dequant - base_w) <= half_step(np.minimum(np.abs(dequant), np.abs(base_w)), sc)
        assert not (within & (dequant != reference)).any()  # no tie rounded the other way: round(BASE) is exact
        _, b, _, _, _ = dense_oracle(base_w, r=R, tau=TAU, max_rank=512)
        for key, want in oracle_scores(base_w, dequant - reference, b, TAU).items():
            assert getattr(rec, key) == pytest.approx(want, rel=1e-6, abs=1e-9), key
    for m, r in records.items():
        if m not in attn:
            assert r.base_rounded_to is None and r.delta_norm == 0.0, r


def test_scan_names_a_two_dimensional_mxfp4_weight_by_its_module(base, tmp_path):
    """A 2-D MXFP4 'X.weight_blocks' was module 'X.weight' (the scan's bundle named 'q_proj.weight', which no
    PEFT module name matches, and audit found no 'q_proj' in TUNED): it is module X, with the dequantized weight's
    geometry (the same bundle entry as a scan of the dequantized float32 weight stored plainly)."""
    from plate_inspect.scanner import scan

    tensors, config = base_tensors(base)
    name = "model.layers.0.self_attn.q_proj.weight"
    blocks, scales = quantize(tensors[name].double().numpy(), "ocp")
    plain = {**tensors, name: torch.from_numpy(mxfp4_oracle(blocks.numpy(), scales.numpy())).float()}
    quantized = {k: v for k, v in tensors.items() if k != name}
    quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
    for sub, content, cfg in (
        ("plain", plain, config),
        ("mx", quantized, {**config, "quantization_config": {"quant_method": "mxfp4"}}),
    ):
        (tmp_path / sub).mkdir()
        save_file(content, str(tmp_path / sub / "model.safetensors"))
        (tmp_path / sub / "config.json").write_text(json.dumps(cfg))
    got = {
        sub: scan(tmp_path / sub, tmp_path / f"b-{sub}", r=R, max_rank=16, anchors=8, target_modules=["q_proj"])
        for sub in ("plain", "mx")
    }
    assert list(got["mx"].modules) == list(got["plain"].modules) == ["model.layers.0.self_attn.q_proj"]
    (m,) = got["mx"].modules
    mx, ref = got["mx"], got["plain"]
    assert mx.record(m).k == ref.record(m).k and torch.equal(mx.b_idx(m), ref.b_idx(m))
    assert torch.equal(mx.spectrum(m), ref.spectrum(m)) and torch.equal(mx.q(m), ref.q(m))
