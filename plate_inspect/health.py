"""Spectral health of a weight from an eigenvalue spectrum: the metrics people read off WeightWatcher.

Pure functions of a spectrum (numpy or torch, in any order: sorted ascending first, so the order changes no bit):
the eigenvalues of X^T X for a weight X of shape [d_out, d_in], i.e. its squared singular values, unnormalised.
That is WeightWatcher's convention (``evals = sv**2`` with its default ``normalize=False``), so the values are
directly comparable with ``weightwatcher.analyze``.

Which X: the scan computes the spectrum of the frozen rows W_f (rows outside B); W's own needs another eigvalsh.
:func:`health_record` takes either and says which in ``"spectrum_of"``; the scanner records W_f's (free).

Conventions, matched to weightwatcher 0.7.7 (read from its source; tested against it on MiniLM):

- **alpha** (power-law exponent of the ESD tail) and **xmin**: eigenvalues above 1e-5 are sorted; for every
  candidate xmin (each eigenvalue but the largest) the continuous MLE alpha = 1 + n / sum(log(x / xmin)) over the
  n eigenvalues >= xmin, and the Kolmogorov-Smirnov distance D between the fitted and the empirical CDF; the
  xmin with the smallest D wins (Clauset-Shalizi-Newman, as in ``powerlaw``). With fewer than 20 eigenvalues
  WeightWatcher switches to a bias-corrected fit (alpha = 1 + (n-1)/sum log, tails of >= 8, xmin minimising
  D - 0.868/sqrt(n)); so do we. Where no tail of 8 qualifies (e.g. a 7-row W_frozen) there is no fit (alpha None;
  weightwatcher skips layers with fewer than 8 eigenvalues). ``num_pl_spikes`` = eigenvalues >= xmin.
- **alpha_weighted** = alpha * log10(lambda_max); **spectral_norm** = lambda_max (the squared largest singular
  value, as WeightWatcher reports it); **stable_rank** = sum(lambda) / lambda_max.
- **entropy** (matrix entropy): p = lambda / sum(lambda) + 1e-10, -sum p log p / log(rank), rank = singular values
  above s_max * N * eps(float64), N = the larger dimension; 0 for rank one (weightwatcher's ~1e3 there is 0/0).
- **Marchenko-Pastur** (``mp_softrank``, ``num_spikes``, ``sigma_mp``): eigenvalues rescaled to mean 1, Q = N/M
  (N >= M); a linear-kernel density estimate (bandwidth 0.1) is fitted by the MP density (quarter circle on
  singular values when Q = 1) over sigma on a brute-force grid polished by Nelder-Mead; bulk edge
  lambda_+ = (sigma (1 + 1/sqrt(Q)))^2; spikes = rescaled eigenvalues above lambda_+ + sqrt(TW),
  TW = Q^-1/2 lambda_+^(2/3) M^(-2/3); mp_softrank = lambda_+ / lambda_max.
  mp_softrank is Martin & Mahoney's R_mp, ~1 for a random matrix and not bounded by 1: where the whole spectrum
  is bulk (pure noise, tiny modules) the fitted edge lies past lambda_max and the ratio is above 1 (1.01-1.19 on
  Gaussian noise, weightwatcher's number too: not clamped, so the two stay comparable; num_spikes is then 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np

if TYPE_CHECKING:
    import torch

#: A spectrum or weight as the functions here take it: a torch tensor, a numpy array or a list of floats.
Spectrum = Union["torch.Tensor", np.ndarray, Sequence[float]]

#: Eigenvalues at or below this are left out of the power-law fit (WeightWatcher's EVALS_THRESH).
PL_THRESHOLD = 1e-5
#: Below this many eigenvalues the small-sample fit is used (WeightWatcher's SMALL_N_CUTOFF).
SMALL_N = 20
_ENTROPY_EPS = 1e-10


def _as_numpy(spectrum: Spectrum) -> np.ndarray:
    """The eigenvalues as float64, clipped at 0, **ascending** (weightwatcher's order): every sum then adds them in one
    order, so a metric does not depend on the order given. It did, in the last bits (stable rank, entropy: 40 of 60
    random spectra), and the Marchenko-Pastur fit, whose brute-force sigma grid is discontinuous, by 25% on a GPT-2
    c_fc W_frozen (mp_softrank 0.0412 ascending, 0.0514 descending as the scan stores it)."""
    if hasattr(spectrum, "detach"):
        spectrum = spectrum.detach().to("cpu").double().numpy()
    return np.sort(np.clip(np.asarray(spectrum, dtype=np.float64).ravel(), 0.0, None))


# --------------------------------------------------------------------------- power law
@dataclass
class PowerLawFit:
    """Tail exponent alpha at the KS-optimal xmin."""

    alpha: float
    xmin: float
    ks_distance: float
    sigma: float  # standard error of alpha: (alpha - 1) / sqrt(n tail)
    num_pl_spikes: int  # eigenvalues >= xmin


def fit_power_law(spectrum: Spectrum) -> PowerLawFit | None:
    """Power-law fit of the spectrum's tail (see the module docstring); None when no tail can be fitted: fewer than
    2 eigenvalues > 1e-5, in the small-sample fit no tail of 8 or more with a positive log-spread, or a best tail
    that is flat (alpha infinite: weightwatcher reports inf, which JSON cannot hold)."""
    evals = _as_numpy(spectrum)
    data = np.sort(evals[evals > PL_THRESHOLD])
    n_all = len(data)
    if n_all < 2:
        return None
    logs = np.log(data)
    suffix = np.cumsum(logs[::-1])[::-1]  # sum of logs from i to the end
    idx = np.arange(n_all - 1)
    n = (n_all - idx).astype(np.float64)
    denom = suffix[:-1] - n * logs[:-1]
    small = n_all < SMALL_N
    with np.errstate(divide="ignore", invalid="ignore"):
        alphas = 1.0 + ((n - 1.0) if small else n) / denom
    fitted = alphas > 1
    if small:
        fitted &= (n >= 8) & (denom > 1e-12)
    ds = np.ones(n_all - 1)
    ds[fitted] = _ks_distances(logs, alphas, np.flatnonzero(fitted))
    if small and not fitted.any():
        return None  # no tail of 8 or more: no fit (weightwatcher skips such layers, min_evals 8)
    score = np.where(fitted, ds - 0.868 / np.sqrt(n), np.inf)
    best = int(np.argmin(score if small else ds))
    alpha = float(alphas[best])
    if not math.isfinite(alpha):
        return None  # a flat tail (all its eigenvalues equal: no log-spread) has no finite exponent: no fit
    xmin = float(data[best])
    sigma = (alpha - 1.0) / math.sqrt(n_all - best)
    return PowerLawFit(alpha, xmin, float(ds[best]), sigma, int(np.sum(evals >= xmin)))


#: Candidate xmins whose KS distances are computed in one array operation (at most this many x the tail length).
_KS_CHUNK = 128


def _ks_distances(logs: np.ndarray, alphas: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """KS distance of the fit at each candidate xmin = x_i (ascending data, ``logs`` = log x): the largest
    |1 - (x / x_i)^(1 - alpha_i) - j / n_tail| over the tail x_i <= x, the power as exp((1 - alpha_i) log(x / x_i)).
    A chunk of candidates per array operation: O(n^2) arithmetic without a Python loop over thousands of xmins."""
    n_all = len(logs)
    out = np.empty(len(candidates))
    for start in range(0, len(candidates), _KS_CHUNK):
        rows = candidates[start : start + _KS_CHUNK]
        first = int(rows[0])
        rank = np.arange(first, n_all)[None, :] - rows[:, None]  # j: the position in each candidate's tail
        spread = logs[None, first:] - logs[rows, None]
        with np.errstate(invalid="ignore"):  # 0 * inf at a tie x = xmin when alpha is inf: set just below
            gaps = spread * (1.0 - alphas[rows])[:, None]
        gaps[spread == 0] = 0.0  # (x / xmin)^(1 - alpha) = 1 at x = xmin for any alpha, inf too (as weightwatcher)
        with np.errstate(over="ignore"):  # x below xmin may overflow: masked below
            np.exp(gaps, out=gaps)
        np.subtract(1.0, gaps, out=gaps)
        gaps -= rank / (n_all - rows)[:, None]
        np.abs(gaps, out=gaps)
        gaps[rank < 0] = 0.0  # below this candidate's xmin: not in its tail
        out[start : start + len(rows)] = gaps.max(axis=1)
    return out


# --------------------------------------------------------------------------- norms, ranks, entropy
def spectral_norm(spectrum: Spectrum) -> float:
    """lambda_max: the largest eigenvalue of X^T X (squared largest singular value), WeightWatcher's convention."""
    return float(np.max(_as_numpy(spectrum)))


def stable_rank(spectrum: Spectrum) -> float:
    """||X||_F^2 / ||X||_2^2 = sum(lambda) / lambda_max."""
    evals = _as_numpy(spectrum)
    top = float(np.max(evals))
    return float(np.sum(evals)) / top if top > 0 else 0.0


def numerical_rank(spectrum: Spectrum, n_max: int) -> int:
    """Singular values above s_max * N * eps(float64), N the larger dimension (numpy's matrix_rank tolerance)."""
    sv = np.sqrt(_as_numpy(spectrum))
    return int(np.count_nonzero(sv > np.max(sv) * n_max * np.finfo(np.float64).eps))


def matrix_entropy(spectrum: Spectrum, n_max: int) -> float:
    """Spectral entropy normalised by log(rank): 1 for a flat spectrum, 0 for rank one.

    Rank one (or zero) is 0 by definition: weightwatcher's formula divides by log(1 + 1e-10) there and gives
    ~1e3, or -1 for a single eigenvalue, which would read as off the scale."""
    evals = _as_numpy(spectrum)
    rank = numerical_rank(evals, n_max) if np.any(evals > 0) else 0
    if rank < 2:
        return 0.0
    p = evals / np.sum(evals) + _ENTROPY_EPS
    return float(-np.sum(p * np.log(p)) / np.log(rank + _ENTROPY_EPS))


# --------------------------------------------------------------------------- Marchenko-Pastur
@dataclass
class MPFit:
    """Marchenko-Pastur bulk fit of the spectrum rescaled to mean 1."""

    sigma: float
    bulk_max: float  # lambda_+ in rescaled units
    num_spikes: int
    mp_softrank: float  # lambda_+ / lambda_max


def _mp_density(x: np.ndarray, q: float, sigma: float) -> tuple[np.ndarray, float, float]:
    lo, hi = (sigma * (1 - math.sqrt(1 / q))) ** 2, (sigma * (1 + math.sqrt(1 / q))) ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        val = np.nan_to_num((1 / (2 * math.pi * sigma * sigma * x / q)) * np.sqrt((hi - x) * (x - lo)))
    return val, lo, hi


def fit_marchenko_pastur(spectrum: Spectrum, n: int, m: int, bandwidth: float = 0.1) -> MPFit:
    """Fit the MP bulk to the spectrum of an n x m matrix (any orientation); see the module docstring."""
    from scipy import optimize
    from sklearn.neighbors import KernelDensity

    if min(n, m) < 1:
        raise ValueError(f"fit_marchenko_pastur needs the matrix's shape n, m >= 1, got {n} x {m}")
    n, m = max(n, m), min(n, m)
    q = n / m
    evals = _as_numpy(spectrum)
    scaled = evals * (len(evals) / np.sum(evals))
    lam_max = float(np.max(scaled))
    to_fit = np.sqrt(scaled) if q == 1 else scaled
    kde = KernelDensity(kernel="linear", bandwidth=bandwidth).fit(to_fit.reshape(-1, 1))
    grid = np.linspace(0, np.max(to_fit) + 0.5, 1000)
    dens = np.exp(kde.score_samples(grid[:, None]))
    good = dens > 0.01
    n_bad = int(np.sum(dens < 0.01))
    x, y = grid[good], dens[good]
    x_peak = x[np.argmax(y)]

    def residual(p: np.ndarray) -> float:
        sigma = float(np.asarray(p).ravel()[0])
        if q == 1:
            with np.errstate(invalid="ignore"):
                model = np.nan_to_num((1 / (math.pi * sigma * sigma)) * np.sqrt(4 - x**2))
            r = model - y
        else:
            model, lo, hi = _mp_density(x, q, sigma)
            r = np.full(len(y), 1000.0) if (hi < x_peak or hi > np.max(x) or lo > x_peak) else model - y
        return float(np.sum(np.concatenate([r, np.zeros(n_bad)]) ** 2))

    s0 = math.sqrt(lam_max / (1 + 1 / math.sqrt(q)) ** 2)
    out = optimize.brute(residual, (slice(0.05 * s0, 2.0 * s0, 0.01 * s0),), full_output=True)
    sigma = float(np.asarray(out[0]).ravel()[0])
    bulk_max = (sigma * (1 + 1 / math.sqrt(q))) ** 2
    tw = 1 / math.sqrt(q) * bulk_max ** (2 / 3) * m ** (-2 / 3)
    spikes = int(np.sum(scaled > bulk_max + math.sqrt(tw)))
    return MPFit(sigma, bulk_max, spikes, bulk_max / lam_max)


# --------------------------------------------------------------------------- the manifest record
def health_record(spectrum: Spectrum, shape: tuple[int, int] | list[int], spectrum_of: str = "W_frozen") -> dict:
    """Every metric of one module as a JSON-able dict (for the bundle manifest); NaN-free (None when undefined).

    ``spectrum``: eigenvalues of X^T X; ``shape``: X's [rows, cols] (for a W_frozen spectrum: the frozen rows'
    count and d_in); ``spectrum_of``: "W" or "W_frozen", recorded as given.
    """
    evals = _as_numpy(spectrum)
    rows, cols = int(shape[0]), int(shape[1])
    n_max = max(rows, cols)
    if evals.size == 0 or float(np.max(evals)) <= 0:
        return {"spectrum_of": spectrum_of, "shape": [rows, cols], "spectral_norm": 0.0, "stable_rank": 0.0}
    pl = fit_power_law(evals)
    lam_max = spectral_norm(evals)
    record: dict[str, Any] = {
        "spectrum_of": spectrum_of,
        "shape": [rows, cols],
        "alpha": pl.alpha if pl else None,
        "xmin": pl.xmin if pl else None,
        "ks_distance": pl.ks_distance if pl else None,
        "num_pl_spikes": pl.num_pl_spikes if pl else None,
        "alpha_weighted": pl.alpha * math.log10(lam_max) if pl else None,
        "spectral_norm": lam_max,
        "log_spectral_norm": math.log10(lam_max),
        "stable_rank": stable_rank(evals),
        "entropy": matrix_entropy(evals, n_max),
    }
    try:
        mp = fit_marchenko_pastur(evals, rows, cols)
        record.update({"mp_softrank": mp.mp_softrank, "num_spikes": mp.num_spikes, "sigma_mp": mp.sigma})
    except (ValueError, FloatingPointError):
        record.update({"mp_softrank": None, "num_spikes": None, "sigma_mp": None})
    # sorted keys: a record read back from a part header (JSON) serialises byte-identically to a fresh one
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in sorted(record.items())}


