"""Weights so small that their float32 Gram matrices underflow: refused with the hint to --precision float64, which
holds them. The overflow side was refused already; the underflow side read as a zero matrix (every input direction
carrying no energy, k = d_in) with no word of its own.

The weights are a model's scaled by 2**-100 (~7.9e-31): exact in bf16, so the scaled model's geometry must be the
unscaled one's. Oracle: the dense float64 definition (tests/oracles.dense_oracle) on the unscaled weights.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from helpers_cli import assert_user_error, run_cli
from oracles import dense_oracle
from safetensors.torch import load_file, save_file

from plate_inspect import Bundle
from plate_inspect.testing.synthetic import write_llama_like

R, TAU, MAX_RANK = 8, 0.9, 512
SCALE = 2.0**-100


def _scaled_model(tmp_path, scale: float = SCALE):
    model = write_llama_like(tmp_path / "m", layers=1).path
    tensors = load_file(model / "model.safetensors")
    original = dict(tensors)
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            tensors[name] = (t.double() * scale).to(t.dtype)
            assert torch.equal(tensors[name].double() / scale, t.double())  # a power of two: exact in bf16
    save_file(tensors, str(model / "model.safetensors"))
    return model, original


def test_float32_refuses_weights_whose_gram_would_underflow(tmp_path):
    model, original = _scaled_model(tmp_path)
    first = "model.layers.0.mlp.down_proj.weight"  # the first weight the scan reads
    largest = float(original[first].double().abs().max()) * SCALE
    assert_user_error(
        ["scan", model, "--out", tmp_path / "b", "--r", R, "-q"],
        f"model.safetensors: tensor '{first}' has values of at most {largest:.3g}, too small for float32 Gram matrices",
        "underflow",
        "scan with --precision float64",
    )


def test_float64_gives_the_geometry_of_the_unscaled_weights(tmp_path):
    """What the refusal's hint promises: --precision float64 scans the tiny weights as if they were unscaled."""
    model, original = _scaled_model(tmp_path)
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "--r", R, "--precision", "float64", "-q")
    assert code == 0, output
    bundle = Bundle.load(tmp_path / "b")
    assert len(bundle) == 7
    for rec in bundle:
        w = original[f"{rec.name}.weight"].double().numpy()
        _, b, evals, k, gram = dense_oracle(w, R, TAU, MAX_RANK)
        assert bundle.b_idx(rec.name).tolist() == b.tolist(), rec.name
        assert rec.k == k, rec.name
        q = bundle.q(rec.name, dtype=torch.float64).numpy()
        # Q spans the bottom-k eigenspace of the unscaled W_f^T W_f: its energy is the k smallest eigenvalues' sum
        frozen = np.delete(w, b, axis=0)
        energy, bottom = np.trace(q.T @ (frozen.T @ frozen) @ q), np.linalg.eigvalsh(frozen.T @ frozen)[:k].sum()
        assert abs(energy - bottom) <= 1e-6 * evals.max(), rec.name  # 1e-6: Q is stored as float32


def test_small_but_representable_weights_are_scanned_in_float32(tmp_path):
    """The refusal is for underflow only: weights of 1e-15 (Gram entries ~1e-31, normal float32) scan as before."""
    model, _ = _scaled_model(tmp_path, 2.0**-50)
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "--r", R, "-q")
    assert code == 0, output
    modules = json.loads((tmp_path / "b" / "manifest.json").read_text())["modules"]
    assert all(m["k"] < m["shape"][1] for m in modules.values())  # energy seen: not the zero-matrix reading
