"""FP8 and MXFP4 storage dequantized exactly on read, checked against decoders written from the format definitions.

The oracles (tests/oracles.py) decode bits with numpy (OCP FP8: E4M3 bias 7, NaN only at S.1111.111; E5M2 bias 15,
IEEE-like; OCP MX v1.0: FP4 E2M1 bias 1, E8M0 scale 2^(x-127), 255 = NaN), multiply in float64 (exact: a 4-bit and
a 24-bit significand fit in 53 bits) and round once to float32: what an exact float32 dequantization must return.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from oracles import block_oracle, decode_e4m3, decode_e5m2, decode_e8m0, fp8_oracle, mxfp4_oracle, stored_bytes

import plate_inspect
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.errors import CheckpointError, CorruptCheckpointError, UnsupportedWeightError
from plate_inspect.testing.quantized import (
    fp8_config,
    fp8_tensors,
    mxfp4_config,
    mxfp4_tensors,
    write_safetensors,
)


def assert_same(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    np.testing.assert_array_equal(got.numpy(), want)  # NaN == NaN here; everything else bit-exact


# --------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("fmt, torch_dtype", [("F8_E4M3", torch.float8_e4m3fn), ("F8_E5M2", torch.float8_e5m2)])
def test_every_fp8_code_with_a_per_tensor_scale(tmp_path, fmt, torch_dtype):
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    scale = torch.tensor(0.0371, dtype=torch.float32)
    tensors = {"w.weight": codes.view(torch_dtype), "w.weight_scale_inv": scale}
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, {"quantization_config": {"quant_method": "fp8"}}))
    got, _ = ckpt.read_weight("w.weight")
    assert_same(got, (fp8_oracle(codes.numpy(), fmt) * np.float64(scale.item())).astype(np.float32))


def test_fp8_without_scale_reads_the_fp8_values(tmp_path):
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    ckpt = Checkpoint.open(write_safetensors(tmp_path, {"w": codes.view(torch.float8_e4m3fn)}))
    got, _ = ckpt.read_weight("w")
    assert_same(got, decode_e4m3(codes.numpy()).astype(np.float32))


@pytest.mark.parametrize("how", ["scales beside other fp8 weights", "quantization_config"])
def test_fp8_weight_missing_its_scale_in_a_scaled_checkpoint_is_refused(tmp_path, how):
    """In a scaled checkpoint a missing scale is damage: read as codes the weight is off by the scale (QA: 448
    instead of ~0.1, B and Q wrong, exit 0). Reading it, or its fingerprint, names the missing tensor."""
    g = torch.Generator().manual_seed(0)
    tensors = fp8_tensors({"a.weight": torch.randn(16, 16, generator=g), "b.weight": torch.randn(16, 16, generator=g)})
    del tensors["b.weight_scale_inv"]
    if how == "quantization_config":
        del tensors["a.weight"], tensors["a.weight_scale_inv"]
    config = fp8_config(None) if how == "quantization_config" else None
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, config))
    for read in (ckpt.read_weight, ckpt.weight_fingerprint):
        with pytest.raises(CorruptCheckpointError, match=r"'b\.weight' has no scale tensor \('b\.weight_scale_inv'"):
            read("b.weight")
    if how != "quantization_config":  # the intact weight still reads
        got, _ = ckpt.read_weight("a.weight")
        assert got.abs().max() < 10


#: Corrupt scales: (where, value) planted into an otherwise sound 2 x 2 block grid, and what the message counts.
BAD_SCALES = {
    "one zero block": ([(0, 1)], 0.0, r"1 zero of 4 scales \(first at \[0, 1\] = 0\.0\)"),
    "all zero": ([(0, 0), (0, 1), (1, 0), (1, 1)], 0.0, r"4 zero of 4 scales \(all zero: .*\) \(first at \[0, 0\]"),
    "negative zero": ([(1, 1)], -0.0, r"1 zero of 4 scales \(first at \[1, 1\] = -0\.0\)"),
    "negative": ([(1, 0)], -0.004, r"1 negative of 4 scales \(first at \[1, 0\] = -0\.004"),
    "NaN": ([(1, 1)], float("nan"), r"1 NaN of 4 scales \(first at \[1, 1\] = nan\)"),
    "+inf and NaN": ([(0, 1), (1, 1)], float("inf"), r"1 infinite of 4 scales \(first at \[0, 1\] = inf\)"),
    "-inf": ([(1, 0)], float("-inf"), r"1 infinite of 4 scales \(first at \[1, 0\] = -inf\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCALES))
def test_fp8_corrupt_block_scales_are_refused_naming_file_tensor_and_block(tmp_path, case):
    """A scale is amax / FP8 max: finite and > 0 (transformers' FP8 quantizer writes 1.0 for an all-zero block,
    llm-compressor and fbgemm clamp to a positive minimum, UE8M0 has no sign bit). NaN, infinite, zero and negative
    scales are damage: refused on read with one line naming the file, the scale tensor, the weight, the first bad
    block and what to do (QA: a negative scale decoded silently to a block with its sign flipped)."""
    where, value, counted = BAD_SCALES[case]
    tensors = fp8_tensors({"m.weight": torch.randn(32, 32, generator=torch.Generator().manual_seed(0))}, block=(16, 16))
    for i, j in where:
        tensors["m.weight_scale_inv"][i, j] = value
    if case == "+inf and NaN":
        tensors["m.weight_scale_inv"][1, 1] = float("nan")
        counted = r"1 NaN, 1 infinite of 4 scales \(first at \[0, 1\] = inf\)"
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, fp8_config((16, 16))))
    with pytest.raises(CorruptCheckpointError) as err:
        ckpt.read_weight("m.weight")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.safetensors: tensor 'm.weight_scale_inv' (scale of 'm.weight') holds ")
    assert re.search(counted, message), message
    assert message.endswith("the file is damaged; re-download it")


def test_fp8_corrupt_scales_per_tensor_per_row_and_per_expert(tmp_path):
    """The same check for every scale layout; an expert read checks its own scales only (a sound expert still reads,
    to the hand-computed decode), and the message names the expert and the scale's index in the stored tensor."""
    codes = torch.randint(0, 120, (3, 8, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    grid = torch.rand(3, 1, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float32) + 0.5
    grid[2, 0, 1] = -grid[2, 0, 1]
    tensors = {
        "scalar.weight": codes[0].clone().view(torch.float8_e4m3fn),
        "scalar.weight_scale_inv": torch.tensor(-0.5),
        "row.weight": codes[1].clone().view(torch.float8_e4m3fn),
        "row.weight_scale_inv": torch.tensor([[1.0]] * 7 + [[float("nan")]]),
        "experts.w": codes.view(torch.float8_e4m3fn),
        "experts.w_scale_inv": grid,
    }
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, fp8_config((8, 16))))
    with pytest.raises(CorruptCheckpointError, match=r"'scalar.weight_scale_inv' \(scale of 'scalar.weight'\) holds "
                       r"1 negative of 1 scale \(-0.5\): FP8 scales are positive"):  # fmt: skip
        ckpt.read_weight("scalar.weight")
    with pytest.raises(CorruptCheckpointError, match=r"holds 1 NaN of 8 scales \(first at \[7, 0\] = nan\)"):
        ckpt.read_weight("row.weight")
    with pytest.raises(CorruptCheckpointError, match=r"\(scale of 'experts.w', expert 2\) holds 1 negative of 2 "
                       r"scales \(first at \[2, 0, 1\] = -"):  # fmt: skip
        ckpt.read_weight("experts.w", expert=2)
    with pytest.raises(CorruptCheckpointError, match=r"holds 1 negative of 6 scales \(first at \[2, 0, 1\]"):
        ckpt.read_weight("experts.w")
    got, _ = ckpt.read_weight("experts.w", expert=1)
    assert_same(got, block_oracle(decode_e4m3(codes[1].numpy()), grid[1].double().numpy(), (8, 16)))


