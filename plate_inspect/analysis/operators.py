"""Restricted curvature as scipy LinearOperators on a family's coordinates, and their top eigenpair.

``M^T C M`` with C one of H0 (``hessian``), the Gauss-Newton matrix (``ggn``) or the drift Gram E[J^T J]
(``drift``), M the family's isometric basis (:mod:`plate_inspect.analysis.families`): one abstraction, in the style
of curvlinops, of size dim(S) and never dense at model size. The top eigenvalue is lambda(S), lambda_GN(S) or
eps(S)^2: Lanczos (:func:`scipy.sparse.linalg.eigsh`), or an exact dense eigendecomposition for tiny families.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

from plate_inspect.analysis.families import UpdateFamily
from plate_inspect.analysis.old_task import OldTaskProblem
from plate_inspect.errors import ConfigError, CurvatureError

#: Families with at most this many coordinates are eigendecomposed densely (exact) instead of by Lanczos.
DENSE_MAX_DIM = 64
#: eigsh's relative tolerance for the top eigenvalues (analyze_family(tol=) overrides it).
LANCZOS_TOL = 1e-6


def restricted_operator(problem: OldTaskProblem, family: UpdateFamily, kind: str = "hessian") -> LinearOperator:
    """M^T C M as a scipy LinearOperator on the family's coordinates; kind: hessian | ggn | drift."""
    products = {"hessian": problem.hvp, "ggn": problem.ggn_vp, "drift": problem.drift_vp}
    if kind not in products:
        raise ConfigError(f"unknown curvature kind '{kind}'; choose hessian, ggn or drift")
    product = products[kind]
    dtype = next(iter(problem.theta0.values())).dtype

    def matvec(c: np.ndarray) -> np.ndarray:
        ct = torch.from_numpy(np.ascontiguousarray(c, dtype=np.float64).reshape(-1)).to(dtype)
        with torch.no_grad():
            v = family.embed(ct)
        out = product(v)
        with torch.no_grad():
            return family.project(out).to(torch.float64).numpy()

    return LinearOperator((family.dim, family.dim), matvec=matvec, rmatvec=matvec, dtype=np.float64)


def counted_operator(op: LinearOperator, on_product: Callable[[int], None]) -> LinearOperator:
    """``op`` calling ``on_product(n)`` after its n-th application (a solve's progress: Lanczos takes an unknown
    number of products, each a pass over the old-task data)."""
    n = 0

    def matvec(c: np.ndarray) -> np.ndarray:
        nonlocal n
        out = op.matvec(c)
        n += 1
        on_product(n)
        return out

    return LinearOperator(op.shape, matvec=matvec, rmatvec=matvec, dtype=op.dtype)


def top_eigenpair(
    op: LinearOperator,
    seed: int = 0,
    tol: float = LANCZOS_TOL,
    dense_max_dim: int = DENSE_MAX_DIM,
    maxiter: int | None = None,
) -> tuple[float, np.ndarray]:
    """(largest algebraic eigenvalue, unit eigenvector) of a symmetric operator: Lanczos, or dense when tiny.

    Lanczos that does not converge within ``maxiter`` restarts (default max(1000, 20 min(dim, 500))) is a
    CurvatureError, never an unconverged value."""
    m = op.shape[0]
    if m <= dense_max_dim:
        dense = np.column_stack([op.matvec(e) for e in np.eye(m)])
        evals, evecs = np.linalg.eigh(0.5 * (dense + dense.T))
        return float(evals[-1]), evecs[:, -1]
    v0 = np.random.default_rng(seed).standard_normal(m)
    maxiter = max(1000, 20 * min(m, 500)) if maxiter is None else int(maxiter)
    try:
        evals, evecs = eigsh(op, k=1, which="LA", v0=v0, tol=tol, maxiter=maxiter)
    except ArpackNoConvergence:
        raise CurvatureError(
            f"Lanczos (eigsh) found no top eigenvalue of the {m}-dimensional restricted operator within {maxiter} "
            f"iterations at tol={tol:g}; loosen tol (analyze_family(..., tol=)) or give maxiter"
        ) from None
    return float(evals[0]), evecs[:, 0]
