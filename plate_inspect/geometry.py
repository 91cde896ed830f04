"""PLATE geometry of one weight matrix: redundancy scores, the output selector B, the frozen-row energy
spectrum, k(tau) and the low-energy input basis Q.

Pure functions, tensor in and tensor out; they never read files. Math runs in the dtype of the input
(float32 or float64; the scanner upcasts bf16/fp16 weights). Heavy products and eigendecompositions go
through :func:`matmul` and :func:`symmetric_eigh`: on CPU they call NumPy/SciPy (OpenBLAS ran these ~2x
faster than torch's bundled MKL on the project's AMD machines, see ``benchmarks/``), on CUDA they stay in torch.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch

from plate_inspect.errors import ConfigError

#: tau values at which every module's k is recorded, for k(tau) curves in reports.
DEFAULT_TAU_GRID: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99)


# --------------------------------------------------------------------------- linear-algebra backend
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


def orthonormalize(m: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of m's column span, in m's column order (leading columns span leading columns).

    CholeskyQR2 in float64 (Gram matrix, Cholesky, triangular solve; twice): BLAS-3 only, much faster than
    Householder QR for tall blocks, and as accurate for the well-conditioned blocks built here. Falls back to
    Householder QR when the Gram matrix is not numerically positive definite.
    """
    x = m.double()
    for _ in range(2):
        chol, info = torch.linalg.cholesky_ex(matmul(x.T, x))
        if int(info) != 0:
            x = torch.linalg.qr(m.double()).Q
            break
        x = torch.linalg.solve_triangular(chol.T, x, upper=True, left=False)
    return x.to(m.dtype)


def cholesky_solver(s: torch.Tensor):
    """``b -> s^{-1} b`` for a symmetric positive definite s (float64 Cholesky), or None if s is not PD."""
    s64 = s.double()
    if s64.device.type == "cpu":
        try:
            factor = scipy.linalg.cho_factor(s64.numpy(), lower=True, check_finite=False)
        except np.linalg.LinAlgError:
            return None
        return lambda b: torch.from_numpy(scipy.linalg.cho_solve(factor, b.double().numpy(), check_finite=False))
    chol, info = torch.linalg.cholesky_ex(s64)
    if int(info) != 0:
        return None
    return lambda b: torch.cholesky_solve(b.double(), chol)