def test_fp8_ue8m0_and_f64_scales_against_the_float64_decode(tmp_path):
    """transformers' fine-grained FP8 accepts UE8M0 (F8_E8M0: 2^(code - 127), unsigned) scale grids; an F64 scale is
    applied in float64 and rounded once (rounded to float32 first, products differ in the last bit). Code 255 is
    UE8M0's NaN: refused like any NaN scale."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (24, 40), generator=gen, dtype=torch.uint8)
    codes[codes == 0x7F] = 0x7E  # E4M3's NaN codes aside: the scale is under test
    codes[codes == 0xFF] = 0xFE
    e8m0 = torch.randint(110, 140, (2, 3), generator=gen, dtype=torch.uint8)
    f64 = torch.rand(2, 3, generator=gen, dtype=torch.float64) * 1e-3 + 1e-4
    tensors = {
        "a.weight": codes.view(torch.float8_e4m3fn),
        "a.weight_scale_inv": e8m0.view(torch.float8_e8m0fnu),
        "b.weight": codes.clone().view(torch.float8_e4m3fn),
        "b.weight_scale_inv": f64,
    }
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, fp8_config((16, 16))))
    values = decode_e4m3(codes.numpy())
    got, _ = ckpt.read_weight("a.weight")
    assert_same(got, block_oracle(values, decode_e8m0(e8m0.numpy()), (16, 16)))
    got, _ = ckpt.read_weight("b.weight")
    assert_same(got, block_oracle(values, f64.numpy(), (16, 16)))
    e8m0[1, 2] = 255
    tensors["a.weight_scale_inv"] = e8m0.view(torch.float8_e8m0fnu)
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, fp8_config((16, 16))))
    with pytest.raises(
        CorruptCheckpointError, match=r"'a.weight_scale_inv' .* holds 1 NaN of 6 scales \(first at \[1, 2\]"
    ):
        ckpt.read_weight("a.weight")


@pytest.mark.parametrize(
    ("scale", "error", "match"),
    [
        (torch.ones(2, 2, dtype=torch.int32), UnsupportedWeightError,
         r"is stored as I32; FP8 scales are F32/BF16/F16/F64 or F8_E8M0.*re-download the file, or scan the"),
        (torch.ones(2, 3), CorruptCheckpointError,
         r"scale grid \[2, 3\] does not match weight \[32, 32\] .*expected \[2, 2\]"),
        (torch.ones(33, 1), CorruptCheckpointError,
         r"scale grid \[33, 1\] does not match weight \[32, 32\] .*expected \[2, 2\]"),
        (torch.ones(31), CorruptCheckpointError, r"scale shape \[31\] does not fit weight \[32, 32\]; re-download"),
    ],
)  # fmt: skip
def test_fp8_scales_of_the_wrong_dtype_or_shape_are_refused(tmp_path, scale, error, match):
    tensors = fp8_tensors({"m.weight": torch.randn(32, 32)}, block=(16, 16))
    tensors["m.weight_scale_inv"] = scale
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, fp8_config((16, 16))))
    with pytest.raises(
        error, match=r"model.safetensors: tensor 'm.weight_scale_inv' \(scale of 'm.weight'\).*" + match
    ):
        ckpt.logical_weights()


def test_fp8_corrupt_scale_is_one_line_from_the_cli(tmp_path):
    """scan of a DeepSeek-V3-layout FP8 release with one negative block scale: exit code non-zero, one line naming the
    shard, the scale tensor and what to do, no traceback."""
    from click.testing import CliRunner
    from safetensors.torch import load_file, save_file

    from plate_inspect.cli.main import cli
    from plate_inspect.testing.synthetic import write_family

    path = write_family(tmp_path / "fp8", "deepseek_v3", fp8=True).path
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
    tensors[name] = -tensors[name]
    save_file(tensors, path / "model.safetensors")
    res = CliRunner().invoke(cli, ["scan", str(path), "-o", str(tmp_path / "b"), "--r", "4", "--max-rank", "8", "-q"])
    assert res.exit_code != 0
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.output, res.output
    assert f"error: model.safetensors: tensor '{name}'" in errors[0] and "1 negative" in errors[0], errors[0]
    assert errors[0].endswith("re-download it")


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((64, 48), (16, 32)), ((7, 130), (4, 128))])
def test_fp8_block_scales_with_partial_edge_blocks(tmp_path, shape, block):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen) * torch.linspace(0.01, 30, shape[1])
    tensors = fp8_tensors({"m.weight": w}, block=block)
    assert tensors["m.weight_scale_inv"].shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, fp8_config(block)))
    got, _ = ckpt.read_weight("m.weight")
    want = block_oracle(
        decode_e4m3(stored_bytes(tensors["m.weight"])), tensors["m.weight_scale_inv"].double().numpy(), block
    )
    assert_same(got, want)
    assert float((got - w).abs().max() / w.abs().max()) < 0.07  # and it is the weight, within FP8 precision


def test_fp8_per_row_scale(tmp_path):
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 126, (6, 10), generator=gen, dtype=torch.uint8)
    scale = torch.rand(6, 1, generator=gen) + 0.5
    ckpt = Checkpoint.open(
        write_safetensors(tmp_path, {"w.weight": codes.view(torch.float8_e5m2), "w.weight_scale": scale})
    )
    got, _ = ckpt.read_weight("w.weight")
    assert_same(got, (decode_e5m2(codes.numpy()) * scale.double().numpy()).astype(np.float32))
    assert ckpt.logical_weights()["w.weight"].block == (1, 10)


def test_fp8_experts_slice_reads_only_that_expert(tmp_path):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 40, 30, generator=gen)
    tensors = fp8_tensors({"experts.w1": w}, block=(16, 16))
    assert tensors["experts.w1_scale_inv"].shape == (4, 3, 2)
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, fp8_config((16, 16))))
    raw = decode_e4m3(stored_bytes(tensors["experts.w1"]))
    scale = tensors["experts.w1_scale_inv"].double().numpy()
    full, fp_full = ckpt.read_weight("experts.w1")
    assert_same(full, block_oracle(raw, scale, (16, 16)))
    before = ckpt.bytes_read
    e2, fp_e2 = ckpt.read_weight("experts.w1", expert=2)
    assert ckpt.bytes_read - before == 40 * 30 + 3 * 2 * 4  # that expert's FP8 bytes and its F32 scale grid only
    assert_same(e2, block_oracle(raw[2], scale[2], (16, 16)))
    assert fp_e2 != fp_full and fp_e2 == ckpt.weight_fingerprint("experts.w1", expert=2)
    with pytest.raises(CheckpointError, match="out of range"):
        ckpt.read_weight("experts.w1", expert=4)


def test_fp8_experts_with_one_shared_scale(tmp_path):
    codes = torch.randint(0, 120, (3, 5, 6), dtype=torch.uint8)
    tensors = {"e.w": codes.view(torch.float8_e4m3fn), "e.w_scale_inv": torch.tensor([0.25])}
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors))
    got, _ = ckpt.read_weight("e.w", expert=1)
    assert_same(got, (decode_e4m3(codes[1].numpy()) * 0.25).astype(np.float32))


def test_block_scales_need_the_block_size_from_config(tmp_path):
    tensors = fp8_tensors({"m.weight": torch.randn(40, 40)}, block=(16, 16))
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CorruptCheckpointError, match="weight_block_size"):
        ckpt.logical_weights()
    (tmp_path / "config.json").write_text(json.dumps(fp8_config((32, 16))))  # a grid that does not fit
    with pytest.raises(CorruptCheckpointError, match=r"expected \[2, 3\]"):
        Checkpoint.open(tmp_path).logical_weights()


# --------------------------------------------------------------------------- MXFP4
def random_mxfp4(shape_prefix: tuple[int, ...], groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape_prefix, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (*shape_prefix, groups), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_every_nibble_and_scale_edge_cases(tmp_path):
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 1, 16)  # every byte: every (low, high) nibble pair
    scales = torch.tensor([0, 1, 126, 127, 128, 200, 254, 255, 127, 127, 3, 250, 60, 90, 140, 255], dtype=torch.uint8)
    ckpt = Checkpoint.open(write_safetensors(tmp_path, mxfp4_tensors("p", blocks, scales.reshape(16, 1))))
    got, _ = ckpt.read_weight("p")
    assert_same(got, mxfp4_oracle(blocks.numpy(), scales.reshape(16, 1).numpy()))
    assert got[3, 0].item() == 0.0 and got[3, 2].item() == 0.5  # byte 0x01 at row 3 scale 2^0: low nibble first


def test_mxfp4_gpt_oss_layout_full_and_one_expert(tmp_path):
    blocks, scales = random_mxfp4((4, 24), groups=3, seed=5)  # experts=4, rows=24, 3 blocks of 32 per row
    tensors = {
        **mxfp4_tensors("model.layers.0.mlp.experts.gate_up_proj", blocks, scales),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.zeros(4, 24, dtype=torch.bfloat16),
    }
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, mxfp4_config(model_type="gpt_oss")))
    weights = ckpt.logical_weights()
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert set(weights) == {name, name + "_bias"}
    lw = weights[name]
    assert (lw.shape, lw.format, lw.stored_dtype) == ((4, 24, 96), "mxfp4", "MXFP4")
    assert lw.parts == (name + "_blocks", name + "_scales")
    want = mxfp4_oracle(blocks.numpy(), scales.numpy())
    full, _ = ckpt.read_weight(name)
    assert_same(full, want)
    before = ckpt.bytes_read
    e3, fp3 = ckpt.read_weight(name, expert=3)
    assert ckpt.bytes_read - before == 24 * 3 * 16 + 24 * 3
    assert_same(e3, want[3])
    assert fp3 == ckpt.weight_fingerprint(name, expert=3)
    with pytest.raises(CheckpointError, match="part of the quantized weight"):
        ckpt.read_weight(name + "_blocks")


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "no '.*_scales' tensor beside"),
        ("shape", r"has shape \[4, 24, 2\], the blocks .* need \[4, 24, 3\]"),
        ("scales dtype", "_scales' is stored as BF16; MXFP4 scales are U8"),
        ("blocks dtype", "_blocks' is stored as I8; MXFP4 blocks are U8"),
    ],
)
def test_mxfp4_with_missing_or_malformed_scales_is_refused_not_dropped(tmp_path, damage, message):
    """QA: such a weight fell out of the target list silently (17 of 20 modules, exit 0); now it stays a weight
    and reading it says what is wrong with which tensor."""
    blocks, scales = random_mxfp4((4, 24), groups=3, seed=6)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors = mxfp4_tensors(name, blocks, scales)
    if damage == "missing":
        del tensors[name + "_scales"]
    elif damage == "shape":
        tensors[name + "_scales"] = scales[..., :2].contiguous()
    elif damage == "scales dtype":
        tensors[name + "_scales"] = scales.to(torch.bfloat16)
    else:
        tensors[name + "_blocks"] = blocks.view(torch.int8)
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors, mxfp4_config(model_type="gpt_oss")))
    weight = ckpt.logical_weights()[name]
    assert weight.format == "mxfp4" and weight.shape == (4, 24, 96)
    for read in (ckpt.read_weight, ckpt.weight_fingerprint):
        with pytest.raises(CorruptCheckpointError, match=message):
            read(name)


# --------------------------------------------------------------------------- fingerprints and listing
def test_fingerprint_covers_weight_bytes_and_scales(tmp_path):
    w = torch.randn(32, 32)
    tensors = fp8_tensors({"m.weight": w}, block=(16, 16))
    fp = Checkpoint.open(write_safetensors(tmp_path / "a", tensors, fp8_config((16, 16)))).read_weight("m.weight")[1]
    scaled = dict(tensors, **{"m.weight_scale_inv": tensors["m.weight_scale_inv"] * 2})
    fp_scale = Checkpoint.open(write_safetensors(tmp_path / "b", scaled, fp8_config((16, 16)))).weight_fingerprint(
        "m.weight"
    )
    codes = stored_bytes(tensors["m.weight"])
    codes[0, 0] ^= 1
    flipped = dict(tensors, **{"m.weight": torch.from_numpy(codes).view(torch.float8_e4m3fn)})
    fp_bytes = Checkpoint.open(write_safetensors(tmp_path / "c", flipped, fp8_config((16, 16)))).weight_fingerprint(
        "m.weight"
    )
    assert len({fp, fp_scale, fp_bytes}) == 3


def test_logical_weights_hide_companions_and_keep_dense_fingerprints(tmp_path):
    dense = torch.randn(8, 8, dtype=torch.bfloat16)
    tensors = {"a.weight": dense, **fp8_tensors({"b.weight": torch.randn(8, 8)}, block=None)}
    ckpt = Checkpoint.open(write_safetensors(tmp_path, tensors))
    weights = ckpt.logical_weights()
    assert set(weights) == {"a.weight", "b.weight"}
    assert (weights["a.weight"].format, weights["b.weight"].format) == ("dense", "fp8")
    assert weights["b.weight"].parts == ("b.weight", "b.weight_scale_inv") and weights["b.weight"].block is None
    got, fp = ckpt.read_weight("a.weight")
    assert got.dtype == torch.bfloat16 and torch.equal(got, dense)
    import hashlib

    assert fp == "sha256:" + hashlib.sha256(stored_bytes(dense).tobytes()).hexdigest()


def _qwen_projections(root) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """A 1-layer Qwen2-shaped checkpoint's 7 projection weights, its other tensors, and its config."""
    from safetensors.torch import load_file

    from plate_inspect.testing.synthetic import write_llama_like

    src = write_llama_like(root / "src", layers=1)
    stored = {}
    for f in sorted(src.path.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    targets = {n: w for n, w in stored.items() if n.endswith("_proj.weight")}
    return targets, {n: w for n, w in stored.items() if n not in targets}, src.config


def _assert_scans_alike(root, quantized_dir, oracle: dict[str, torch.Tensor], others: dict, config: dict):
    """B, k and Q of a scan of ``quantized_dir`` equal those of a dense F32 copy of the oracle-decoded weights."""
    from plate_inspect.scanner import scan

    dense_dir = write_safetensors(root / "dense", {**others, **oracle}, config)
    got = scan(quantized_dir, root / "b_quantized", r=4, max_rank=40)
    want = scan(dense_dir, root / "b_dense", r=4, max_rank=40)
    assert len(got.manifest.modules) == len(want.manifest.modules) == len(oracle) == 7
    for name in want.manifest.modules:
        assert got.record(name).k == want.record(name).k
        assert torch.equal(got.b_idx(name), want.b_idx(name))
        assert torch.equal(got.q(name), want.q(name))
        assert got.record(name).dtype == "F8_E4M3"
    return got


def test_scan_of_fp8_checkpoint_equals_scan_of_its_oracle_dequantization(tmp_path):
    """B, k and Q from FP8 block-scaled storage equal those from a dense F32 copy of the oracle-decoded weights."""
    from plate_inspect.verification import verify

    targets, others, config = _qwen_projections(tmp_path)
    quantized = fp8_tensors({n: w.float() for n, w in targets.items()}, block=(16, 16))
    oracle = {
        n: torch.from_numpy(
            block_oracle(
                decode_e4m3(stored_bytes(quantized[n])), quantized[n + "_scale_inv"].double().numpy(), (16, 16)
            )
        )
        for n in targets
    }
    fp8_dir = write_safetensors(tmp_path / "fp8", {**others, **quantized}, fp8_config((16, 16), **config))
    got = _assert_scans_alike(tmp_path, fp8_dir, oracle, others, config)
    report = verify(got, fp8_dir)
    assert report.ok and report.modules_checked == 7, report.problems


def test_compressed_tensors_fp8_per_channel_scans_like_its_oracle_dequantization(tmp_path):
    """llm-compressor's FP8 "float-quantized" storage (F8_E4M3 codes, BF16 ``weight_scale`` [rows, 1]) under
    quant_method compressed-tensors: B, k and Q equal a scan of the oracle-decoded dense weights."""
    targets, others, config = _qwen_projections(tmp_path)
    quantized, oracle = {}, {}
    for name, w in targets.items():
        scale = (w.float().abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-12).to(torch.bfloat16)
        codes = (w.float() / scale.float()).to(torch.float8_e4m3fn)
        quantized[name], quantized[name.replace(".weight", ".weight_scale")] = codes, scale
        quantized[name.replace(".weight", ".input_scale")] = torch.ones(1)
        oracle[name] = torch.from_numpy((decode_e4m3(stored_bytes(codes)) * scale.double().numpy()).astype(np.float32))
    quant = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
        "ignore": ["lm_head"],
    }
    ct_dir = write_safetensors(tmp_path / "ct", {**others, **quantized}, {**config, "quantization_config": quant})
    _assert_scans_alike(tmp_path, ct_dir, oracle, others, config)


