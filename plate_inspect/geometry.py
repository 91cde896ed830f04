"""PLATE geometry of one weight matrix: redundancy scores, the output selector B, the frozen-row energy
spectrum, k(tau) and the low-energy input basis Q.

Pure functions, tensor in and tensor out; they never read files. Math runs in the dtype of the input
(float32 or float64; the scanner upcasts bf16/fp16 weights) and Q is the exact bottom-k eigenspace in both:
small energies are measured on W itself (Rayleigh-Ritz in float64) or made zero by construction (Householder
null vectors), never read off a float32 Gram matrix. On CPU the heavy products go through NumPy (OpenBLAS ran
them ~2x faster than torch's bundled MKL on the project's AMD machines, see ``benchmarks/``) and the
eigenproblems through LAPACK (one tridiagonal reduction per module); on CUDA everything stays in torch.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch

from plate_inspect._lapack_nogil import (
    apply_tridiagonal_reflectors,
    tridiagonal_all_eigenvectors,
    tridiagonal_eigenvalues,
    tridiagonal_eigenvectors,
    tridiagonalize,
)
from plate_inspect.arguments import real_value
from plate_inspect.errors import ConfigError

#: tau values at which every module's k is recorded, for k(tau) curves in reports.
DEFAULT_TAU_GRID: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99)


# --------------------------------------------------------------------------- linear-algebra backend
_PRECISION_LOCK = threading.Lock()
_precision_users = 0
_saved_precision: tuple[str, ...] = ()


def _matmul_precision() -> tuple[str, ...]:
    """torch's float32 matmul precision: (CUDA, oneDNN) with the per-backend API (torch >= 2.9), else the legacy
    setting. Reading the legacy one after the per-backend API was used raises in torch >= 2.9, and vice versa."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(torch.backends.mkldnn, "matmul"):
        return (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    return (torch.get_float32_matmul_precision(),)


def _set_matmul_precision(state: tuple[str, ...]) -> None:
    if len(state) == 2:
        # torch.backends.mkldnn is replaced by an MkldnnModule at import; its `matmul` is unknown to the stubs
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = state  # type: ignore[attr-defined]
    else:
        torch.set_float32_matmul_precision(state[0])


@contextmanager
def ieee_float32_matmul() -> Iterator[None]:
    """float32 matmuls in IEEE float32 while the geometry runs, then the caller's setting back.

    A training script's ``torch.set_float32_matmul_precision("high")`` or ``allow_tf32 = True`` (HF Trainer's
    ``tf32=True``) makes CUDA Gram matrices and projections TF32, ~3 decimal digits: far from the exact Q the
    geometry promises. The setting is process-wide, so nested and concurrent uses are counted and the first
    one in saves it, the last one out restores it. Also a decorator.
    """
    global _precision_users, _saved_precision
    with _PRECISION_LOCK:
        if _precision_users == 0:
            _saved_precision = _matmul_precision()
            _set_matmul_precision(("ieee", "ieee") if len(_saved_precision) == 2 else ("highest",))
        _precision_users += 1
    try:
        yield
    finally:
        with _PRECISION_LOCK:
            _precision_users -= 1
            if _precision_users == 0:
                _set_matmul_precision(_saved_precision)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``; NumPy (OpenBLAS) on CPU, torch elsewhere. ``a.T @ a`` on CPU becomes a syrk."""
    if a.device.type == "cpu":
        return torch.from_numpy(np.matmul(a.numpy(), b.numpy()))
    return a @ b


def symmetric_eigh(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending) and eigenvectors of a symmetric matrix; reads its lower triangle."""
    if s.device.type == "cpu":
        w, v = scipy.linalg.eigh(s.numpy(), driver="evd", check_finite=False)
        return torch.from_numpy(w), torch.from_numpy(v)
    return torch.linalg.eigh(s)


def symmetric_eigvalsh(s: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (ascending) of a symmetric matrix; reads its lower triangle."""
    if s.device.type == "cpu":
        return torch.from_numpy(scipy.linalg.eigh(s.numpy(), eigvals_only=True, driver="evd", check_finite=False))
    return torch.linalg.eigvalsh(s)


def orthonormalize(m: torch.Tensor, passes: int = 2) -> torch.Tensor:
    """An orthonormal basis of m's column span, in m's column order (leading columns span leading columns).

    CholeskyQR2: Gram matrix and triangular solve in m's dtype (BLAS-3, much faster than Householder QR for
    tall blocks), Cholesky of the small Gram in float64; twice, so the columns are orthonormal to m's
    precision (``passes=1`` suffices when m is orthonormal to rounding already). Falls back to Householder QR
    when the Gram matrix is not numerically positive definite.
    """
    x = m
    for _ in range(passes):
        chol, info = torch.linalg.cholesky_ex(matmul(x.T, x).double())
        if int(info) != 0:
            return torch.linalg.qr(m.double()).Q.to(m.dtype)
        x = torch.linalg.solve_triangular(chol.T.to(m.dtype), x, upper=True, left=False)
    return x


def seeded_gaussian(rows: int, cols: int, seed: int, like: torch.Tensor) -> torch.Tensor:
    """A reproducible standard Gaussian matrix: drawn on CPU (same numbers on every device), then moved."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64).to(device=like.device, dtype=like.dtype)


def module_seed(seed: int, name: str) -> int:
    """A per-module seed that depends only on the run seed and the module name (not on scan order)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------- symmetric eigenproblems
#: Tridiagonal eigenvector ranges at least this long are computed by two MRRR runs (see TridiagonalEigen).
MRRR_SPLIT_MIN = 256


class SymmetricEigen:
    """One symmetric matrix, factorised once: all its eigenvalues and its bottom eigenvectors."""

    def eigenvalues(self) -> torch.Tensor:
        """All eigenvalues, ascending."""
        raise NotImplementedError

    def bottom_vectors(self, p: int, start: int = 0) -> torch.Tensor:
        """Eigenvectors start..p-1 of the p smallest eigenvalues (ascending), as columns.

        Calls for consecutive ranges return columns of one and the same orthonormal set.
        """
        raise NotImplementedError


class TridiagonalEigen(SymmetricEigen):
    """LAPACK on CPU: one tridiagonal reduction S = H T H^T (sytrd) serves everything.

    Eigenvalues come from T alone (sterf), the p bottom eigenvectors from T (in float64: MRRR on index ranges,
    or divide and conquer for all when a range is a large share of n) mapped back by the Householder reflectors
    (blocked as LAPACK ormtr does it, reading them where sytrd left them). No full eigh of the d x d matrix.
    Overwrites ``s`` (the caller's scratch Gram matrix).
    """

    def __init__(self, s: torch.Tensor) -> None:
        self.reflectors = s.numpy().T  # symmetric: the transpose is the same matrix, Fortran-ordered: in place
        self.diag, self.offdiag, self.tau = tridiagonalize(self.reflectors)
        self.n = self.reflectors.shape[0]
        self._values: np.ndarray | None = None
        self._all: np.ndarray | None = None

    def _ascending_values(self) -> np.ndarray:
        if self._values is None:
            self._values = tridiagonal_eigenvalues(self.diag, self.offdiag)
        return self._values

    def eigenvalues(self) -> torch.Tensor:
        """All eigenvalues of S (those of T), ascending."""
        return torch.from_numpy(self._ascending_values().copy())

    def _mrrr_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """[start, stop) as one or two inclusive index ranges; a long range is cut at the widest eigenvalue gap
        in its middle third, so that no close cluster is split between two MRRR runs."""
        if stop - start < MRRR_SPLIT_MIN:
            return [(start, stop - 1)]
        values = self._ascending_values()
        lo, hi = start + (stop - start) // 3, start + 2 * (stop - start) // 3
        cut = lo + int(np.argmax(np.diff(values[lo - 1 : hi].astype(np.float64))))
        return [(start, cut - 1), (cut, stop - 1)]

    def tridiagonal_vectors(self, p: int, start: int = 0) -> np.ndarray:
        """Eigenvectors start..p-1 of T (ascending eigenvalues) in float64, as T's dtype.

        float64 although T is float32: T's bottom eigenvalues sit within ~1e-7 ||T|| of each other, and a
        float32 MRRR mixes their eigenvectors (residuals ~ n eps ||T||) more than the Gram matrix's own
        rounding does; measured at Qwen2.5-7B sizes, a Rayleigh-Ritz on W_f then misses the exact bottom
        subspace by up to ~the whole exactness allowance, where float64 vectors of the same T leave < 0.2 of it.
        MRRR (dstemr) runs on index ranges, a long one as two halves on two threads (GIL released:
        ``_lapack_nogil``); the split depends on T alone, never on the thread count, so the bits do not either.
        When p reaches a quarter of n, divide and conquer for all vectors (dstevd) was faster (measured).
        """
        if self.n == 1:
            return np.ones((1, 1), dtype=self.diag.dtype)[:, start:p]
        if 4 * p >= self.n:  # (p only grows between rounds: once here, every later round is too)
            return self._all_vectors()[:, start:p].astype(self.diag.dtype)
        d, e = self.diag.astype(np.float64), self.offdiag.astype(np.float64)
        ranges = self._mrrr_ranges(start, p)
        workers = min(len(ranges), max(1, torch.get_num_threads()))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="plate-mrrr") as pool:
            parts = list(pool.map(lambda r: tridiagonal_eigenvectors(d, e, *r), ranges))
        return np.asfortranarray(np.concatenate(parts, axis=1), dtype=self.diag.dtype)

    def _all_vectors(self) -> np.ndarray:
        """All eigenvectors of T in float64 (divide and conquer), computed once."""
        if self._all is None:
            d, e = self.diag.astype(np.float64), self.offdiag.astype(np.float64)
            self._all = tridiagonal_all_eigenvectors(d, e)
        return self._all

    def bottom_vectors(self, p: int, start: int = 0) -> torch.Tensor:
        """Eigenvectors start..p-1 of S: T's eigenvectors (float64, MRRR on index ranges) mapped back through H."""
        if p <= start:
            return torch.zeros(self.n, 0, dtype=torch.from_numpy(self.diag).dtype)
        return torch.from_numpy(
            apply_tridiagonal_reflectors(self.reflectors, self.tau, self.tridiagonal_vectors(p, start))
        )


class DenseEigen(SymmetricEigen):
    """torch.linalg.eigh (every device): the full eigendecomposition, for CUDA and as the reference path.

    Eigenvectors in float64 although the Gram matrix is float32, for the reason TridiagonalEigen computes T's in
    float64: the bottom eigenvalues lie within ~1e-7 ||G|| of each other, and a float32 eigensolver mixes their
    vectors beyond what the Rayleigh-Ritz step can repair (measured at Qwen2.5-7B's q/o size, 3584 x 3584, alpha
    0.5: float32 candidates 1.55x the exactness allowance, float64 ones 0.001x). Eigenvalues alone stay in s's dtype.
    """

    def __init__(self, s: torch.Tensor, vectors: bool = True) -> None:
        if vectors:
            self.values, self.vectors = torch.linalg.eigh(s.double())
        else:
            self.values, self.vectors = torch.linalg.eigvalsh(s), None

    def eigenvalues(self) -> torch.Tensor:
        """All eigenvalues, ascending (float64 when vectors were computed)."""
        return self.values

    def bottom_vectors(self, p: int, start: int = 0) -> torch.Tensor:
        """Columns start..p-1 of the float64 eigenvectors (needs ``vectors=True``)."""
        return self.vectors[:, start:p]


def factor_symmetric(s: torch.Tensor, backend: str = "auto", vectors: bool = True) -> SymmetricEigen:
    """Factorise a symmetric matrix (may overwrite it): LAPACK tridiagonal on CPU, torch eigh elsewhere.

    ``vectors=False`` promises that only eigenvalues will be asked for (torch then runs eigvalsh).
    """
    if backend not in ("auto", "lapack", "torch"):
        raise ConfigError(f"backend must be auto, lapack or torch, got {backend!r}")
    if backend == "lapack" or (backend == "auto" and s.device.type == "cpu"):
        return TridiagonalEigen(s.contiguous())
    return DenseEigen(s, vectors)


# --------------------------------------------------------------------------- B: redundant output rows
def effective_r(r: int, d_out: int) -> int:
    """r capped at 90% of the output rows, so at least 10% of rows stay frozen and define Q."""
    return min(int(r), int(math.floor(0.9 * d_out)))


def anchor_indices(d_out: int, n_anchors: int) -> torch.Tensor:
    """A strided, deterministic set of anchor rows: min(n_anchors, d_out) rows spread evenly."""
    n = min(int(n_anchors), d_out)
    return (torch.arange(n, dtype=torch.int64) * d_out) // n


def redundancy_scores(
    weight: torch.Tensor,
    n_anchors: int = 256,
    sketch_dim: int | None = None,
    seed: int = 0,
    row_gram: torch.Tensor | None = None,
) -> torch.Tensor:
    """s_i = mean over anchor rows j != i of |cos(w_i, w_j)|, as float32 [d_out].

    Exact cosines by default (d_out * |A| * d_in flops, or none when ``row_gram`` = W W^T is given: its anchor
    columns are the dot products). With ``sketch_dim`` D, the paper's estimate: cosines of z_i = w_i R / ||w_i||
    for a seeded Gaussian R (d_in x D, scaled by 1/sqrt(D)). An anchor's similarity to itself is left out, so
    anchors are not favoured; all-zero rows score 0.
    """
    d_out, d_in = weight.shape
    anchors = anchor_indices(d_out, n_anchors).to(weight.device)
    if row_gram is not None and not sketch_dim:
        norms = torch.diagonal(row_gram).clamp_min(0).sqrt()
    else:
        norms = torch.linalg.vector_norm(weight, dim=1)
    inv = torch.where(norms > 0, 1.0 / norms.clamp_min(torch.finfo(weight.dtype).tiny), torch.zeros_like(norms))
    if sketch_dim:
        proj = seeded_gaussian(d_in, int(sketch_dim), seed, weight) / math.sqrt(int(sketch_dim))
        z = matmul(weight, proj) * inv[:, None]
        cos = matmul(z, z[anchors].T.contiguous()).abs_()
    else:  # in place on the fresh d_out x |A| product: no second and third copy of it
        dots = row_gram[:, anchors] if row_gram is not None else matmul(weight, weight[anchors].T.contiguous())
        cos = dots.abs_().mul_(inv[:, None]).mul_(inv[anchors][None, :])
    cos[anchors, torch.arange(len(anchors), device=weight.device)] = 0.0
    is_anchor = torch.zeros(d_out, dtype=weight.dtype, device=weight.device)
    is_anchor[anchors] = 1.0
    denom = (len(anchors) - is_anchor).clamp_min(1.0)
    return (cos.sum(dim=1) / denom).to(torch.float32)


def select_redundant_rows(scores: torch.Tensor, r: int) -> torch.Tensor:
    """B as indices: the r highest scores (equal scores -> lower index), returned ascending, int64. Exact duplicate
    rows can score a last bit apart (BLAS computes identical rows at different positions of a product in different
    kernel paths), so which copies go to B is rounding's choice: deterministic, but not by index."""
    order = torch.sort(scores, descending=True, stable=True).indices[: int(r)]
    return torch.sort(order).values.to(torch.int64)


# --------------------------------------------------------------------------- k(tau)
def energy_rank(spectrum: torch.Tensor, tau: float) -> int:
    """m(tau): the fewest top eigenvalues holding at least a tau fraction of the total energy."""
    s = spectrum.detach().to("cpu", torch.float64)
    total = float(s.sum())
    if total <= 0.0:
        return 0
    cums = torch.cumsum(s, 0)
    return int(torch.searchsorted(cums, torch.tensor([tau * total], dtype=torch.float64)).item()) + 1


def k_for_tau(spectrum: torch.Tensor, tau: float, d_in: int, max_rank: int) -> int:
    """k = max(1, min(d_in - m(tau), max_rank)) for a descending energy spectrum."""
    return max(1, min(d_in - energy_rank(spectrum, tau), int(max_rank)))


# --------------------------------------------------------------------------- Q: low-energy input basis
def exactness_allowance(optimum: float, total: float) -> float:
    """How far Q's energy tr(Q^T G Q) may lie above the optimum (the k smallest eigenvalues' sum) and still count
    as exact: 1% of the optimum plus 1e-6 of tr(G). The Ritz and null-space steps spend small fractions of it."""
    return 0.01 * optimum + 1e-6 * total


#: Candidate directions beyond k for the Rayleigh-Ritz step: the bottom eigenvectors of a float32 Gram matrix mix
#: the exact bottom-k eigenspace with nearby directions, and a wider candidate span holds it. A first round uses
#: the smaller number; the larger one runs only when the first has not converged (see RITZ_PROBE).
RITZ_OVERSAMPLE: tuple[int, ...] = (64, 256)
#: Convergence check of a round: the Ritz energy with the last RITZ_PROBE candidates left out may exceed the
#: round's energy by at most RITZ_TOLERANCE x exactness_allowance(energy, tr(G)), a small fraction of the bound;
#: otherwise the next, wider round runs.
RITZ_PROBE = 32
RITZ_TOLERANCE = 0.05


@dataclass
class FrozenBasis:
    """The frozen rows' energy spectrum, k(tau), and an orthonormal basis Q of the bottom-k eigenspace."""

    # eigenvalues of W_frozen^T W_frozen, descending, length min(n_frozen, d_in), in the weight's precision: float64
    # keeps those of tiny weights (2^-100: ~1e-60), which float32 would flush to zero
    spectrum: torch.Tensor
    k: int
    q: torch.Tensor  # [d_in, k], orthonormal columns, ascending energy
    captured_energy: float  # tr(Q^T G Q) / tr(G)


def kept_block(k: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The kept rows' block K[keep][:, keep] of a row Gram matrix K = W W^T, in one gather (no row-cut temporary)."""
    return k if keep is None else k[keep[:, None], keep]


@dataclass
class FrozenRows:
    """W_f = weight[keep] without a row copy: ``weight`` has zeros outside ``keep`` (None: every row is kept)."""

    weight: torch.Tensor
    keep: torch.Tensor | None = None

    @property
    def n_rows(self) -> int:
        """Number of frozen rows (those kept), not the weight's d_out."""
        return self.weight.shape[0] if self.keep is None else int(self.keep.numel())

    def times(self, x: torch.Tensor) -> torch.Tensor:
        """W_f x with a zero row for every zeroed row of ``weight`` (no gather: Y^T Y is the same)."""
        return matmul(self.weight, x)

    def input_gram(self) -> torch.Tensor:
        """G = W_f^T W_f (d_in x d_in); the zeroed rows add nothing."""
        return matmul(self.weight.T, self.weight)

    def output_gram(self) -> torch.Tensor:
        """K = W_f W_f^T (n_f x n_f): same nonzero eigenvalues as G."""
        return kept_block(matmul(self.weight, self.weight.T), self.keep)

    def columns(self, cols: torch.Tensor) -> torch.Tensor:
        """W_f[:, cols] as a new contiguous matrix, gathered in one step (no intermediate row or column cut)."""
        return self.weight[:, cols].contiguous() if self.keep is None else self.weight[self.keep[:, None], cols]


@dataclass
class RitzCandidates:
    """An orthonormal candidate block S (d_in x p) and Y = W_f S (with the zero rows of FrozenRows.times), grown
    column block by column block."""

    s: torch.Tensor
    y: torch.Tensor

    @classmethod
    def empty(cls, rows: FrozenRows) -> RitzCandidates:
        """No candidates yet: S is d_in x 0 and Y is d_out x 0."""
        w = rows.weight
        return cls(w.new_zeros(w.shape[1], 0), w.new_zeros(w.shape[0], 0))

    def extend(self, rows: FrozenRows, vectors: torch.Tensor) -> RitzCandidates:
        """S and Y with ``vectors`` appended, orthonormalised against S (eigenvectors of one run: already
        orthonormal to rounding, so one projection and one CholeskyQR pass restore it); Y only for the new ones."""
        if self.s.shape[1]:
            vectors = vectors - matmul(self.s, matmul(self.s.T.contiguous(), vectors))
        new = orthonormalize(vectors, passes=1)
        if not self.s.shape[1]:
            return RitzCandidates(new, rows.times(new))
        return RitzCandidates(torch.cat([self.s, new], dim=1), torch.cat([self.y, rows.times(new)], dim=1))


def rayleigh_ritz(candidates: RitzCandidates, k: int, probe: int = 0) -> tuple[torch.Tensor, list[float]]:
    """The best k-dimensional subspace of span(S) for G, and its energy tr(Q^T G Q).

    The energies are measured on W_f itself, not on a Gram matrix: Y = W_f S in the working precision is
    accurate to rounding relative to |W_f| |S|, so the small energies that decide the bottom subspace come
    out right where a float32 Gram matrix (error ~ eps * ||G||) would blur them; H = Y^T Y inherits that
    (its rounding is relative to the columns of Y, which are small), its eigendecomposition is float64.
    Returns Q and the energies [with all candidates, with the last ``probe`` left out] (the latter only when
    ``probe``): nested because S's leading columns span the leading candidates.
    """
    s, y = candidates.s, candidates.y
    h = matmul(y.T, y).double()
    theta, vectors = symmetric_eigh(h)
    q = matmul(s, vectors[:, :k].to(device=s.device, dtype=s.dtype).contiguous())
    energies = [float(theta[:k].clamp_min(0).sum())]
    if probe:
        energies.append(float(symmetric_eigvalsh(h[:-probe, :-probe].contiguous())[:k].clamp_min(0).sum()))
    return q.contiguous(), energies


def _gram_trace(gram: torch.Tensor) -> float:
    return float(torch.diagonal(gram).double().sum())


def bottom_eigenspace_from_input_gram(
    rows: FrozenRows, tau: float, max_rank: int, backend: str = "auto"
) -> FrozenBasis:
    """Tall W_f (or wide with k possibly beyond the null space): work on G = W_f^T W_f, d_in x d_in.

    One factorisation of G gives the spectrum and the k + RITZ_OVERSAMPLE bottom eigenvectors; the
    Rayleigh-Ritz step on W_f then picks the exact bottom-k subspace within their span. A round whose last
    RITZ_PROBE candidates still lower the energy by more than RITZ_TOLERANCE of the allowance is followed by a
    wider one.
    """
    d_in = rows.weight.shape[1]
    gram = rows.input_gram()
    total = _gram_trace(gram)
    factor = factor_symmetric(gram, backend)
    del gram
    spectrum = factor.eigenvalues().clamp_min(0).flip(0)[: min(rows.n_rows, d_in)]
    k = k_for_tau(spectrum, tau, d_in, max_rank)
    candidates = RitzCandidates.empty(rows)
    for extra in RITZ_OVERSAMPLE:
        p = min(d_in, k + extra)
        new = factor.bottom_vectors(p, start=candidates.s.shape[1])
        candidates = candidates.extend(rows, new.to(rows.weight.device, rows.weight.dtype))
        probe = min(RITZ_PROBE, p - k) if p < d_in else 0  # all of R^d_in: nothing can be missing
        q, energies = rayleigh_ritz(candidates, k, probe)
        if not probe or energies[1] - energies[0] <= RITZ_TOLERANCE * exactness_allowance(energies[0], total):
            break
    return FrozenBasis(spectrum.to(rows.weight.dtype), k, q, energies[0] / total if total > 0 else 0.0)


#: LU null vectors are kept when their energy ||C Z||_F^2 uses at most this fraction of the exactness allowance
#: (exactness_allowance with optimum 0: 1e-6 tr(G)), else Householder ones are computed. Qwen2.5-7B down shapes:
#: LU's used ~1e-6 of it, Householder's ~3e-9.
NULL_LU_TOLERANCE = 1e-4


def null_vectors(
    c: torch.Tensor, k: int, backend: str = "auto", method: str = "lu", overwrite_c: bool = False
) -> torch.Tensor:
    """k orthonormal vectors z with C z = 0 to rounding, for an n x m matrix C with m >= n + k.

    "lu": partial-pivoted LU of C^T, P C^T = L U with L = [L1; L2] (L1 unit lower n x n, L2 k x n). With
    P z = [w1; w2], C z = U^T (L1^T w1 + L2^T w2): w2 = I_k, w1 = -L1^-T L2^T makes it zero up to the LU's
    backward error, whatever C's rank (U is never inverted; |L| <= 1). Half the flops of Householder QR.
    "householder": the last k columns of the full orthogonal factor of C^T, ||C z|| ~ eps ||C|| however
    ill-conditioned C is (backward stable, no growth factor); the fallback when LU's residual is too large.
    ``overwrite_c``: LAPACK may factorise a contiguous C in place (its values are lost) instead of a copy.
    """
    if method not in ("lu", "householder"):
        raise ConfigError(f"null-vector method must be lu or householder, got {method!r}")
    on_lapack = backend == "lapack" or (backend == "auto" and c.device.type == "cpu")
    if method == "lu":
        return orthonormalize(_lu_null_vectors_lapack(c, k, overwrite_c) if on_lapack else _lu_null_vectors_torch(c, k))
    n, m = c.shape
    unit = torch.zeros(m, k, dtype=c.dtype, device=c.device)
    unit[n : n + k] = torch.eye(k, dtype=c.dtype, device=c.device)
    if not on_lapack:
        reflectors, tau = torch.geqrf(c.T)
        return torch.ormqr(reflectors, tau, unit, left=True, transpose=False)
    a = _transposed_for_lapack(c, overwrite_c)  # C^T, overwritten by geqrf
    geqrf, geqrf_lwork, ormqr = scipy.linalg.lapack.get_lapack_funcs(("geqrf", "geqrf_lwork", "ormqr"), (a,))
    work, _ = geqrf_lwork(m, n)
    reflectors, tau, _, info = geqrf(a, lwork=int(work), overwrite_a=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"geqrf failed (info={info})")
    args = ("L", "N", reflectors, tau, np.asfortranarray(unit.numpy()))
    _, work, _ = ormqr(*args, lwork=-1)
    z, _, info = ormqr(*args, lwork=int(work[0]), overwrite_c=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"ormqr failed (info={info})")
    return torch.from_numpy(z)


def _unpivot(w: torch.Tensor, pivots: np.ndarray) -> torch.Tensor:
    """z with P z = w, for the row interchanges of getrf (row i swapped with row pivots[i], 0-based, in order)."""
    perm = np.arange(w.shape[0])
    for i, p in enumerate(pivots.tolist()):
        perm[i], perm[p] = perm[p], perm[i]
    z = torch.empty_like(w)
    z[torch.from_numpy(perm).to(w.device)] = w  # (P w)[j] = w[perm[j]]
    return z


def _transposed_for_lapack(c: torch.Tensor, overwrite: bool) -> np.ndarray:
    """C^T in Fortran order for a LAPACK routine that overwrites its input: C's own storage (a contiguous C^T
    view, so no copy) when ``overwrite``, else a copy."""
    view = c.contiguous().numpy().T
    return view if overwrite else np.array(view, order="F")


def _lu_null_vectors_lapack(c: torch.Tensor, k: int, overwrite_c: bool = False) -> torch.Tensor:
    n = c.shape[0]
    a = _transposed_for_lapack(c, overwrite_c)
    (getrf,) = scipy.linalg.lapack.get_lapack_funcs(("getrf",), (a,))
    lu, pivots, info = getrf(a, overwrite_a=1)
    if info < 0:  # info > 0: an exactly zero pivot in U, harmless here (U is never inverted)
        raise np.linalg.LinAlgError(f"getrf failed (info={info})")
    (trsm,) = scipy.linalg.blas.get_blas_funcs(("trsm",), (lu,))
    w1 = trsm(-1.0, lu[:n, :n], lu[n : n + k, :n].T, side=0, lower=1, trans_a=1, diag=1)  # -L1^-T L2^T
    return _unpivot(_stack_null_coordinates(torch.from_numpy(w1), c.shape[1]), pivots)


def _lu_null_vectors_torch(c: torch.Tensor, k: int) -> torch.Tensor:
    n = c.shape[0]
    lu, pivots = torch.linalg.lu_factor(c.T)
    w1 = torch.linalg.solve_triangular(lu[:n, :n].T, -lu[n : n + k, :n].T, upper=True, unitriangular=True)
    return _unpivot(_stack_null_coordinates(w1, c.shape[1]), pivots.cpu().numpy() - 1)  # torch's are 1-based


def _stack_null_coordinates(w1: torch.Tensor, m: int) -> torch.Tensor:
    """P z for the LU null vectors: [w1; I_k; 0] (m x k)."""
    n, k = w1.shape
    w = torch.zeros(m, k, dtype=w1.dtype, device=w1.device)
    w[:n] = w1
    w[n : n + k] = torch.eye(k, dtype=w1.dtype, device=w1.device)
    return w


@dataclass
class GramSpectrum:
    """The eigenvalues of a Gram matrix (descending, clamped at 0) and its trace. For K = W_f W_f^T: G's nonzero
    spectrum and tr(G)."""

    values: torch.Tensor
    trace: float


def gram_spectrum(gram: torch.Tensor, backend: str = "auto") -> GramSpectrum:
    """Factorise a Gram matrix (W W^T or W^T W) for its eigenvalues only; overwrites ``gram`` (the caller's scratch)."""
    trace = _gram_trace(gram)
    return GramSpectrum(factor_symmetric(gram, backend, vectors=False).eigenvalues().clamp_min(0).flip(0), trace)


def null_space_basis(
    rows: FrozenRows,
    tau: float,
    max_rank: int,
    seed: int,
    backend: str = "auto",
    spectrum: GramSpectrum | None = None,
) -> FrozenBasis:
    """Wide W_f whose k surely fits in the null space (max_rank <= d_in - n_f): Q is all null directions.

    Only K = W_f W_f^T (n_f x n_f) is factorised, for its eigenvalues (G's nonzero spectrum; ``spectrum`` when
    the caller has it, so that K need not live on). Q comes from n_f + k input coordinates J, a seeded random
    subset: the null space of the n_f x (n_f + k) column block W_f[:, J] (:func:`null_vectors`: LU, or
    Householder when LU's residual energy exceeds NULL_LU_TOLERANCE of the allowance), zero outside J, lies in
    W_f's null space. The block is factorised in place and gathered again for the residual: one block-sized
    buffer at a time. Deterministic for a seed; any basis of null directions is an exact bottom-k eigenspace.
    """
    d_in, n_f = rows.weight.shape[1], rows.n_rows
    spectrum = gram_spectrum(rows.output_gram(), backend) if spectrum is None else spectrum
    total = spectrum.trace
    k = k_for_tau(spectrum.values, tau, d_in, max_rank)
    g = torch.Generator(device="cpu").manual_seed(seed)
    cols = torch.sort(torch.randperm(d_in, generator=g)[: n_f + k]).values.to(rows.weight.device)
    for method in ("lu", "householder"):
        z = null_vectors(rows.columns(cols), k, backend, method, overwrite_c=True).to(rows.weight.device)
        residual = matmul(rows.columns(cols), z.contiguous()).double()
        energy = float((residual * residual).sum())
        del residual
        if energy <= NULL_LU_TOLERANCE * exactness_allowance(0.0, total):  # the optimum is 0 here
            break
    q = torch.zeros(d_in, k, dtype=rows.weight.dtype, device=rows.weight.device)
    q[cols] = z.to(q.dtype)
    return FrozenBasis(spectrum.values.to(rows.weight.dtype), k, q, energy / total if total > 0 else 0.0)


def fits_null_space(n_frozen: int, d_in: int, max_rank: int) -> bool:
    """Whether k <= max_rank surely fits in W_f's null space (wide W_f): then Q is null directions only."""
    return n_frozen < d_in and max_rank <= d_in - n_frozen


def frozen_energy_basis(
    frozen: torch.Tensor,
    tau: float,
    max_rank: int,
    seed: int = 0,
    keep: torch.Tensor | None = None,
    backend: str = "auto",
    output_spectrum: GramSpectrum | None = None,
) -> FrozenBasis:
    """Spectrum, k(tau) and the exact bottom-k eigenspace Q of G = W_f^T W_f, factorising the small side once.

    ``frozen`` is W_f itself, or (with ``keep``) the full weight whose rows outside ``keep`` are zero. When
    max_rank <= d_in - n_f, k fits in the null space of W_f and only K = W_f W_f^T is factorised
    (:func:`null_space_basis`); otherwise G is (:func:`bottom_eigenspace_from_input_gram`): tall W_f, or
    wide by less than max_rank rows (square layers after removing B), where G is at most max_rank larger.
    ``backend``: "lapack" (CPU tridiagonal), "torch" (torch.linalg.eigh, any device) or "auto".
    ``output_spectrum``: W_f W_f^T's, when the caller has factorised it (used on the null-space path only).
    """
    rows = FrozenRows(frozen, keep)
    d_in = frozen.shape[1]
    if fits_null_space(rows.n_rows, d_in, max_rank):
        return null_space_basis(rows, tau, max_rank, seed, backend, spectrum=output_spectrum)
    return bottom_eigenspace_from_input_gram(rows, tau, max_rank, backend)


# --------------------------------------------------------------------------- one module, end to end
@dataclass
class ModuleGeometry:
    """Everything PLATE needs for one weight, plus what reports show."""

    redundancy: torch.Tensor  # float32 [d_out]
    b_idx: torch.Tensor  # int64 [r], ascending
    basis: FrozenBasis
    k_by_tau: dict[float, int]

    @property
    def k(self) -> int:
        """The number of Q's columns (k chosen by tau and the rank cap)."""
        return self.basis.k


@ieee_float32_matmul()
def plate_geometry(
    weight: torch.Tensor,
    r: int,
    tau: float,
    max_rank: int,
    *,
    n_anchors: int = 256,
    sketch_dim: int | None = None,
    seed: int = 0,
    tau_grid: tuple[float, ...] = DEFAULT_TAU_GRID,
    overwrite_input: bool = False,
    backend: str = "auto",
) -> ModuleGeometry:
    """Redundancy, B, spectrum, k(tau) and Q for one d_out x d_in weight.

    Computed in the weight's precision: float32 or float64; bf16/fp16 weights (e.g. a model's own parameter) are
    upcast to float32 first, which is exact. A parameter is read, never differentiated through.
    With ``overwrite_input`` the B rows of a float32/float64 ``weight`` are zeroed in place instead of copying it.
    float32 matmuls run in IEEE float32 whatever the process's TF32 setting (:func:`ieee_float32_matmul`).
    """
    validate_settings(r=r, tau=tau, max_rank=max_rank, n_anchors=n_anchors, sketch_dim=sketch_dim)
    if weight.ndim != 2 or not weight.is_floating_point():
        raise ConfigError(f"plate_geometry needs a 2-D floating-point weight, got {weight.dtype}{list(weight.shape)}")
    if weight.is_meta:
        raise ConfigError(
            f"plate_geometry got a weight {list(weight.shape)} on the meta device (it has no values): load the "
            "model's weights first, or scan its checkpoint"
        )
    weight = weight.detach()
    if weight.dtype not in (torch.float32, torch.float64):
        if torch.finfo(weight.dtype).bits > 32:  # no wider float dtype than float64 exists in torch today
            raise ConfigError(f"plate_geometry cannot compute in {weight.dtype}: cast the weight to float64")
        weight = weight.to(torch.float32)  # bf16 / fp16 / fp8 values are all float32 values: exact
    d_out, d_in = weight.shape
    r_eff = effective_r(r, d_out)
    # wide weights: K = W W^T serves the redundancy scores (its anchor columns) and, cut to the frozen rows, the
    # spectrum; no separate W W_anchors^T product
    wide = not sketch_dim and fits_null_space(d_out - r_eff, d_in, max_rank)
    row_gram = FrozenRows(weight).output_gram() if wide else None
    scores = redundancy_scores(weight, n_anchors=n_anchors, sketch_dim=sketch_dim, seed=seed, row_gram=row_gram)
    if not bool(torch.isfinite(scores).all()):  # a NaN/Inf weight entry, or a row whose squared norm overflows
        raise ConfigError(
            f"plate_geometry: the {d_out}x{d_in} weight has {int((~torch.isfinite(weight)).sum())} NaN/Inf entries"
            f" and largest finite |value| {float(weight.abs().nan_to_num(0.0, 0.0, 0.0).max()):.3g}; its geometry is "
            "undefined (a corrupt checkpoint or a diverged run?)"
        )
    b_idx = select_redundant_rows(scores, r_eff)
    frozen = weight if overwrite_input else weight.clone()
    frozen[b_idx.to(frozen.device)] = 0
    keep_mask = torch.ones(d_out, dtype=torch.bool)
    keep_mask[b_idx] = False
    keep = torch.nonzero(keep_mask).flatten().to(frozen.device)
    # the frozen block of K factorised here, so that neither K lives on into the null vectors' LU
    spectrum = gram_spectrum(kept_block(row_gram, keep), backend) if row_gram is not None else None
    del row_gram
    basis = frozen_energy_basis(frozen, tau, max_rank, seed=seed, keep=keep, backend=backend, output_spectrum=spectrum)
    k_by_tau = {t: k_for_tau(basis.spectrum, t, d_in, max_rank) for t in sorted({*tau_grid, tau})}
    return ModuleGeometry(scores.cpu(), b_idx.cpu(), basis, k_by_tau)


def validate_settings(
    *, r: int, tau: float, max_rank: int, n_anchors: int = 256, sketch_dim: int | None = None
) -> None:
    """Reject out-of-range PLATE settings with a message that says what is allowed."""
    if not isinstance(r, int) or r < 1:
        raise ConfigError(f"r must be a positive integer, got {r!r}")
    if not 0.0 < real_value(tau) < 1.0:
        raise ConfigError(f"tau must lie strictly between 0 and 1, got {tau!r:.80}")
    if not isinstance(max_rank, int) or max_rank < 1:
        raise ConfigError(f"max_rank must be a positive integer, got {max_rank!r}")
    if not isinstance(n_anchors, int) or n_anchors < 1:
        raise ConfigError(f"anchors must be a positive integer, got {n_anchors!r}")
    if sketch_dim is not None and (not isinstance(sketch_dim, int) or sketch_dim < 1):
        raise ConfigError(f"sketch dim must be a positive integer, got {sketch_dim!r}")


def check_sketch_dim(sketch_dim: int | None, d_ins: Iterable[tuple[str, int]]) -> None:
    """Refuse a sketch wider than the rows it projects (its d_in x D Gaussian could need 100s of GB for nothing).

    ``d_ins``: (module name, d_in) of every target; a refusal names the smallest d_in (the first such module), the
    bound that holds for all of them, so following its advice cannot fail on the next module.
    """
    if sketch_dim is None:
        return
    d_ins = list(d_ins)
    if not d_ins:
        return
    module, d_in = min(d_ins, key=lambda pair: pair[1])
    if sketch_dim > d_in:
        which = (
            f"d_in={d_in}, the smallest input dimension of the {len(d_ins)} target modules (module '{module}')"
            if len(d_ins) > 1
            else f"the input dimension d_in={d_in} of the target module '{module}'"
        )
        raise ConfigError(
            f"sketch dim {sketch_dim} is larger than {which}; use --sketch-dim {d_in} or less (or leave it out: "
            "exact cosines)"
        )


# --------------------------------------------------------------------------- matched-capacity ablations
def random_rows(d_out: int, r: int, seed: int) -> torch.Tensor:
    """Random-B: r distinct output rows drawn uniformly (seeded), ascending int64."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.sort(torch.randperm(d_out, generator=g)[:r]).values.to(torch.int64)


def least_redundant_rows(scores: torch.Tensor, r: int) -> torch.Tensor:
    """Least-redundant-B: the r lowest redundancy scores (ties -> lower index), ascending int64."""
    order = torch.sort(scores, descending=False, stable=True).indices[: int(r)]
    return torch.sort(order).values.to(torch.int64)


def random_orthonormal(d_in: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random-Q: a Haar-random orthonormal k-frame in R^d_in (QR of a seeded Gaussian, signs fixed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d_in, k, generator=g, dtype=torch.float64))
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs[None, :]).to(dtype)


def high_energy_basis(frozen: torch.Tensor, k: int) -> torch.Tensor:
    """High-energy-Q: the top-k eigenvectors of W_f^T W_f (the top right singular vectors of W_f)."""
    _, _, vh = torch.linalg.svd(frozen, full_matrices=False)
    top = vh[: min(k, vh.shape[0])].T
    if top.shape[1] < k:  # more directions asked than the row space has: pad with null directions
        extra = random_orthonormal(frozen.shape[1], k - top.shape[1], seed=0, dtype=frozen.dtype)
        extra = extra - top @ (top.T @ extra)
        top = orthonormalize(torch.cat([top, extra], dim=1))
    return top.contiguous()
