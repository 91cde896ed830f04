"""Spectral health against weightwatcher itself (on the real MiniLM) and against hand-checkable spectra (tied top
eigenvalues, flat and rank-one spectra)."""

from __future__ import annotations

import json
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from plate_inspect.health import (
    fit_marchenko_pastur,
    fit_power_law,
    health_of_weight,
    health_record,
    matrix_entropy,
    spectral_norm,
    stable_rank,
    weight_spectrum,
)

#: Stated tolerance against weightwatcher 0.7.7: relative 1e-6 on every real-valued metric, counts exact.
REL = 1e-6
PAIRS = {  # weightwatcher column -> health_record key
    "alpha": "alpha",
    "xmin": "xmin",
    "D": "ks_distance",
    "alpha_weighted": "alpha_weighted",
    "spectral_norm": "spectral_norm",
    "stable_rank": "stable_rank",
    "entropy": "entropy",
    "mp_softrank": "mp_softrank",
}
COUNTS = {"num_pl_spikes": "num_pl_spikes", "num_spikes": "num_spikes"}


def weightwatcher_frame(weights: list[np.ndarray]):
    """weightwatcher.analyze (mp_fit=True) on a model made of Linear layers holding these weights."""
    import weightwatcher as ww

    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    model = nn.Sequential()
    for i, w in enumerate(weights):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w))
        model.add_module(f"l{i}", lin)
    return ww.WeightWatcher(model=model).analyze(mp_fit=True, randomize=False, plot=False)


def numpy_spectrum(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, np.float64)
    return np.linalg.eigvalsh(w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w)


MINILM_FAST = ["encoder.layer.0.attention.self.query.weight"]  # square: Q = 1, the quarter-circle MP fit
MINILM_SLOW = [  # tall and wide too (weightwatcher's fit of a 1536-wide layer takes ~10 s)
    "encoder.layer.0.attention.self.query.weight",
    "encoder.layer.2.attention.self.value.weight",
    "encoder.layer.4.intermediate.dense.weight",
    "encoder.layer.5.output.dense.weight",
]


def compare_with_weightwatcher(minilm_dir, names: list[str]) -> None:
    """Our metrics from two spectrum paths (numpy eigvalsh; ours) against weightwatcher's on the same weights."""
    tensors = load_file(str(minilm_dir / "model.safetensors"))
    weights = [tensors[n].float().numpy() for n in names]
    frame = weightwatcher_frame(weights)
    assert len(frame) == len(weights)
    for i, w in enumerate(weights):
        row = frame.iloc[i]
        for spectrum in (numpy_spectrum(w), weight_spectrum(torch.from_numpy(w).double())):
            mine = health_record(spectrum, w.shape, "W")
            for theirs, key in PAIRS.items():
                assert mine[key] == pytest.approx(float(row[theirs]), rel=REL), (names[i], key)
            for theirs, key in COUNTS.items():
                assert mine[key] == int(row[theirs]), (names[i], key)


def test_matches_weightwatcher_on_minilm(minilm_dir):
    compare_with_weightwatcher(minilm_dir, MINILM_FAST)


@pytest.mark.slow
def test_matches_weightwatcher_on_minilm_all_shapes(minilm_dir):
    compare_with_weightwatcher(minilm_dir, MINILM_SLOW)


def test_small_sample_fit_matches_weightwatcher():
    """Fewer than 20 eigenvalues: weightwatcher's bias-corrected small-N fit."""
    g = np.random.default_rng(0)
    w = (g.standard_normal((40, 14)) * np.linspace(3, 0.2, 14)).astype(np.float32)
    row = weightwatcher_frame([w]).iloc[0]
    mine = health_record(numpy_spectrum(w), w.shape, "W")
    for theirs, key in PAIRS.items():
        assert mine[key] == pytest.approx(float(row[theirs]), rel=REL), key
    assert mine["num_pl_spikes"] == int(row["num_pl_spikes"])


