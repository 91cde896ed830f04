"""PLATE geometry of many same-shaped expert matrices at once: one batched eigensolve per group.

DeepSeek-V3 has ~15,000 expert matrices per 1,000 attention ones; on a GPU, solving them one by one leaves it
mostly idle. Here E experts of one projection (same [d_out, d_in]) go through the same steps as
:func:`plate_inspect.geometry.plate_geometry` -- redundancy scores, B, the frozen rows' spectrum, k(tau), Q -- with
the Gram matrices (on the small side) formed by one batched product and diagonalised by one batched
``torch.linalg.eigh``, in float64 (so Q is the exact bottom-k eigenspace up to float64 rounding, whatever the scan
precision). Per-expert work left after the eigensolve is a few thin products. The same code runs on CPU (tests
compare it with the per-module path there); the scanner uses it on CUDA only, where memory per group is
bounded by :data:`DEFAULT_GROUP_BYTES`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from plate_inspect.geometry import (
    DEFAULT_TAU_GRID,
    FrozenBasis,
    ModuleGeometry,
    anchor_indices,
    effective_r,
    ieee_float32_matmul,
    k_for_tau,
    seeded_gaussian,
    select_redundant_rows,
    validate_settings,
)
from plate_inspect.targets import TargetModule

#: Stored bytes of one batched group at most (the group is upcast to float64 on the device: ~4x this).
DEFAULT_GROUP_BYTES = 512 * 1024 * 1024
#: Experts per group at most.
DEFAULT_GROUP_SIZE = 64


def batched_redundancy_scores(
    weights: torch.Tensor, n_anchors: int = 256, sketch_dim: int | None = None, seeds: Sequence[int] = ()
) -> torch.Tensor:
    """Redundancy scores of each of E weights [E, d_out, d_in] -> float32 [E, d_out], as ``redundancy_scores``."""
    n_exp, d_out, d_in = weights.shape
    anchors = anchor_indices(d_out, n_anchors).to(weights.device)
    norms = torch.linalg.vector_norm(weights, dim=2)
    inv = torch.where(norms > 0, 1.0 / norms.clamp_min(torch.finfo(weights.dtype).tiny), torch.zeros_like(norms))
    if sketch_dim:
        proj = torch.stack([seeded_gaussian(d_in, int(sketch_dim), s, weights) for s in seeds])
        z = torch.bmm(weights, proj / math.sqrt(int(sketch_dim))) * inv[:, :, None]
        cos = torch.bmm(z, z[:, anchors].transpose(1, 2)).abs()
    else:
        cos = torch.bmm(weights, weights[:, anchors].transpose(1, 2)).abs()
        cos = cos * inv[:, :, None] * inv[:, anchors][:, None, :]
    cos[:, anchors, torch.arange(len(anchors), device=weights.device)] = 0.0
    is_anchor = torch.zeros(d_out, dtype=weights.dtype, device=weights.device)
    is_anchor[anchors] = 1.0
    denom = (len(anchors) - is_anchor).clamp_min(1.0)
    return (cos.sum(dim=2) / denom).to(torch.float32)


def _bottom_k_wide(
    kept: torch.Tensor, evals: torch.Tensor, u: torch.Tensor, k: int, seed: int
) -> tuple[torch.Tensor, float]:
    """Bottom-k eigenvectors of G = W_f^T W_f from the eigenpairs (evals, u) of K = W_f W_f^T (W_f = ``kept``,
    wide): null directions first (a seeded Gaussian projected off the row space, twice), then the smallest
    nonzero ones (W_f^T u / sqrt(lambda)). float64 throughout."""
    n_frozen, d_in = kept.shape
    lam = evals.clamp_min(0)
    tol = float(lam.max()) * n_frozen * torch.finfo(torch.float64).eps if n_frozen else 0.0
    nonzero = lam > tol
    u_nz, lam_nz = u[:, nonzero], lam[nonzero]
    n_null = min(k, d_in - int(nonzero.sum()))

    def off_row_space(p: torch.Tensor) -> torch.Tensor:
        return p - kept.T @ (u_nz @ ((u_nz.T @ (kept @ p)) / lam_nz[:, None]))

    blocks = []
    if n_null > 0:
        blocks.append(off_row_space(off_row_space(seeded_gaussian(d_in, n_null, seed, kept))))
    if k - n_null > 0:
        blocks.append(kept.T @ u_nz[:, : k - n_null] / lam_nz[: k - n_null].sqrt()[None, :])
    q = torch.linalg.qr(torch.cat(blocks, dim=1)).Q
    wq = kept @ q
    total = float(lam.sum())
    return q, float((wq * wq).sum()) / total if total > 0 else 0.0


@ieee_float32_matmul()
def batched_plate_geometry(
    weights: torch.Tensor,
    r: int,
    tau: float,
    max_rank: int,
    *,
    seeds: Sequence[int],
    n_anchors: int = 256,
    sketch_dim: int | None = None,
    tau_grid: tuple[float, ...] = DEFAULT_TAU_GRID,
) -> list[ModuleGeometry]:
    """:func:`~plate_inspect.geometry.plate_geometry` of each of E same-shaped weights [E, d_out, d_in].

    ``seeds`` holds each expert's module seed (null directions, sketches), so an expert gets the same B, k and
    Q subspace as when solved alone. Scores use the input dtype; spectra and Q are computed in float64; Q is
    returned in the input dtype.
    """
    validate_settings(r=r, tau=tau, max_rank=max_rank, n_anchors=n_anchors, sketch_dim=sketch_dim)
    if weights.ndim != 3 or weights.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"batched_plate_geometry needs [E, d_out, d_in] float32/float64, got {weights.dtype}")
    n_exp, d_out, d_in = weights.shape
    if len(seeds) != n_exp:
        raise ValueError(f"{len(seeds)} seeds for {n_exp} experts")
    scores = batched_redundancy_scores(weights, n_anchors, sketch_dim, seeds)
    r_eff = effective_r(r, d_out)
    b_idx = torch.stack([select_redundant_rows(s, r_eff) for s in scores.cpu()])
    keep_mask = torch.ones(n_exp, d_out, dtype=torch.bool)
    keep_mask[torch.arange(n_exp)[:, None], b_idx] = False
    keep = torch.nonzero(keep_mask)[:, 1].reshape(n_exp, -1).to(weights.device)  # frozen rows, ascending
    kept = torch.gather(weights, 1, keep[:, :, None].expand(-1, -1, d_in)).double()  # W_f [E, n_frozen, d_in]
    n_frozen = d_out - r_eff
    tall = n_frozen >= d_in
    gram = kept.transpose(1, 2) @ kept if tall else kept @ kept.transpose(1, 2)
    evals, evecs = torch.linalg.eigh(gram)  # the one batched eigensolve
    out = []
    grid = sorted({*tau_grid, tau})
    for e in range(n_exp):
        spectrum = evals[e].clamp_min(0).flip(0)
        k = k_for_tau(spectrum, tau, d_in, max_rank)
        if tall:
            q = evecs[e, :, :k]
            total = float(torch.diagonal(gram[e]).sum())
            captured = float((gram[e] @ q * q).sum()) / total if total > 0 else 0.0
        else:
            q, captured = _bottom_k_wide(kept[e], evals[e], evecs[e], k, seeds[e])
        stored = spectrum.to(weights.dtype)  # the scan's precision, as plate_geometry keeps it
        basis = FrozenBasis(stored, k, q.to(weights.dtype).contiguous(), captured)
        k_by_tau = {t: k_for_tau(stored, t, d_in, max_rank) for t in grid}
        out.append(ModuleGeometry(scores[e].cpu(), b_idx[e], basis, k_by_tau))
    return out


def expert_groups(
    todo: Sequence[tuple[str, TargetModule]],
    max_group: int = DEFAULT_GROUP_SIZE,
    max_bytes: int = DEFAULT_GROUP_BYTES,
) -> list[tuple[str, list[TargetModule]]]:
    """Split the scan's (part, target) list into work items: the experts of one part with the same module type
    and shape become groups of at most ``max_group`` experts / ``max_bytes`` stored bytes (at the position of
    their first member); every other target is a group of one. Parts stay contiguous, so they still finish one
    after another."""
    items: list[tuple[str, list[TargetModule]]] = []
    open_groups: dict[tuple, list[TargetModule]] = {}
    last_part = None
    for part, target in todo:
        if part != last_part:
            open_groups, last_part = {}, part
        if max_group <= 1 or target.expert is None:
            items.append((part, [target]))
            continue
        key = (target.module_type, target.shape, target.layout)
        group = open_groups.get(key)
        if group is not None and len(group) < max_group and sum(t.nbytes for t in group) + target.nbytes <= max_bytes:
            group.append(target)
            continue
        open_groups[key] = [target]
        items.append((part, open_groups[key]))
    return items
