"""Ties: equal scores go to the lowest indices; exact duplicate output rows fill B deterministically (which copies:
decided by rounding, see below); eigenvalue ties straddling the k boundary give a deterministic Q of optimal energy.

Oracles: the planted structure (copies of one row, a spectrum with a 6-fold repeated value around index k) and the
dense float64 definition (tests/oracles.dense_oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import dense_oracle

from plate_inspect.geometry import anchor_indices, exactness_allowance, plate_geometry, select_redundant_rows


def _copies_on_top(seed: int) -> tuple[np.ndarray, list[int]]:
    """Rows sharing a common direction, plus 4 exact copies of that direction (the most redundant rows), all with
    the same anchor status (an anchor leaves its own similarity out, so mixed ones differ by design)."""
    g = np.random.default_rng(seed)
    while True:
        d_out, d_in = int(g.integers(24, 600)), int(g.integers(8, 160))
        common = g.standard_normal(d_in)
        w = (common + 1.5 * g.standard_normal((d_out, d_in))).astype(np.float32)
        copies = sorted(int(c) for c in g.choice(d_out, size=4, replace=False))
        anchors = set(anchor_indices(d_out, 256).tolist())
        if len({c in anchors for c in copies}) == 1:
            w[copies] = common.astype(np.float32)
            return w, copies


def test_equal_scores_go_to_the_lowest_indices():
    scores = torch.tensor([0.5, 0.9, 0.2, 0.9, 0.9, 0.1, 0.9], dtype=torch.float32)
    assert select_redundant_rows(scores, 3).tolist() == [1, 3, 4]
    assert select_redundant_rows(scores, 5).tolist() == [0, 1, 3, 4, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_duplicate_rows_fill_b_deterministically(dtype):
    """Copies of the most redundant row: B takes r of them, the same ones on every call. Which ones is decided by the
    last bit of their scores, not by the index: BLAS computes identical rows at different positions of a product in
    different kernel paths (float32: 44 of 204 random cases scored copies of one row a last bit apart)."""
    for seed in range(40):
        w, copies = _copies_on_top(seed)
        weight = torch.from_numpy(w).to(dtype)
        runs = [plate_geometry(weight, r=2, tau=0.9, max_rank=4) for _ in range(2)]
        assert set(runs[0].b_idx.tolist()) <= set(copies), seed  # the planted copies are the most redundant rows
        assert torch.equal(runs[0].b_idx, runs[1].b_idx) and torch.equal(runs[0].redundancy, runs[1].redundancy)


def _planted(d_out: int, d_in: int, singular: np.ndarray, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    u, _ = np.linalg.qr(g.standard_normal((d_out, len(singular))))
    v, _ = np.linalg.qr(g.standard_normal((d_in, len(singular))))
    return (u * singular) @ v.T


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eigenvalue_tie_across_the_k_boundary_gives_a_deterministic_optimal_q(dtype):
    """Singular values 1.0 six times at positions 41-46 of 64; k = 20 takes 2 of them: any 2 of the tied directions
    are optimal (Q is not unique), and the one computed is the same on every call."""
    singular = np.concatenate([np.linspace(10, 3, 40), np.full(6, 1.0), np.linspace(0.5, 0.1, 18)])
    w = _planted(300, 64, singular, 2)
    runs = [plate_geometry(torch.from_numpy(w).to(dtype), r=8, tau=0.9, max_rank=20) for _ in range(2)]
    assert torch.equal(runs[0].basis.q, runs[1].basis.q) and torch.equal(runs[0].b_idx, runs[1].b_idx)
    _, b, _, k, _ = dense_oracle(w, 8, 0.9, 20)
    assert runs[0].k == k == 20 and runs[0].b_idx.tolist() == b.tolist()
    frozen = w.copy()
    frozen[b] = 0
    gram = frozen.T @ frozen
    evals = np.linalg.eigvalsh(gram)
    optimum = evals[:k].sum()
    q = runs[0].basis.q.double().numpy()
    assert np.trace(q.T @ gram @ q) - optimum <= 0.01 * exactness_allowance(optimum, evals.sum())