def test_hand_checkable_values():
    assert spectral_norm([1.0, 4.0, 1.0]) == 4.0
    assert stable_rank([4.0, 1.0, 1.0]) == 1.5
    assert matrix_entropy([1.0, 1.0, 1.0, 1.0], 4) == pytest.approx(1.0, abs=1e-8)  # flat: maximal
    assert matrix_entropy([1.0, 1.0, 0.0, 0.0], 4) == pytest.approx(1.0, abs=1e-6)  # normalised by log(rank = 2)
    assert matrix_entropy([3.0, 1.0, 0.0], 3) == pytest.approx(
        -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2)
    )
    # a Pareto(alpha=2.5) sample: the density x^-alpha, xmin = 1; the fit recovers alpha within its standard error
    g = np.random.default_rng(1)
    sample = (1 - g.random(4000)) ** (-1 / 1.5)
    fit = fit_power_law(sample)
    assert abs(fit.alpha - 2.5) < 4 * fit.sigma + 0.05
    assert fit.num_pl_spikes == int(np.sum(sample >= fit.xmin))


def _power_law_fit_by_definition(evals: np.ndarray) -> tuple[float, float, float]:
    """Clauset-Shalizi-Newman as the module docstring states it, one candidate xmin at a time (the oracle)."""
    data = np.sort(evals[evals > 1e-5])
    best = (math.inf, 0.0, 0.0)  # (KS distance, alpha, xmin)
    for i in range(len(data) - 1):
        tail = data[i:]
        alpha = 1.0 + len(tail) / float(np.sum(np.log(tail / data[i])))
        if not alpha > 1:
            continue
        fitted_cdf = 1.0 - (tail / data[i]) ** (1.0 - alpha)
        ks = float(np.max(np.abs(fitted_cdf - np.arange(len(tail)) / len(tail))))
        best = min(best, (ks, alpha, float(data[i])), key=lambda b: b[0])
    return best


@pytest.mark.parametrize("size", [25, 128, 129, 300, 1536])
def test_power_law_fit_matches_its_definition_across_chunks(size):
    # the KS distances are computed a chunk of candidate xmins at a time: sizes around and across chunk edges
    g = np.random.default_rng(size)
    evals = np.concatenate([(1 - g.random(size - 5)) ** (-1 / 1.2), [0.0, 1e-7, 3e-6, 50.0, 80.0]])
    ks, alpha, xmin = _power_law_fit_by_definition(evals)
    fit = fit_power_law(evals)
    assert fit.xmin == xmin and fit.alpha == pytest.approx(alpha, rel=1e-12)
    assert fit.ks_distance == pytest.approx(ks, rel=1e-9, abs=1e-12)


def test_marchenko_pastur_sees_planted_spikes():
    g = np.random.default_rng(2)
    n, m = 800, 200
    noise = g.standard_normal((n, m)) / math.sqrt(n)
    plain = fit_marchenko_pastur(numpy_spectrum(noise), n, m)
    assert plain.num_spikes <= 2 and plain.mp_softrank > 0.6
    u, v = np.linalg.qr(g.standard_normal((n, 3)))[0], np.linalg.qr(g.standard_normal((m, 3)))[0]
    spiked = noise + u @ np.diag([8.0, 6.0, 5.0]) @ v.T
    fit = fit_marchenko_pastur(numpy_spectrum(spiked), n, m)
    assert fit.num_spikes >= 3 and fit.mp_softrank < plain.mp_softrank


def test_record_is_json_and_handles_zero():
    w = torch.randn(30, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rec = health_of_weight(w)
    assert rec["spectrum_of"] == "W" and rec["shape"] == [30, 20]
    assert json.loads(json.dumps(rec, allow_nan=False)) == rec
    assert health_record(np.zeros(5), (5, 7), "W_frozen") == {
        "spectrum_of": "W_frozen",
        "shape": [5, 7],
        "spectral_norm": 0.0,
        "stable_rank": 0.0,
    }


def test_scan_records_health_of_w_frozen(tmp_path):
    """The manifest's per-module health = health_record of W_frozen's eigenvalues (numpy), Conv1D oriented."""
    from plate_inspect import scan
    from plate_inspect.testing.synthetic import write_gpt2

    ckpt = write_gpt2(tmp_path / "gpt2", layers=1)
    bundle = scan(ckpt.path, tmp_path / "bundle", r=8, precision="float64")
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    stored = load_file(str(ckpt.path / "model.safetensors"))
    for name, rec in manifest["modules"].items():
        w = stored[f"{name}.weight"].double().numpy().T  # Conv1D stores [d_in, d_out]
        frozen = np.delete(w, bundle.b_idx(name).numpy(), axis=0)
        want = health_record(numpy_spectrum(frozen), frozen.shape, "W_frozen")
        got = rec["health"]
        assert got["spectrum_of"] == "W_frozen" and got["shape"] == list(frozen.shape)
        for key, value in want.items():
            if isinstance(value, float):
                # the scan's spectrum is float32 (~3e-8 relative from the float64 oracle): fits move by ~1e-6
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key)
            else:
                assert got[key] == value, (name, key)


