"""audit: the storage-rounding note in --json, and FP8-stored TUNED checkpoints.

Oracles: TUNED written by this file's own dense FP8 quantizer (block amax / 448, torch's e4m3 cast; also the
reciprocal-multiply convention), and every score recomputed densely in float64 numpy with P formed explicitly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_audit import audit_json, oracle_scores
from oracles import dense_oracle
from safetensors.torch import load_file, save_file

from plate_inspect.auditing import AUDIT_KEYS, ROUNDING_KEYS, audit
from plate_inspect.cli.main import cli
from plate_inspect.reports.audit import audit_section
from plate_inspect.testing.synthetic import write_llama_like

E4M3 = torch.float8_e4m3fn
BLOCK = (32, 32)
R, TAU = 8, 0.9


# --------------------------------------------------------------------------- oracles
def quantize(w: torch.Tensor, block=BLOCK, reciprocal=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense FP8 e4m3 block quantization: codes and the F32 ``scale_inv`` grid (DeepSeek-V3 layout).

    ``reciprocal``: transformers' convention, codes = w * (448 / amax) and scale_inv = 1 / (448 / amax)."""
    rows, cols = w.shape
    br, bc = block
    gr, gc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(gr * br, gc * bc)
    padded[:rows, :cols] = w.float()
    amax = padded.reshape(gr, br, gc, bc).abs().amax(dim=(1, 3))
    amax = torch.where(amax > 0, amax, torch.full_like(amax, 448.0))  # an all-zero block: scale 1
    if reciprocal:
        mult = 448.0 / amax
        scale = 1.0 / mult
        full = mult.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
        return (w.float() * full).to(E4M3), scale
    scale = amax / 448.0
    return (w.float() / expand(scale, rows, cols, block)).to(E4M3), scale


def expand(scale: torch.Tensor, rows: int, cols: int, block=BLOCK) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> np.ndarray:
    """fp8 x scale, exactly (float64: a 4-bit times a 24-bit significand), then float32 as a reader rounds it."""
    full = expand(scale, *codes.shape, block).double()
    return (codes.double() * full).float().double().numpy()


def is_target(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def write_fp8(root, tensors: dict[str, torch.Tensor], config: dict, reciprocal=False) -> dict[str, tuple]:
    """TUNED as DeepSeek-V3 / Qwen3-FP8 store it: target weights F8_E4M3 + ``weight_scale_inv``, the rest as is."""
    root.mkdir()
    out, codes = {}, {}
    for name, w in tensors.items():
        if is_target(name):
            q, s = quantize(w, reciprocal=reciprocal)
            out[name], out[name + "_scale_inv"] = q, s
            codes[name[: -len(".weight")]] = (q, s)
        else:
            out[name] = w
    save_file(out, str(root / "model.safetensors"))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return codes


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa16") / "base"
    write_llama_like(root, layers=1, dtype=torch.float32, planted_fraction=0.15)
    return root


def base_tensors(base) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(base / "model.safetensors")), json.loads((base / "config.json").read_text())


# --------------------------------------------------------------------------- 1. --json carries the rounding note
def test_json_says_when_tuned_is_stored_coarser_than_base(base, tmp_path):
    """A bf16 copy of the fp32 BASE (no update): every record says base_rounded_to 'bfloat16' and its rounding
    floor ||bf16(W) - W||_F (the human output's note, structured); a same-dtype fine-tune's records have neither
    key."""
    tensors, config = base_tensors(base)
    (tmp_path / "bf16").mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(tmp_path / "bf16" / "model.safetensors"))
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    records = audit_json(base, tmp_path / "bf16", "--r", R)
    assert len(records) == 7
    for rec in records:
        assert list(rec) == list(AUDIT_KEYS + ROUNDING_KEYS)
        w = tensors[rec["module"] + ".weight"].double()
        floor = float(torch.linalg.vector_norm(w.to(torch.bfloat16).double() - w))
        assert rec["delta_norm"] == 0.0 and rec["base_rounded_to"] == "bfloat16", rec
        assert rec["rounding_floor"] == pytest.approx(floor, rel=1e-6) and floor > 0

    (tmp_path / "ft").mkdir()
    gen = torch.Generator().manual_seed(3)
    tuned = {k: (v + 1e-3 * torch.randn(v.shape, generator=gen) if is_target(k) else v) for k, v in tensors.items()}
    save_file(tuned, str(tmp_path / "ft" / "model.safetensors"))
    (tmp_path / "ft" / "config.json").write_text(json.dumps(config))
    for rec in audit_json(base, tmp_path / "ft", "--r", R):  # the keys of session 15, no rounding keys
        assert rec["delta_norm"] > 0 and list(rec) == list(AUDIT_KEYS), rec