# --------------------------------------------------------------------------- W's own spectrum
def weight_spectrum(weight: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Eigenvalues of W^T W (descending, length min(d_out, d_in)) from the small-side Gram matrix: one syrk and one
    eigvalsh, the cost of W's own spectrum on top of the scan's (which computes W_frozen's)."""
    import torch

    from plate_inspect.geometry import gram_spectrum, ieee_float32_matmul, matmul

    w = weight if isinstance(weight, torch.Tensor) else torch.as_tensor(weight)
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"weight must be a 2-D floating matrix [d_out, d_in], got {w.dtype} {list(w.shape)}")
    with ieee_float32_matmul():  # no TF32 Gram on CUDA, whatever the process's setting
        gram = matmul(w, w.T) if w.shape[0] <= w.shape[1] else matmul(w.T, w)  # a.T @ a: a syrk in numpy
        return gram_spectrum(gram).values.cpu()


def health_of_weight(weight: torch.Tensor | np.ndarray) -> dict:
    """:func:`health_record` of W itself (d_out x d_in); the scanner records W_frozen's instead, from the spectrum
    it already has (W's own costs one more Gram and eigvalsh: ``benchmarks/health_cost.py``)."""
    spectrum = weight_spectrum(weight)
    return health_record(spectrum, tuple(np.shape(weight)), "W")