def test_cli_health(tmp_path):
    from click.testing import CliRunner

    from plate_inspect import scan
    from plate_inspect.cli.main import cli
    from plate_inspect.testing.synthetic import write_bert

    ckpt = write_bert(tmp_path / "bert", layers=1)
    bundle = scan(ckpt.path, tmp_path / "bundle", r=4)
    result = CliRunner().invoke(cli, ["health", str(bundle.path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    assert data == {n: m["health"] for n, m in manifest["modules"].items()}
    result = CliRunner().invoke(cli, ["health", str(bundle.path)])
    assert result.exit_code == 0 and "alpha" in result.output


def test_too_few_eigenvalues_for_a_tail_give_no_alpha():
    """Seven eigenvalues (a 7-row W_frozen): no tail of 8 exists, so there is no power-law fit, not a KS-1.0 alpha."""
    g = np.random.default_rng(2)
    w = (g.standard_normal((7, 64)) * np.linspace(3, 0.2, 64)).astype(np.float32)
    assert fit_power_law(numpy_spectrum(w)) is None
    record = health_record(numpy_spectrum(w), w.shape, "W_frozen")
    assert record["alpha"] is None and record["ks_distance"] is None and record["alpha_weighted"] is None
    assert record["stable_rank"] > 1  # the other metrics are still there
    # eight eigenvalues: the small-sample fit has one tail, and fits it
    w8 = (g.standard_normal((8, 64)) * np.linspace(3, 0.2, 64)).astype(np.float32)
    fit = fit_power_law(numpy_spectrum(w8))
    assert fit is not None and fit.num_pl_spikes == 8 and fit.ks_distance < 1


def test_cli_health_counts_only_fitted_alphas(tmp_path):
    """k/v projections with 32 rows at r = 25 keep 7 frozen rows: no alpha, left out of the "in [2, 6]" count."""
    from click.testing import CliRunner

    from plate_inspect import scan
    from plate_inspect.cli.main import cli
    from plate_inspect.testing.synthetic import write_llama_like

    ckpt = write_llama_like(tmp_path / "llama", layers=1, hidden=64, heads=4, kv_heads=2)
    bundle = scan(ckpt.path, tmp_path / "bundle", r=25)
    health = {rec.name: rec.health for rec in bundle}
    unfitted = sorted(name for name, h in health.items() if h["alpha"] is None)
    assert unfitted == sorted(name for name, h in health.items() if h["shape"][0] == 7) and len(unfitted) == 2
    fitted = [h["alpha"] for h in health.values() if h["alpha"] is not None]
    inside = sum(1 for a in fitted if 2 <= a <= 6)
    result = CliRunner().invoke(cli, ["health", str(bundle.path)])
    assert result.exit_code == 0, result.output
    assert f"{inside}/{len(fitted)} modules in [2, 6]" in result.output
    assert "2 modules without a fit" in result.output


def test_ablation_with_another_b_records_its_own_frozen_rows(tmp_path):
    """QA: a Random-B / Least-redundant-B ablation copied its source bundle's spectrum and health records, so
    "W_frozen" there meant the rows outside the *source's* B. Now spectrum, health and k(tau) are those of the rows
    outside its own B (dense numpy float64 oracle); its k stays PLATE's, and `health` shows them as they are."""
    from click.testing import CliRunner

    from plate_inspect import scan, verify
    from plate_inspect.cli.main import cli
    from plate_inspect.geometry import k_for_tau
    from plate_inspect.testing.synthetic import write_llama_like
    from plate_inspect.train.variants import make_variant

    ckpt = write_llama_like(tmp_path / "llama", layers=1, dtype=torch.float32, planted_fraction=0.2)
    bundle = scan(ckpt.path, tmp_path / "bundle", r=8)
    weights = load_file(str(ckpt.path / "model.safetensors"))
    for kind in ("random_b", "least_redundant_b", "random_q"):
        ablation = make_variant(bundle, ckpt.path, kind, tmp_path / kind)
        assert verify(ablation, ckpt.path).ok  # its digests cover the new spectrum
        for rec in ablation:
            w = weights[f"{rec.name}.weight"].double().numpy()
            frozen = np.delete(w, ablation.b_idx(rec.name).numpy(), axis=0)
            oracle = np.sort(np.linalg.svd(frozen, compute_uv=False) ** 2)[::-1].copy()
            spectrum = ablation.spectrum(rec.name).double().numpy()
            assert spectrum.shape == oracle.shape
            np.testing.assert_allclose(spectrum, oracle, rtol=1e-4, atol=1e-6 * oracle[0])
            assert rec.health["spectral_norm"] == pytest.approx(oracle[0], rel=1e-5)
            assert rec.health["shape"] == list(frozen.shape)
            assert rec.k == bundle.record(rec.name).k  # matched capacity: PLATE's k
            tau = bundle.manifest.settings.tau
            assert rec.k_by_tau[f"{tau:g}"] == k_for_tau(
                torch.from_numpy(oracle), tau, w.shape[1], bundle.manifest.settings.max_rank
            )
        if kind != "random_q":  # another B: another spectrum than the source's
            name = "model.layers.0.self_attn.q_proj"
            assert not torch.equal(ablation.spectrum(name), bundle.spectrum(name))
    result = CliRunner().invoke(cli, ["health", str(tmp_path / "random_b"), "--json"])
    assert result.exit_code == 0, result.output
    name = "model.layers.0.self_attn.q_proj"
    assert (
        json.loads(result.stdout)[name]["spectral_norm"]
        == make_variant(bundle, ckpt.path, "random_b", tmp_path / "random_b").record(name).health["spectral_norm"]
    )


def test_ablation_built_before_its_spectrum_followed_its_b_is_rebuilt(tmp_path, monkeypatch):
    """An ablation dir from before the fix (the source's spectrum copied, hence the source's scores digest) is not
    kept as finished by a rerun of make_variant: its modules are rebuilt with their own frozen rows' spectrum."""
    from plate_inspect import scan
    from plate_inspect.testing.synthetic import write_llama_like
    from plate_inspect.train import variants

    ckpt = write_llama_like(tmp_path / "llama", layers=1, dtype=torch.float32, planted_fraction=0.2)
    bundle = scan(ckpt.path, tmp_path / "bundle", r=8)
    name = "model.layers.0.self_attn.q_proj"
    with monkeypatch.context() as m:
        m.setattr(variants, "OTHER_B_VARIANTS", ())  # the old behaviour: every variant copies the spectrum
        old = variants.make_variant(bundle, ckpt.path, "random_b", tmp_path / "random_b")
    assert torch.equal(old.spectrum(name), bundle.spectrum(name))
    new = variants.make_variant(bundle, ckpt.path, "random_b", tmp_path / "random_b")
    w = load_file(str(ckpt.path / "model.safetensors"))[f"{name}.weight"].double().numpy()
    oracle = np.linalg.norm(np.delete(w, new.b_idx(name).numpy(), axis=0), 2) ** 2
    assert new.spectrum(name)[0].item() == pytest.approx(oracle, rel=1e-5)
    assert new.record(name).health["spectral_norm"] == pytest.approx(oracle, rel=1e-5)


def pareto_spectrum(n: int = 500, alpha: float = 2.5, seed: int = 0) -> np.ndarray:
    """A planted power-law spectrum: n Pareto(alpha) draws (density ~ x^-alpha for x >= 1), ascending."""
    rng = np.random.default_rng(seed)
    return np.sort((1.0 - rng.random(n)) ** (-1.0 / (alpha - 1.0)))


@pytest.mark.parametrize("tied", [2, 5])
def test_power_law_fit_with_tied_top_eigenvalues_matches_weightwatcher(tied):
    """QA: when the largest eigenvalues tie, the candidate xmin at the tie has a tail with no log-spread (alpha
    inf), its KS distance came out NaN (0 * inf in the exponent) and argmin picked it: alpha None for a clean
    power-law spectrum, and a RuntimeWarning. weightwatcher's own fit (x / xmin = 1 there, whatever alpha) is the
    oracle; the untied spectrum's alpha (2.44 planted 2.5) is kept."""
    from weightwatcher.WW_powerlaw import WWFit

    spectrum = pareto_spectrum()
    spectrum[-tied:] = spectrum[-1]
    theirs = WWFit(spectrum)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mine = fit_power_law(spectrum)
    assert mine is not None
    assert mine.alpha == pytest.approx(theirs.alpha, rel=1e-9) and 2.3 < mine.alpha < 2.6
    assert mine.xmin == theirs.xmin and mine.ks_distance == pytest.approx(theirs.D, rel=1e-9)
    record = health_record(spectrum, (500, 500))
    assert record["alpha"] == pytest.approx(theirs.alpha, rel=1e-9)


@pytest.mark.parametrize("n", [64, 30])
def test_a_flat_spectrum_has_no_power_law_fit_and_a_consistent_record(n):
    """QA: all eigenvalues equal (an orthogonal weight): alpha was inf (None in the record) while xmin and
    num_pl_spikes (all n) were still reported as if a tail had been fitted, with a RuntimeWarning. weightwatcher
    gives alpha inf there: no finite exponent, so no fit, and every power-law field is null."""
    from weightwatcher.WW_powerlaw import WWFit

    assert WWFit(np.ones(n)).alpha == np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_power_law(np.ones(n)) is None
        record = health_record(np.ones(n), (n, n))
    for key in ("alpha", "xmin", "ks_distance", "num_pl_spikes", "alpha_weighted"):
        assert record[key] is None, key
    assert record["stable_rank"] == pytest.approx(n) and record["entropy"] == pytest.approx(1.0, abs=1e-8)
    json.dumps(record, allow_nan=False)


@pytest.mark.parametrize(("spectrum", "shape"), [([5.0] + [0.0] * 63, (64, 64)), ([2.0], (1, 64))])
def test_entropy_of_a_rank_one_spectrum_is_zero(spectrum, shape):
    """QA: the normalised entropy of a rank-one spectrum (all energy in one direction) is 0 by definition; the
    formula divided by log(1 + 1e-10) and gave 1449.6 for a rank-one 64 x 64 weight and -1.0000000001 for a
    one-row W_frozen (a gate), off the [0, 1] scale the health table reads on."""
    assert matrix_entropy(spectrum, max(shape)) == 0.0
    assert health_record(spectrum, shape)["entropy"] == 0.0
    # rank two keeps the formula: two equal eigenvalues are flat (1), [3, 1] is the hand-computed value
    assert matrix_entropy([2.0, 2.0] + [0.0] * 62, 64) == pytest.approx(1.0, abs=1e-6)
    p = np.array([0.75, 0.25])
    assert matrix_entropy([3.0, 1.0, 0.0], 3) == pytest.approx(float(-(p * np.log(p)).sum() / np.log(2)), abs=1e-6)


@pytest.mark.parametrize("shape", [(32, 64), (48, 48), (512, 256)])
def test_pure_noise_has_mp_softrank_above_one_as_weightwatcher_does(shape):
    """Martin & Mahoney's R_mp = lambda_+ / lambda_max is ~1 for a random matrix, not bounded by 1: on pure Gaussian
    noise the density fit's bulk edge lies past the largest eigenvalue (no spike), and weightwatcher reports the
    ratio above 1. Ours is the same number (not clamped), so it stays comparable with weightwatcher's."""
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    row = weightwatcher_frame([w]).iloc[0]
    mine = health_record(numpy_spectrum(w), w.shape, "W")
    assert row["mp_softrank"] > 1.0 and mine["mp_softrank"] > 1.0
    assert math.isclose(mine["mp_softrank"], row["mp_softrank"], rel_tol=REL)
    assert mine["num_spikes"] == row["num_spikes"] == 0


def test_record_does_not_depend_on_the_order_of_the_spectrum():
    """The scan stores its spectrum descending, numpy's eigvalsh gives it ascending: the record used to differ in the
    last bits (stable rank, entropy: 40 of these 60 spectra) and, where the Marchenko-Pastur fit's sigma grid is at a
    discontinuity, by far more. Now every order gives the same record, bit for bit (ascending: weightwatcher's)."""
    for seed in range(60):
        g = np.random.default_rng(seed)
        n, m = int(g.integers(40, 200)), int(g.integers(8, 64))
        w = g.standard_normal((n, m)) * np.linspace(3, 0.2, m)
        ascending = np.linalg.eigvalsh(w.T @ w)
        want = health_record(ascending, (n, m))
        for order in (ascending[::-1].copy(), g.permutation(ascending), torch.from_numpy(ascending[::-1].copy())):
            assert health_record(order, (n, m)) == want, seed