# --------------------------------------------------------------------------- 2. FP8 TUNED
def test_half_step_rule_by_hand():
    """e4m3 at scale 0.5 (grid step 0.0625 in [0.5, 1), 0.03125 in [0.25, 0.5)): a tie TUNED rounded either way
    is rounding; one step beyond it is an update of exactly one step; at a binade edge the finer step counts."""
    from plate_inspect.auditing import rounding_reference

    scale = torch.tensor(0.5)
    # scaled units (value / 0.5): BASE 1.0625 is a tie (RNE: 1.0), 0.97 rounds to 1.0, 6.0 and 1.0 are on the grid
    base = torch.tensor([0.53125, 0.53125, 0.485, 0.485, 3.0, 0.5])
    tuned = torch.tensor([0.5625, 0.625, 0.5, 0.46875, 3.0, 0.46875])
    ref = rounding_reference(base, tuned, E4M3, scale)
    # 1.125: the tie rounded up, rounding; 1.25: one step past round(BASE) = 1.0; 0.9375 is 0.0325 from 0.97, more
    # than half of its binade's step 0.0625; 0.9375 against BASE 1.0: the finer step below the edge decides
    assert ref.tolist() == [0.5625, 0.5, 0.5, 0.5, 3.0, 0.5]
    assert (tuned - ref).tolist() == [0.0, 0.125, 0.0, -0.03125, 0.0, -0.03125]


@pytest.mark.parametrize("reciprocal", [False, True])
@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_copy_of_base_is_no_update(base, tmp_path, reciprocal, base_dtype):
    """BASE quantized to FP8 e4m3 with 32x32 block scales (both quantizer conventions; an fp32 and a bf16 BASE):
    no update beyond the quantization error. Before: every module 'changed', ||dW|| = the quantization error."""
    tensors, config = base_tensors(base)
    if base_dtype == torch.bfloat16:
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
        save_file(tensors, str(tmp_path / "b16.safetensors"))
        (tmp_path / "b16").mkdir()
        (tmp_path / "b16.safetensors").rename(tmp_path / "b16" / "model.safetensors")
        (tmp_path / "b16" / "config.json").write_text(json.dumps(config))
        base = tmp_path / "b16"
    codes = write_fp8(tmp_path / "fp8", tensors, config, reciprocal)
    records = audit(base, tmp_path / "fp8", r=R, tau=TAU, precision="float64")
    assert len(records) == 7
    for rec in records:
        w = tensors[rec.module + ".weight"].double().numpy()
        floor = float(np.linalg.norm(dequantize(*codes[rec.module]) - w))
        assert rec.delta_norm == 0.0 and rec.base_rounded_to == "float8_e4m3fn", rec
        assert rec.rounding_floor == pytest.approx(floor, rel=1e-6) and floor > 1e-3 * rec.weight_norm
    html = audit_section(records)
    assert "No update beyond FP8 quantization error" in html and "Note: TUNED stores 7 modules in float8_e4m3fn" in html
    res = CliRunner().invoke(cli, ["audit", str(base), str(tmp_path / "fp8"), "--r", str(R), "-q"])
    assert res.exit_code == 0, res.output
    assert "model: 0/7 modules changed: no update beyond FP8 quantization error" in res.output, res.output
    assert "note: TUNED stores 7 modules in float8_e4m3fn" in res.output and "at TUNED's own FP8 scales" in res.output
    records = audit_json(base, tmp_path / "fp8", "--r", R)
    assert {(r["delta_norm"], r["base_rounded_to"]) for r in records} == {(0.0, "float8_e4m3fn")}


