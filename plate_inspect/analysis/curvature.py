"""Old-task curvature and functional drift restricted to an update family S (paper sections 2-3 and appendices
"Empirical diagnostic of the Gauss-Newton decomposition" and "Worst-case forgetting complementary experiment").

An update family is a linear subspace S of parameter space given by an isometric parametrisation
``c in R^m -> v = M c`` (M has orthonormal columns, so ||v|| = ||c||). Curvature is exposed as matrix-free
operators on the coordinates c, wrapped as :class:`scipy.sparse.linalg.LinearOperator` (one abstraction, in the
style of curvlinops):

- ``H_S  = M^T H0 M`` with H0 the Hessian of the old-task loss L0 (Hessian-vector products by double backward);
- ``GN_S = M^T J^T (d^2 loss / df^2) J M`` (Gauss-Newton: a jvp, the loss Hessian in output space, a vjp);
- ``D_S  = M^T E_x[J(x)^T J(x)] M`` (the drift Gram: ``c^T D_S c = ||J v||^2_{L2(P0)}``).

From them: lambda(S) = max eigenvalue of H_S and eps(S) = sqrt(max eigenvalue of D_S) by Lanczos
(:func:`scipy.sparse.linalg.eigsh`) on operators of dimension dim(S), never on dense model-size matrices; the
directional decomposition q_H, q_GN, q_R = q_H - q_GN over random unit probes; the forgetting curve
F(rho) = L0(theta0 + rho v*) - L0(theta0) along the top-curvature direction v*; and the bound of Proposition
"restricted curvature is bounded by functional drift", lambda(S) <= beta eps(S)^2 with beta the largest
eigenvalue of the per-sample loss Hessian in output space.

Families: the full backbone, a LoRA rank-r tangent space at a random init, the PLATE subspace B A Q^T from a bundle,
and the matched-capacity ablations Random-B, Random-Q and High-energy-Q.

One module per job, all re-exported here (this module is the public import path): the update families
(:mod:`~plate_inspect.analysis.families`), L0 and its products (:mod:`~plate_inspect.analysis.old_task`), the
restricted operators and their top eigenpair (:mod:`~plate_inspect.analysis.operators`), the digits model of
``plate-inspect curvature`` (:mod:`~plate_inspect.analysis.digits_setup`); this module holds the analysis itself
(probes, forgetting curve, :class:`CurvatureRecord`, :func:`analyze_family`, :func:`analyze_families`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

# the pieces, re-exported here: ``from plate_inspect.analysis.curvature import ...`` is the public import path
from plate_inspect.analysis.digits_setup import STAGE1_CHECKPOINT, DigitsSetup, digits_stage1
from plate_inspect.analysis.families import (
    PLATE_VARIANTS,
    Block,
    UpdateFamily,
    full_family,
    lora_family,
    lora_tangent_block,
    plate_family,
    selector_basis_block,
)
from plate_inspect.analysis.old_task import LossFn, OldTaskProblem, Params, batches, math_attention
from plate_inspect.analysis.operators import (
    DENSE_MAX_DIM,
    LANCZOS_TOL,
    counted_operator,
    restricted_operator,
    top_eigenpair,
)
from plate_inspect.arguments import finite_numbers, non_negative_int, non_negative_number, seed_argument
from plate_inspect.errors import ConfigError, CurvatureError
from plate_inspect.progress import ProgressCallback, ProgressCounter
from plate_inspect.train.layer import model_argument

__all__ = [
    "DEFAULT_RHOS",
    "DENSE_MAX_DIM",
    "LANCZOS_TOL",
    "PLATE_VARIANTS",
    "STAGE1_CHECKPOINT",
    "Block",
    "CurvatureRecord",
    "DigitsSetup",
    "LossFn",
    "OldTaskProblem",
    "Params",
    "UpdateFamily",
    "analyze_families",
    "analyze_family",
    "batches",
    "counted_operator",
    "digits_stage1",
    "family_parts",
    "forgetting_curve",
    "full_family",
    "gn_decomposition",
    "lora_family",
    "lora_tangent_block",
    "math_attention",
    "plate_family",
    "random_unit_probes",
    "restricted_operator",
    "selector_basis_block",
    "top_eigenpair",
]

#: Default step sizes for the forgetting curve F(rho).
DEFAULT_RHOS: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)


# --------------------------------------------------------------------------- the analysis
@dataclass
class CurvatureRecord:
    """Restricted curvature, drift radius, GN decomposition and forgetting curve of one family."""

    family: str
    dim: int
    lam: float  # lambda(S) = max_{v in S, |v|=1} v^T H0 v
    eps: float  # eps(S) = max_{v in S, |v|=1} ||J v||_{L2(P0)}
    gn_share_median: float  # median |q_GN| / |q_H| over probes
    residual_ratio_median: float  # median |q_R| / |q_GN| over probes
    forgetting_curve: list[tuple[float, float]]  # (rho, L0(theta0 + rho v*) - L0(theta0))
    lam_gn: float = float("nan")  # max eigenvalue of the restricted GGN (always <= beta eps^2)
    beta: float = float("nan")  # max eigenvalue of the per-sample output-space loss Hessian
    n_probes: int = 0
    q_h: list[float] = field(default_factory=list, repr=False)
    q_gn: list[float] = field(default_factory=list, repr=False)

    @property
    def bound(self) -> float:
        """beta eps(S)^2, the paper's bound on lambda(S) when the residual term is negligible."""
        return self.beta * self.eps**2

    @property
    def bound_ratio(self) -> float:
        """lambda(S) / (beta eps(S)^2): <= 1 where the bound holds; how far it is from holding otherwise."""
        return self.lam / self.bound if self.bound > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` record: the issue's keys, then the bound check (beta, lambda_gn, bound, bound_ratio).

        Strict JSON: an undefined value (a median over no probes, a ratio to a zero bound) is None, never NaN/inf,
        which ``json.dumps`` would write as the non-JSON tokens ``NaN`` / ``Infinity``."""
        return _finite_or_none(
            {
                "family": self.family,
                "dim": self.dim,
                "lambda": self.lam,
                "eps": self.eps,
                "gn_share_median": self.gn_share_median,
                "residual_ratio_median": self.residual_ratio_median,
                "forgetting_curve": [[float(r), float(f)] for r, f in self.forgetting_curve],
                "beta": self.beta,
                "lambda_gn": self.lam_gn,
                "bound": self.bound,
                "bound_ratio": self.bound_ratio,
            }
        )


def _finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts and lists, recursively) replaced by None."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def random_unit_probes(dim: int, n: int, seed: int) -> Iterator[np.ndarray]:
    """n unit vectors uniform on the sphere of R^dim (seeded), one at a time: the same vectors as the rows of one
    (n, dim) draw, without holding n x dim numbers (--probes 10^5 on the full backbone, dim 148,224: 119 GB)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        g = rng.standard_normal(dim)
        yield g / np.linalg.norm(g)


def gn_decomposition(
    problem: OldTaskProblem,
    family: UpdateFamily,
    n_probes: int = 100,
    seed: int = 0,
    counter: ProgressCounter | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q_H, q_GN, drift^2) for n random unit directions of the family; ``counter`` steps once per probe."""
    dtype = next(iter(problem.theta0.values())).dtype
    q_h, q_gn, drift = [], [], []
    for i, c in enumerate(random_unit_probes(family.dim, n_probes, seed)):
        with torch.no_grad():
            v = family.embed(torch.from_numpy(c).to(dtype))
        a, b, d = problem.quadratic_forms(v)
        q_h.append(a)
        q_gn.append(b)
        drift.append(d)
        if counter is not None:
            counter.step(f"{family.name}: probe {i + 1}/{n_probes}")
    return np.array(q_h), np.array(q_gn), np.array(drift)


def _median_ratio(num: np.ndarray, den: np.ndarray) -> float:
    """median(|num| / |den|) over the probes (a 0/0 probe is NaN, x/0 inf, as numpy gives them); NaN for none."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.abs(num) / np.abs(den)
    return float(np.median(r)) if r.size else float("nan")


def forgetting_curve(
    problem: OldTaskProblem, direction: Params, rhos: Sequence[float] = DEFAULT_RHOS
) -> list[tuple[float, float]]:
    """F(rho) = L0(theta0 + rho v) - L0(theta0) for each rho."""
    rhos = finite_numbers(rhos, "rhos", empty=True)
    base = problem.loss()
    return [(float(r), problem.loss({n: r * d for n, d in direction.items()}) - base) for r in rhos]


_SOLVES = (("hessian", "top Hessian eigenvalue"), ("ggn", "top GGN eigenvalue"), ("drift", "drift radius"))


def family_parts(n_probes: int) -> int:
    """The progress units of one family: three top-eigenvalue solves (Hessian, GGN, drift), one per GN probe and
    one for the forgetting curve (Lanczos takes an unknown number of products, so a solve is one unit; within it
    the progress label counts its products: :meth:`ProgressCounter.within`)."""
    return len(_SOLVES) + n_probes + 1


def analyze_family(
    problem: OldTaskProblem,
    family: UpdateFamily,
    n_probes: int = 100,
    rhos: Sequence[float] = DEFAULT_RHOS,
    seed: int = 0,
    beta: float | None = None,
    tol: float = LANCZOS_TOL,
    progress: ProgressCallback | None = None,
) -> CurvatureRecord:
    """lambda(S), eps(S), the restricted GGN's top eigenvalue, GN-share medians and F(rho) for one family.

    The top-curvature direction v* is signed so that g0 . v* >= 0 (the worse of +-v*, as g0 is rarely exactly 0).
    ``progress`` gets :func:`family_parts` events (unit "parts": a solve, a probe, the curve)."""
    if not isinstance(problem, OldTaskProblem):
        raise ConfigError(f"problem must be an OldTaskProblem(model, loss_fn, data), got {problem!r:.80}")
    n_probes, rhos, seed = _check_settings(family, n_probes, rhos, seed, "family")
    if beta is not None:
        beta = non_negative_number(beta, "beta")
    tol = non_negative_number(tol, "tol")
    counter = ProgressCounter(progress, family_parts(n_probes), "parts")
    counter.start()
    return _analyze_family(problem, family, n_probes, rhos, seed, beta, tol, counter)


def _analyze_family(
    problem: OldTaskProblem,
    family: UpdateFamily,
    n_probes: int,
    rhos: Sequence[float],
    seed: int,
    beta: float | None,
    tol: float,
    counter: ProgressCounter,
) -> CurvatureRecord:
    """:func:`analyze_family`, stepping ``counter`` after each of its :func:`family_parts` parts."""
    if family.dim < 1:
        raise CurvatureError(f"family {family.name} is empty")
    beta = problem.output_hessian_bound() if beta is None else float(beta)
    top = {}
    for i, (kind, what) in enumerate(_SOLVES):

        def product(n: int, what: str = what) -> None:
            counter.within(lambda: f"{family.name}: {what}, product {n}")

        op = counted_operator(restricted_operator(problem, family, kind), product)
        top[kind] = top_eigenpair(op, seed=seed + i, tol=tol)
        counter.step(f"{family.name}: {what}")
    (lam, c_star), (lam_gn, _), (eps_sq, _) = top["hessian"], top["ggn"], top["drift"]
    dtype = next(iter(problem.theta0.values())).dtype
    with torch.no_grad():
        v_star = family.embed(torch.from_numpy(np.ascontiguousarray(c_star)).to(dtype))
    g0 = problem.gradient(v_star)
    if sum(float((g0[n] * v_star[n]).sum()) for n in v_star) < 0:
        v_star = {n: -d for n, d in v_star.items()}
    q_h, q_gn, _ = gn_decomposition(problem, family, n_probes=n_probes, seed=seed + 3, counter=counter)
    curve = forgetting_curve(problem, v_star, rhos)
    counter.step(f"{family.name}: forgetting curve")
    return CurvatureRecord(
        family=family.name,
        dim=family.dim,
        lam=lam,
        eps=math.sqrt(max(eps_sq, 0.0)),
        gn_share_median=_median_ratio(q_gn, q_h),
        residual_ratio_median=_median_ratio(q_h - q_gn, q_gn),
        forgetting_curve=curve,
        lam_gn=lam_gn,
        beta=beta,
        n_probes=int(n_probes),
        q_h=[float(a) for a in q_h],
        q_gn=[float(b) for b in q_gn],
    )


def _check_settings(
    family: object, n_probes: object, rhos: object, seed: object, argument: str = "families"
) -> tuple[int, list[float], int]:
    """(n_probes, rhos, seed) checked: n_probes >= 0 (0: no GN probes, the medians are undefined), finite rhos
    (none: no forgetting curve), a seed numpy and torch take (0..2^63-1); ``family`` an UpdateFamily. ConfigError
    naming the argument otherwise."""
    if not isinstance(family, UpdateFamily):
        raise ConfigError(
            f"{argument}: each must be an UpdateFamily (from full_family, lora_family or plate_family), "
            f"got {family!r:.80}"
        )
    return non_negative_int(n_probes, "n_probes"), finite_numbers(rhos, "rhos", empty=True), seed_argument(seed)


def analyze_families(
    model: nn.Module,
    loss_fn: LossFn,
    data: Iterable[tuple[Any, torch.Tensor]],
    families: Sequence[UpdateFamily],
    n_probes: int = 100,
    rhos: Sequence[float] = DEFAULT_RHOS,
    seed: int = 0,
    forward: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    progress: ProgressCallback | None = None,
) -> list[CurvatureRecord]:
    """The Python API: one :class:`CurvatureRecord` per family for any model, loss and old-task data loader.

    ``progress`` gets :func:`family_parts` events per family (unit "parts": each top-eigenvalue solve, GN probe and
    forgetting curve), so the bar moves within a large family too."""
    model_argument(model, "analyze_families")
    if isinstance(families, (UpdateFamily, str)) or not isinstance(families, Sequence) or not families:
        raise ConfigError(f"families must be a non-empty list of UpdateFamily objects, got {families!r:.80}")
    for fam in families:
        n_probes, rhos, seed = _check_settings(fam, n_probes, rhos, seed)
    counter = ProgressCounter(progress, len(families) * family_parts(n_probes), "parts")
    counter.start()
    was_training = model.training
    try:
        problem = OldTaskProblem(model, loss_fn, data, forward=forward)
        beta = problem.output_hessian_bound()
        out = []
        for fam in families:
            out.append(_analyze_family(problem, fam, n_probes, rhos, seed, beta, LANCZOS_TOL, counter))
    finally:
        model.train(was_training)
    return out
