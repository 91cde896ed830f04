"""QA of the "beyond the paper" commands (plan, health, audit) as a user meets them: each test here failed before
its fix, against an independent oracle (weightwatcher's own fit, a hand-computed case, brute force)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from plate_inspect.health import fit_power_law, health_record, matrix_entropy


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