def test_sharded_fp8_release_with_scales_in_other_shards_scans_like_one_file(tmp_path):
    """A DeepSeek-V3-style FP8 release (128x128 block scales, partial edge blocks, MTP layer) split into shards
    whose boundaries fall between a weight and its weight_scale_inv reads exactly like the same tensors in one
    file: same identity (fingerprints of the same bytes), B, k and Q. Oracle for the sharding: the index itself."""
    from plate_inspect.testing.synthetic import write_family

    dims = dict(hidden_size=160, intermediate_size=136, moe_intermediate_size=24, q_lora_rank=144, kv_lora_rank=16)
    one = write_family(tmp_path / "one", "deepseek_v3", fp8=True, **dims).path
    sharded = write_family(tmp_path / "sharded", "deepseek_v3", fp8=True, max_shard_bytes=20_000, **dims).path
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    split = [
        n for n in weight_map if n.endswith("_scale_inv") and weight_map[n] != weight_map[n.removesuffix("_scale_inv")]
    ]
    assert len(set(weight_map.values())) > 3 and split  # the case under test exists
    settings = dict(r=4, max_rank=16, include_mtp=True)
    a = plate_inspect.scan(one, tmp_path / "a", **settings)
    b = plate_inspect.scan(sharded, tmp_path / "b", **settings)
    assert a.manifest.identity == b.manifest.identity and len(a) == len(b) > 40
    for name in (n.removesuffix(".weight_scale_inv") for n in split):
        assert torch.equal(a.b_idx(name), b.b_idx(name)) and torch.equal(a.q(name), b.q(name)), name