def test_an_fp8_fine_tune_scores_its_update(base, tmp_path):
    """A low-rank update on two modules, ~10x their FP8 quantization error, then FP8: exactly those two modules
    change; their scores equal the dense float64 oracle on dW = dequant(TUNED) - dequant(BASE quantized at TUNED's
    scales) and are close to the oracle on the planted update itself (the FP8 noise left is ~1/10 of it). Before,
    the five untouched modules 'changed' too (their quantization error)."""
    tensors, config = base_tensors(base)
    gen = torch.Generator().manual_seed(7)
    planted = {}
    tuned = dict(tensors)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        w = tensors[module + ".weight"]
        q, s = quantize(w)
        floor = float(np.linalg.norm(dequantize(q, s) - w.double().numpy()))
        u, v = torch.randn(w.shape[0], 2, generator=gen), torch.randn(2, w.shape[1], generator=gen)
        d = u @ v
        d *= 10 * floor / float(torch.linalg.vector_norm(d))
        planted[module] = d.double().numpy()
        tuned[module + ".weight"] = w + d
    codes = write_fp8(tmp_path / "fp8", tuned, config)
    records = {r.module: r for r in audit(base, tmp_path / "fp8", r=R, tau=TAU, precision="float64")}
    assert {m for m, r in records.items() if r.delta_norm > 0} == set(planted)
    assert all(r.base_rounded_to == "float8_e4m3fn" for r in records.values())
    for module, d in planted.items():
        rec = records[module]
        w = tensors[module + ".weight"].double().numpy()
        q, s = codes[module]
        rounded_base = dequantize((tensors[module + ".weight"] / expand(s, *w.shape)).to(E4M3), s)
        _, b, _, _, _ = dense_oracle(w, r=R, tau=TAU, max_rank=512)  # B as the scan chooses it, by definition
        exact = oracle_scores(w, dequantize(q, s) - rounded_base, b, TAU)
        near = oracle_scores(w, d, b, TAU)
        for key, want in exact.items():
            assert getattr(rec, key) == pytest.approx(want, rel=1e-6, abs=1e-9), (module, key)
        assert rec.delta_norm == pytest.approx(near["delta_norm"], rel=0.05)
        assert rec.protected_input_share == pytest.approx(near["protected_input_share"], abs=0.03)
        assert rec.frozen_row_share == pytest.approx(near["frozen_row_share"], abs=0.03)
        assert rec.rounding_floor == pytest.approx(float(np.linalg.norm(rounded_base - w)), rel=1e-6)


def test_fp8_expert_stacks_use_each_experts_block_scales(tmp_path):
    """gpt-oss layout (3-D [E, d_in, d_out] stacks, audited expert by expert and transposed): FP8 with per-expert
    32x32 block scales. A copy is no update; an update of expert 1 alone changes that expert only, with the dense
    float64 oracle's scores on dequant(TUNED) - BASE rounded at that expert's own scales."""
    from plate_inspect.testing.synthetic import write_family

    ckpt = write_family(tmp_path / "base", "gpt_oss", layers=1, dtype=torch.float32)
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    stack = "model.layers.0.mlp.experts.gate_up_proj"

    def write(root, weights):
        root.mkdir()
        out, codes = {}, {}
        for name, w in weights.items():
            if name.endswith(("_proj", "_proj.weight")) and ".layers." in name:
                pairs = [quantize(e) for e in w] if w.ndim == 3 else [quantize(w)]
                q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
                out[name], out[name + "_scale_inv"] = (q, s) if w.ndim == 3 else (q[0], s[0])
                codes[name] = pairs
            else:
                out[name] = w
        save_file(out, str(root / "model.safetensors"))
        quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
        (root / "config.json").write_text(json.dumps({**ckpt.config, "quantization_config": quant}))
        return codes

    write(tmp_path / "copy", tensors)
    records = audit(ckpt.path, tmp_path / "copy", r=4, precision="float64")
    assert {f"{stack}.{e}" for e in range(3)} <= {r.module for r in records}
    assert all(r.delta_norm == 0.0 and r.base_rounded_to == "float8_e4m3fn" for r in records)

    tuned = dict(tensors)
    tuned[stack] = tensors[stack].clone()
    tuned[stack][1] += 0.05 * torch.randn(tuned[stack][1].shape, generator=torch.Generator().manual_seed(2))
    codes = write(tmp_path / "ft", tuned)
    records = {r.module: r for r in audit(ckpt.path, tmp_path / "ft", r=4, precision="float64")}
    assert {m for m, r in records.items() if r.delta_norm > 0} == {f"{stack}.1"}
    q, s = codes[stack][1]
    x = tensors[stack][1] / expand(s, *q.shape)
    w = tensors[stack][1].double().numpy()
    rounded_base = np.where(x.abs().numpy() <= 448, dequantize(x.to(E4M3), s), w)
    _, b, _, _, _ = dense_oracle(w.T, r=4, tau=TAU, max_rank=512)
    want = oracle_scores(w.T, (dequantize(q, s) - rounded_base).T, b, TAU)
    for key, value in want.items():
        assert getattr(records[f"{stack}.1"], key) == pytest.approx(value, rel=1e-6), key
