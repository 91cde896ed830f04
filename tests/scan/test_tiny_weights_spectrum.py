"""--precision float64 on weights scaled by 2**-100 must record the unscaled model's numbers scaled by 2**-200: the
spectrum, total energy and k(tau) curve too, not only k, B and Q. Their eigenvalues (~1e-60) are below float32's
range, so a spectrum kept or stored in float32 reads as zero: every k(tau) at the rank cap, a zero total energy,
zero health metrics and a note calling the modules all zero. Oracle: the same scan of the unscaled weights (the
geometry is scale-free; 2**-100 is exact in bf16) and the dense float64 definition."""

from __future__ import annotations

import json

import numpy as np
import torch
from helpers_cli import run_cli
from oracles import dense_oracle
from safetensors.torch import load_file, save_file

from plate_inspect import Bundle
from plate_inspect.testing.synthetic import write_llama_like

R, TAU, MAX_RANK = 8, 0.9, 512
SCALE = 2.0**-100


def test_float64_scan_of_tiny_weights_records_their_spectrum(tmp_path):
    model = write_llama_like(tmp_path / "m", layers=1).path
    code, output = run_cli("scan", model, "--out", tmp_path / "ref", "--r", R, "--precision", "float64", "-q")
    assert code == 0, output
    tensors = load_file(model / "model.safetensors")
    original = dict(tensors)
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            tensors[name] = (t.double() * SCALE).to(t.dtype)
    save_file(tensors, str(model / "model.safetensors"))
    code, output = run_cli("scan", model, "--out", tmp_path / "tiny", "--r", R, "--precision", "float64", "-q")
    assert code == 0, output
    assert "all zero" not in output, output
    ref = json.loads((tmp_path / "ref" / "manifest.json").read_text())["modules"]
    tiny = json.loads((tmp_path / "tiny" / "manifest.json").read_text())["modules"]
    ref_bundle, tiny_bundle = Bundle.load(tmp_path / "ref"), Bundle.load(tmp_path / "tiny")
    assert len(tiny) == 7
    for name, rec in tiny.items():
        w = original[f"{name}.weight"].double().numpy()
        _, _, evals, k, _ = dense_oracle(w, R, TAU, MAX_RANK)
        assert rec["k"] == k and rec["k_by_tau"] == ref[name]["k_by_tau"], name
        assert rec["k_by_tau"][f"{TAU:g}"] == rec["k"], name
        np.testing.assert_allclose(rec["total_energy"] / SCALE**2, evals.sum(), rtol=1e-10, err_msg=name)
        spectrum = tiny_bundle.spectrum(name).double() / SCALE**2
        torch.testing.assert_close(spectrum, ref_bundle.spectrum(name).double(), rtol=1e-10, atol=0)
        top = np.sort(evals)[::-1][: spectrum.numel()]
        np.testing.assert_allclose(spectrum.numpy(), top, rtol=1e-9, atol=1e-12 * top[0], err_msg=name)
        assert rec["health"]["stable_rank"] == ref[name]["health"]["stable_rank"] > 1, name
