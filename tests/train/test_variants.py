"""Ablation bundles: same r and k as PLATE, only the intended factor changed, each checked against an oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_train import BACKBONE, digits_bundle, digits_checkpoint, load_digits

from plate_inspect.bundle import Bundle
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.train.layer import apply_bundle
from plate_inspect.train.variants import VARIANTS, make_variant, make_variants


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    _, ckpt = digits_checkpoint(root / "ckpt", seed=0, epochs=3)
    bundle = digits_bundle(ckpt, root / "bundle", r=32, tau=0.9)
    return ckpt, bundle, make_variants(bundle, ckpt, root / "v", seed=0)


def _projector(q: torch.Tensor) -> np.ndarray:
    q = q.double().numpy()
    return q @ q.T


def test_matched_capacity_and_what_changes(variants):
    ckpt, plate, vs = variants
    assert set(vs) == set(VARIANTS)
    model = load_digits(ckpt)
    for v, b in vs.items():
        assert Bundle.load(b.path).modules == plate.modules
        for m in BACKBONE:
            rec, prec = b.record(m), plate.record(m)
            assert (rec.r, rec.k, rec.variant) == (prec.r, prec.k, v)
            assert rec.fingerprint == prec.fingerprint
            bq, pq = b.q(m), plate.q(m)
            same_b = torch.equal(b.b_idx(m), plate.b_idx(m))
            same_q = torch.equal(bq, pq)
            assert (same_b, same_q) == {
                "random_b": (False, True),
                "least_redundant_b": (False, True),
                "random_q": (True, False),
                "high_energy_q": (True, False),
                "random_bq": (False, False),
            }[v], (v, m)
            torch.testing.assert_close(bq.T @ bq, torch.eye(rec.k), rtol=0, atol=1e-5)  # orthonormal k-frame
            assert torch.unique(b.b_idx(m)).numel() == rec.r
        # the same trainer path: apply_bundle accepts the variant (fingerprints match) with PLATE's parameter count
        params = apply_bundle(load_digits(ckpt), b)
        assert sum(p.numel() for p in params) == sum(plate.record(m).r * plate.record(m).k for m in BACKBONE)
    del model


def test_least_redundant_and_high_energy_against_numpy(variants):
    ckpt, plate, vs = variants
    model = load_digits(ckpt)
    checked = 0
    for m in BACKBONE:
        scores = plate.redundancy(m).double().numpy()
        r = plate.record(m).r
        oracle_b = np.sort(np.argsort(scores, kind="stable")[:r])
        assert np.array_equal(vs["least_redundant_b"].b_idx(m).numpy(), oracle_b)
        assert set(oracle_b).isdisjoint(set(plate.b_idx(m).tolist()))  # opposite ends of the score ranking
        w = model.get_submodule(m).weight.detach().double().numpy()
        keep = np.ones(w.shape[0], dtype=bool)
        keep[plate.b_idx(m).numpy()] = False
        evals, evecs = np.linalg.eigh(w[keep].T @ w[keep])
        k = plate.record(m).k
        top = evecs[:, ::-1][:, :k]
        if k < len(evals) and evals[::-1][k - 1] - evals[::-1][k] > 1e-6 * evals.max():
            np.testing.assert_allclose(_projector(vs["high_energy_q"].q(m)), top @ top.T, atol=1e-4)
            checked += 1
        g = w[keep].T @ w[keep]
        energy = {v: float(np.trace(vs[v].q(m).double().numpy().T @ g @ vs[v].q(m).double().numpy())) for v in vs}
        plate_energy = float(np.trace(plate.q(m).double().numpy().T @ g @ plate.q(m).double().numpy()))
        assert energy["high_energy_q"] > energy["random_q"] > plate_energy  # top > random > PLATE's bottom-k
        np.testing.assert_allclose(
            vs["high_energy_q"].record(m).captured_energy, energy["high_energy_q"] / np.trace(g), rtol=1e-4
        )
    assert checked >= 2  # the top-k subspace is well defined (eigengap) for most layers


def test_variant_refusals(variants, tmp_path):
    ckpt, plate, _ = variants
    with pytest.raises(ConfigError, match="unknown variant"):
        make_variant(plate, ckpt, "random_x", tmp_path / "x")
    _, other = digits_checkpoint(tmp_path / "o", seed=5)
    with pytest.raises(BundleError, match="other weights"):
        make_variant(plate, other, "random_q", tmp_path / "y")
    assert not (tmp_path / "y").exists()  # refused before the output directory is made
    a = make_variant(plate, ckpt, "random_q", tmp_path / "s1", seed=1)
    b = make_variant(plate, ckpt, "random_q", tmp_path / "s1b", seed=1)
    c = make_variant(plate, ckpt, "random_q", tmp_path / "s2", seed=2)
    assert torch.equal(a.q("fc2"), b.q("fc2")) and not torch.equal(a.q("fc2"), c.q("fc2"))


def test_variant_identity_refuses_another_kind_seed_or_base(variants, tmp_path):
    ckpt, plate, _ = variants
    out = tmp_path / "v"
    first = make_variant(plate, ckpt, "random_q", out, seed=1)
    assert first.manifest.variant == {"kind": "random_q", "seed": 1, "base_identity": plate.manifest.identity}
    assert first.manifest.identity not in ("", plate.manifest.identity)
    q_before = (out / first.record("fc2").file).stat().st_ino
    again = make_variant(plate, ckpt, "random_q", out, seed=1)  # the same ablation: kept as is
    assert (out / first.record("fc2").file).stat().st_ino == q_before
    assert again.manifest.to_json() == first.manifest.to_json()
    # make_variant has no CLI command: its hints name the Python keywords only (they said "(CLI: --overwrite) ...
    # (CLI: --out)")
    python_hint = r"; replace it with overwrite=True, or write elsewhere \(another out\)$"
    with pytest.raises(BundleError, match="seed 1.*" + python_hint) as refused:
        make_variant(plate, ckpt, "random_q", out, seed=2)
    assert "CLI" not in str(refused.value) and "--" not in str(refused.value)
    with pytest.raises(BundleError, match="random_q ablation.*" + python_hint):
        make_variant(plate, ckpt, "random_b", out, seed=1)
    rebuilt = make_variant(plate, ckpt, "random_b", out, seed=1, overwrite=True)
    assert rebuilt.manifest.variant["kind"] == "random_b" and {r.variant for r in rebuilt} == {"random_b"}
    fresh = make_variant(plate, ckpt, "random_b", tmp_path / "fresh", seed=1)
    for p in fresh.path.glob("*.safetensors"):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    # a scanned bundle's directory is not an ablation's, and the other way round
    with pytest.raises(BundleError, match="a scanned bundle.*" + python_hint):
        make_variant(plate, ckpt, "random_q", plate.path, seed=1)
    # a directory holding a model's weights: refused even with overwrite, in the same words
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes((out / first.record("fc2").file).read_bytes())
    with pytest.raises(BundleError, match=r"even with overwrite=True; write elsewhere \(another out\)$"):
        make_variant(plate, ckpt, "random_q", model_dir, seed=1, overwrite=True)


def test_variant_of_a_rebuilt_base_bundle_is_refused(variants, tmp_path):
    ckpt, plate, _ = variants
    out = tmp_path / "v"
    make_variant(plate, ckpt, "random_q", out, seed=0)
    other_base = digits_bundle(ckpt, tmp_path / "base2", r=16, tau=0.9)
    with pytest.raises(BundleError, match="of bundle sha256:"):
        make_variant(other_base, ckpt, "random_q", out, seed=0)


def test_info_of_an_ablation_bundle_says_what_it_derives_from(variants):
    """`info` printed 'scan: 0.0 s, read 0 B, ... computed 0 of 0 modules' for a bundle no scan made."""
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli

    _, bundle, vs = variants
    result = CliRunner().invoke(cli, ["info", str(vs["random_b"].path)])
    assert result.exit_code == 0, result.output
    assert f"ablation bundle: random_b (seed 0) of {bundle.path.resolve()}" in result.output
    assert "scan: 0.0 s" not in result.output and "computed 0 of 0" not in result.output