def symmetric_eigvalsh(s: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (ascending) of a symmetric matrix, without eigenvectors (about 2x cheaper than eigh)."""
    if s.device.type == "cpu":
        return torch.from_numpy(scipy.linalg.eigvalsh(s.numpy(), driver="evd", check_finite=False))
    return torch.linalg.eigvalsh(s)


def seeded_gaussian(rows: int, cols: int, seed: int, like: torch.Tensor) -> torch.Tensor:
    """A reproducible standard Gaussian matrix: drawn on CPU (same numbers on every device), then moved."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64).to(device=like.device, dtype=like.dtype)


def module_seed(seed: int, name: str) -> int:
    """A per-module seed that depends only on the run seed and the module name (not on scan order)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------- B: redundant output rows
def effective_r(r: int, d_out: int) -> int:
    """r capped at 90% of the output rows, so at least 10% of rows stay frozen and define Q."""
    return min(int(r), int(math.floor(0.9 * d_out)))


def anchor_indices(d_out: int, n_anchors: int) -> torch.Tensor:
    """A strided, deterministic set of anchor rows: min(n_anchors, d_out) rows spread evenly."""
    n = min(int(n_anchors), d_out)
    return (torch.arange(n, dtype=torch.int64) * d_out) // n


def redundancy_scores(
    weight: torch.Tensor, n_anchors: int = 256, sketch_dim: int | None = None, seed: int = 0
) -> torch.Tensor:
    """s_i = mean over anchor rows j != i of |cos(w_i, w_j)|, as float32 [d_out].

    Exact cosines by default (d_out * |A| * d_in flops). With ``sketch_dim`` D, the paper's estimate: cosines
    of z_i = w_i R / ||w_i|| for a seeded Gaussian R (d_in x D, scaled by 1/sqrt(D)). An anchor's similarity
    to itself is left out, so anchors are not favoured; all-zero rows score 0.
    """
    d_out, d_in = weight.shape
    anchors = anchor_indices(d_out, n_anchors).to(weight.device)
    norms = torch.linalg.vector_norm(weight, dim=1)
    inv = torch.where(norms > 0, 1.0 / norms.clamp_min(torch.finfo(weight.dtype).tiny), torch.zeros_like(norms))
    if sketch_dim:
        proj = seeded_gaussian(d_in, int(sketch_dim), seed, weight) / math.sqrt(int(sketch_dim))
        z = matmul(weight, proj) * inv[:, None]
        cos = matmul(z, z[anchors].T.contiguous()).abs()
    else:
        cos = matmul(weight, weight[anchors].T.contiguous()).abs() * inv[:, None] * inv[anchors][None, :]
    cos[anchors, torch.arange(len(anchors), device=weight.device)] = 0.0
    is_anchor = torch.zeros(d_out, dtype=weight.dtype, device=weight.device)
    is_anchor[anchors] = 1.0
    denom = (len(anchors) - is_anchor).clamp_min(1.0)
    return (cos.sum(dim=1) / denom).to(torch.float32)


def select_redundant_rows(scores: torch.Tensor, r: int) -> torch.Tensor:
    """B as indices: the r highest scores (ties -> lower index), returned ascending, int64."""
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
@dataclass
class FrozenBasis:
    """The frozen rows' energy spectrum, k(tau), and an orthonormal basis Q of the bottom-k eigenspace."""

    spectrum: torch.Tensor  # eigenvalues of W_frozen^T W_frozen, descending, length min(n_frozen, d_in)
    k: int
    q: torch.Tensor  # [d_in, k], orthonormal columns, ascending energy
    captured_energy: float  # tr(Q^T G Q) / tr(G)


def frozen_energy_basis(
    frozen: torch.Tensor, tau: float, max_rank: int, seed: int = 0, keep: torch.Tensor | None = None
) -> FrozenBasis:
    """Bottom-k eigenspace of G = W_f^T W_f without forming G when W_f is wide.

    ``frozen`` is W_f itself, or (with ``keep``) the full weight whose rows outside ``keep`` are zero: then
    W_f = frozen[keep] and no row copy is made. Tall W_f: eigh of G (d_in x d_in, the small side). Wide W_f:
    eigh of K = W_f W_f^T gives the spectrum and the row space; G's null space (dimension d_in - rank) is
    the bottom of its spectrum, so Q takes null directions first, then the smallest nonzero ones
    (V = W_f^T u / sqrt(lambda)). Null directions are a seeded Gaussian d_in x n block projected off the row
    space (a second pass when rounding left a trace) and orthonormalised: deterministic for a given seed, and
    any such basis is exact. When max_rank <= d_in - n_frozen, Q is certainly all null directions: then only
    eigenvalues are computed and the projection uses a Cholesky solve with K (eigh is the fallback).
    """
    d_in = frozen.shape[1]
    n_frozen = frozen.shape[0] if keep is None else int(keep.numel())
    eps = torch.finfo(frozen.dtype).eps
    if n_frozen >= d_in:
        gram = matmul(frozen.T, frozen)
        evals, evecs = symmetric_eigh(gram)
        lam = evals.clamp_min(0)
        spectrum = lam.flip(0)
        k = k_for_tau(spectrum, tau, d_in, max_rank)
        q = evecs[:, :k].contiguous()
        captured_num = float((matmul(gram, q) * q).sum())
        total = float(torch.diagonal(gram).sum())
        return FrozenBasis(spectrum.to(torch.float32), k, q, captured_num / total if total > 0 else 0.0)

    gram_rows = matmul(frozen, frozen.T)
    if keep is not None:
        gram_rows = gram_rows[keep][:, keep]

    def expand(rows_part: torch.Tensor) -> torch.Tensor:
        """Vectors over W_f's rows -> vectors over all of frozen's rows (zeros outside keep)."""
        if keep is None:
            return rows_part
        full = torch.zeros(frozen.shape[0], rows_part.shape[1], dtype=rows_part.dtype, device=rows_part.device)
        full[keep] = rows_part
        return full

    def captured_energy(q: torch.Tensor, total: float) -> float:
        wq = matmul(frozen, q)
        return float((wq * wq).sum()) / total if total > 0 else 0.0

    # k <= d_in - n_frozen <= dim null(W_f) is certain when max_rank fits: then Q is all null directions and
    # only the eigenvalues are needed; the projection off the row space uses a Cholesky solve with K.
    solve = cholesky_solver(gram_rows) if max_rank <= d_in - n_frozen else None
    if solve is not None:
        lam = symmetric_eigvalsh(gram_rows).clamp_min(0)
        spectrum = lam.flip(0)
        k = k_for_tau(spectrum, tau, d_in, max_rank)
        total = float(lam.sum())

        def off_row_space_chol(p: torch.Tensor) -> torch.Tensor:
            y = matmul(frozen, p)
            y = y[keep] if keep is not None else y
            return p - matmul(frozen.T, expand(solve(y).to(p.dtype)).contiguous())

        q = orthonormalize(off_row_space_chol(seeded_gaussian(d_in, k, seed, frozen))).contiguous()
        captured = captured_energy(q, total)
        if captured > 1e-9:  # rounding left part of the row space: one more pass removes it
            q = orthonormalize(off_row_space_chol(q)).contiguous()
            captured = captured_energy(q, total)
        return FrozenBasis(spectrum.to(torch.float32), k, q, captured)

    evals, u = symmetric_eigh(gram_rows)
    lam = evals.clamp_min(0)
    spectrum = lam.flip(0)
    k = k_for_tau(spectrum, tau, d_in, max_rank)
    tol = float(lam.max()) * n_frozen * eps if n_frozen else 0.0
    nonzero = lam > tol
    rank = int(nonzero.sum())
    u_nz, lam_nz = u[:, nonzero], lam[nonzero]
    n_null = min(k, d_in - rank)

    def off_row_space(p: torch.Tensor) -> torch.Tensor:
        y = matmul(frozen, p)
        y = y[keep] if keep is not None else y
        coeff = matmul(u_nz, matmul(u_nz.T, y) / lam_nz[:, None])
        return p - matmul(frozen.T, expand(coeff).contiguous())

    blocks = []
    if n_null > 0:  # projecting twice removes what rounding left of the row space after the first pass
        blocks.append(off_row_space(off_row_space(seeded_gaussian(d_in, n_null, seed, frozen))))
    n_low = k - n_null
    if n_low > 0:  # the smallest nonzero directions (lam_nz is ascending)
        v = matmul(frozen.T, expand(u_nz[:, :n_low]).contiguous()) / lam_nz[:n_low].sqrt()[None, :]
        blocks.append(v)
    q = orthonormalize(torch.cat(blocks, dim=1)).contiguous()
    return FrozenBasis(spectrum.to(torch.float32), k, q, captured_energy(q, float(lam.sum())))


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
        return self.basis.k


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
) -> ModuleGeometry:
    """Redundancy, B, spectrum, k(tau) and Q for one d_out x d_in weight (float32 or float64).

    With ``overwrite_input`` the B rows of ``weight`` are zeroed in place instead of copying the matrix.
    """
    validate_settings(r=r, tau=tau, max_rank=max_rank, n_anchors=n_anchors, sketch_dim=sketch_dim)
    if weight.ndim != 2 or not weight.is_floating_point() or weight.dtype not in (torch.float32, torch.float64):
        raise ConfigError(f"plate_geometry needs a 2-D float32/float64 weight, got {weight.dtype}{list(weight.shape)}")
    d_out, _ = weight.shape
    scores = redundancy_scores(weight, n_anchors=n_anchors, sketch_dim=sketch_dim, seed=seed)
    b_idx = select_redundant_rows(scores, effective_r(r, d_out))
    frozen = weight if overwrite_input else weight.clone()
    frozen[b_idx.to(frozen.device)] = 0
    keep_mask = torch.ones(d_out, dtype=torch.bool)
    keep_mask[b_idx] = False
    keep = torch.nonzero(keep_mask).flatten().to(frozen.device)
    basis = frozen_energy_basis(frozen, tau, max_rank, seed=seed, keep=keep)
    d_in = weight.shape[1]
    k_by_tau = {t: k_for_tau(basis.spectrum, t, d_in, max_rank) for t in sorted({*tau_grid, tau})}
    return ModuleGeometry(scores.cpu(), b_idx.cpu(), basis, k_by_tau)


def validate_settings(
    *, r: int, tau: float, max_rank: int, n_anchors: int = 256, sketch_dim: int | None = None
) -> None:
    """Reject out-of-range PLATE settings with a message that says what is allowed."""
    if not isinstance(r, int) or r < 1:
        raise ConfigError(f"r must be a positive integer, got {r!r}")
    if not (0.0 < float(tau) < 1.0):
        raise ConfigError(f"tau must lie strictly between 0 and 1, got {tau!r}")
    if not isinstance(max_rank, int) or max_rank < 1:
        raise ConfigError(f"max_rank must be a positive integer, got {max_rank!r}")
    if not isinstance(n_anchors, int) or n_anchors < 1:
        raise ConfigError(f"anchors must be a positive integer, got {n_anchors!r}")
    if sketch_dim is not None and (not isinstance(sketch_dim, int) or sketch_dim < 1):
        raise ConfigError(f"sketch dim must be a positive integer, got {sketch_dim!r}")


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
