"""The default float32 scan is exact on hard spectra: checked against a dense float64 numpy oracle.

Exact means, for every module: tr(Q^T G Q) <= 1.01 x (sum of the k smallest eigenvalues of G) + 1e-6 x tr(G),
with G = W_f^T W_f in float64 from the stored weights, and k the definition on the exact spectrum.
Hard spectra: sigma_i ~ i^-alpha (alpha 0.5, 1, 2) with 4 directions 30x larger and near-duplicate rows,
stored in float32 and in bf16, in every shape class of an LLM layer; with -m slow also at the trust issue's
sizes and at Qwen2.5-7B sizes (gate 18944x3584, q/o 3584x3584), where the float32 Gram's rounding is largest.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_geometry import SEVEN_B_SHAPES, SHAPES, assert_exact, check_hard_case, exact_reference
from oracles import load_all
from safetensors.torch import load_file, save_file

import plate_inspect
from plate_inspect.geometry import plate_geometry
from plate_inspect.testing.synthetic import hard_spectrum_weight, write_llama_like

#: the trust issue's sizes (768-wide layers, k up to 512): the same grid, run with -m slow
LARGE_SHAPES = {"square": (768, 768), "tall": (2048, 768), "wide": (768, 2048), "gqa-kv": (128, 1024)}


@pytest.mark.parametrize("storage", ["float32", "bf16"])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_float32_geometry_is_exact_on_hard_spectra(shape, alpha, storage):
    check_hard_case(*SHAPES[shape], alpha, storage, "lapack")


@pytest.mark.parametrize("storage", ["float32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_torch_code_path_is_exact_too(shape, storage):
    # the path CUDA takes (torch.linalg.eigh, torch.geqrf/ormqr), run on CPU tensors
    check_hard_case(*SHAPES[shape], 1.0, storage, "torch")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["lapack", "torch"])
@pytest.mark.parametrize("storage", ["float32", "bf16"])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("shape", sorted(LARGE_SHAPES))
def test_exact_at_issue_sizes(shape, alpha, storage, backend):
    check_hard_case(*LARGE_SHAPES[shape], alpha, storage, backend)


@pytest.mark.slow
@pytest.mark.parametrize("orthogonal", [True, False])
@pytest.mark.parametrize("alpha", [0.5, 1.0])
@pytest.mark.parametrize("shape", sorted(SEVEN_B_SHAPES))
def test_exact_at_qwen_7b_sizes(shape, alpha, orthogonal):
    # the former float32-MRRR candidates (k + 256 of them) failed here: gate 18944x3584, alpha 0.5, Gaussian
    # factors captured 1.70x the optimum (1.64x the allowance)
    check_hard_case(*SEVEN_B_SHAPES[shape], alpha, "bf16", "lapack", orthogonal)


@pytest.mark.slow
@pytest.mark.parametrize("orthogonal", [True, False])
@pytest.mark.parametrize("shape", sorted(SEVEN_B_SHAPES))
def test_torch_code_path_exact_at_qwen_7b_sizes(shape, orthogonal):
    # the path CUDA takes (torch.linalg.eigh candidates), at alpha 0.5, where float32 eigensolvers fall short: with
    # float32 eigh candidates square-7b (Haar factors) captured 1.55x the allowance even after the second Ritz round
    # (gate-7b: 0.82x); float64 ones leave <= 0.01x
    check_hard_case(*SEVEN_B_SHAPES[shape], 0.5, "bf16", "torch", orthogonal)


def test_issue_example_square_layer_with_outliers():
    # the trust issue's case: 768x768, sigma_i ~ 1/i, 4 directions 30x larger, r=64, tau=0.9, max_rank=512;
    # the former float32 path captured ~60x the optimum here
    w = hard_spectrum_weight(768, 768, torch.Generator().manual_seed(0), alpha=1.0)
    geo = plate_geometry(w, 64, 0.9, 512)
    gram, evals, k, _ = exact_reference(w.double().numpy(), geo.b_idx.numpy(), 0.9, 512)
    q = geo.basis.q.double().numpy()
    assert geo.k == k == 512
    assert np.einsum("ij,ij->", q, gram @ q) <= 1.01 * evals[:k].sum() + 1e-6 * evals.sum()


def test_wide_null_space_q_is_null_to_rounding_on_ill_conditioned_rows():
    # down projection shape, sigma ~ i^-2 (condition number ~1e6): Q must still be orthogonal to every row
    w = hard_spectrum_weight(256, 1024, torch.Generator().manual_seed(1), alpha=2.0)
    geo = plate_geometry(w, 16, 0.9, 128)
    frozen = np.delete(w.double().numpy(), geo.b_idx.numpy(), axis=0)
    q = geo.basis.q.double().numpy()
    assert geo.k == 128
    assert np.linalg.norm(frozen @ q) ** 2 <= 1e-10 * np.linalg.norm(frozen) ** 2


def write_hard_qwen(out) -> dict[str, torch.Tensor]:
    """A one-layer bf16 Qwen2-layout checkpoint whose projections carry hard spectra; returns what was saved."""
    ckpt = write_llama_like(out, layers=1, hidden=256, intermediate=704, heads=4, kv_heads=1)
    path = ckpt.path / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(11)
    for i, name in enumerate(sorted(n for n in tensors if n.endswith("proj.weight"))):
        d_out, d_in = tensors[name].shape
        w = hard_spectrum_weight(d_out, d_in, gen, alpha=(0.5, 1.0, 2.0)[i % 3], duplicates=d_out // 16)
        tensors[name] = w.to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def test_default_scan_is_exact_module_by_module(tmp_path):
    write_hard_qwen(tmp_path / "model")
    bundle = plate_inspect.scan(tmp_path / "model", tmp_path / "bundle", r=64, tau=0.9, max_rank=128)
    assert bundle.settings.precision == "float32" and len(bundle) == 7
    stored = load_all(tmp_path / "model")  # safetensors' own loader, independent of plate_inspect
    for rec in bundle:
        w = stored[rec.name + ".weight"].double().numpy()
        b_idx = bundle.b_idx(rec.name).numpy()
        spectrum = bundle.spectrum(rec.name).double().numpy()
        captured = assert_exact(bundle.q(rec.name).numpy(), rec.k, spectrum, w, b_idx, 0.9, 128)
        assert rec.captured_energy == pytest.approx(captured, rel=1e-3, abs=1e-9)


def test_check_exactness_against_numpy_eigh():
    """verify's oracle on a hard layer: numpy's float64 bottom eigenvectors pass with ~0 of the allowance used;
    rounded to bf16 they pass through the rounding term; one top direction swapped in, or a random Q, fail."""
    from plate_inspect.geometry import random_orthonormal
    from plate_inspect.verification import check_exactness

    gen = torch.Generator().manual_seed(3)
    w = hard_spectrum_weight(96, 64, gen, alpha=1.0).double()
    b_idx = torch.tensor([3, 17, 40])
    keep = np.setdiff1d(np.arange(96), b_idx.numpy())
    wf = w.numpy()[keep]
    values, vectors = np.linalg.eigh(wf.T @ wf)
    k = 24
    exact = check_exactness(w, b_idx, torch.from_numpy(vectors[:, :k]))
    assert exact.ok and abs(exact.used) < 1e-3
    assert exact.optimum == pytest.approx(values[:k].sum(), rel=1e-9, abs=1e-12 * values.sum())
    rounded = check_exactness(w, b_idx, torch.from_numpy(vectors[:, :k]).to(torch.bfloat16))
    assert rounded.ok and rounded.rounding > 0
    bent = vectors[:, :k].copy()
    bent[:, 0] = vectors[:, -1]  # the top direction instead of the lowest
    assert not check_exactness(w, b_idx, torch.from_numpy(bent)).ok
    assert not check_exactness(w, b_idx, random_orthonormal(64, k, seed=1, dtype=torch.float64)).ok
    wide = hard_spectrum_weight(40, 64, gen, alpha=1.0).double()  # n_f = 37 < d_in: 27 null directions first
    values, vectors = np.linalg.eigh(wide.numpy()[3:].T @ wide.numpy()[3:])
    null_and_more = check_exactness(wide, torch.tensor([0, 1, 2]), torch.from_numpy(vectors[:, :30]))
    assert null_and_more.ok and null_and_more.optimum == pytest.approx(values[:30].clip(0).sum(), abs=1e-9)


def test_verify_exact_flags_a_q_that_is_not_the_bottom_eigenspace(tmp_path):
    """A Q swapped between two modules, with the manifest's digests made to match (what a buggy writer could
    produce): every structure and digest check passes, the dense oracle does not."""
    import json

    from plate_inspect.bundle import geometry_digest

    write_hard_qwen(tmp_path / "model")
    out = tmp_path / "bundle"
    bundle = plate_inspect.scan(tmp_path / "model", out, r=64, tau=0.9, max_rank=128)
    report = plate_inspect.verify(bundle, tmp_path / "model", exact=True)
    assert report.ok, report.problems
    assert set(report.exactness) == set(bundle.modules) and max(c.used for c in report.exactness.values()) <= 1
    a, b = "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"
    assert bundle.q(a).shape == bundle.q(b).shape
    part = out / bundle.record(a).file
    # copies: safetensors < 0.8 hands out tensors that alias the file, which save_file below overwrites in place
    tensors = {key: t.clone() for key, t in load_file(str(part)).items()}
    from safetensors import safe_open

    with safe_open(str(part), framework="pt") as f:
        meta = f.metadata()
    tensors[f"{a}.plate_Q"], tensors[f"{b}.plate_Q"] = tensors[f"{b}.plate_Q"], tensors[f"{a}.plate_Q"]
    save_file(tensors, str(part), metadata=meta)
    manifest = json.loads((out / "manifest.json").read_text())
    for name in (a, b):
        digest = geometry_digest(tensors[f"{name}.plate_B_idx"], tensors[f"{name}.plate_Q"])
        manifest["modules"][name]["geometry_digest"] = digest
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert plate_inspect.verify(out, tmp_path / "model").ok  # structure, digests, fingerprints: all fine
    problems = plate_inspect.verify(out, tmp_path / "model", exact=True).problems
    assert len(problems) == 2 and all("not the bottom-" in p for p in problems), problems
