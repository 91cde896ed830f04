"""The float32 geometry against a dense float64 numpy oracle, for the CPU (geometry/test_exactness) and CUDA
(geometry/test_cuda) tests: hard-spectrum weights in every shape class of an LLM layer, checked with the bound of
the trust issue, tr(Q^T G Q) <= 1.01 x (sum of the k smallest eigenvalues of G) + 1e-6 x tr(G)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plate_inspect.geometry import plate_geometry
from plate_inspect.testing.synthetic import hard_spectrum_weight

SHAPES = {
    "square": (384, 384),  # wide after removing B: d_in - n_f = 64 < max_rank, so G's side is factorised
    "tall": (1024, 384),  # gate/up
    "wide": (384, 1024),  # down: k fits in the null space
    "gqa-kv": (128, 1024),  # k/v with grouped-query attention
}
#: Qwen2.5-7B sizes, where the float32 Gram matrix's rounding is largest (it grows with the rows summed): gate/up
#: (G's side, 18944 rows summed) and q/o (square, wide by r rows after removing B)
SEVEN_B_SHAPES = {"gate-7b": (18944, 3584), "square-7b": (3584, 3584)}


def exact_reference(w: np.ndarray, b_idx: np.ndarray, tau: float, max_rank: int):
    """G of the frozen rows in float64, its eigenvalues (ascending), and k by definition on that spectrum."""
    frozen = np.delete(np.asarray(w, dtype=np.float64), b_idx, axis=0)
    gram = frozen.T @ frozen
    evals = np.clip(np.linalg.eigvalsh(gram), 0, None)
    cums = np.cumsum(evals[::-1])
    m = int(np.argmax(cums >= tau * cums[-1])) + 1
    return gram, evals, max(1, min(w.shape[1] - m, max_rank)), cums


def assert_exact(q: np.ndarray, k: int, spectrum: np.ndarray, w: np.ndarray, b_idx: np.ndarray, tau, max_rank):
    """Q, k and the spectrum of one module against the float64 oracle (the bound of the trust issue)."""
    gram, evals, k_exact, cums = exact_reference(w, b_idx, tau, max_rank)
    total = evals.sum()
    if k != k_exact:  # only legitimate when the cumulative energy sits at tau to float32 rounding
        m = w.shape[1] - k
        assert abs(cums[m - 1] - tau * cums[-1]) <= 1e-5 * total, (k, k_exact)
    q = q.astype(np.float64)
    assert q.shape == (w.shape[1], k)
    np.testing.assert_allclose(q.T @ q, np.eye(k), atol=1e-5)
    achieved, optimum = np.einsum("ij,ij->", q, gram @ q), evals[:k].sum()
    assert achieved <= 1.01 * optimum + 1e-6 * total, (achieved / total, optimum / total)
    n = min(w.shape[0] - len(b_idx), w.shape[1])
    np.testing.assert_allclose(spectrum, evals[::-1][:n], rtol=0, atol=2e-6 * evals.max())
    return achieved / total


def check_hard_case(
    d_out: int, d_in: int, alpha: float, storage: str, backend: str, orthogonal: bool = True, device: str = "cpu"
) -> None:
    """plate_geometry in float32 on one hard-spectrum weight (on ``device``), against the oracle."""
    gen = torch.Generator().manual_seed(int(10 * alpha) + d_out + d_in)
    if orthogonal:
        w = hard_spectrum_weight(d_out, d_in, gen, alpha=alpha, duplicates=d_out // 16)
    else:  # Gaussian factors, the benchmark checkpoints' weights
        w = hard_spectrum_weight(d_out, d_in, gen, alpha=alpha, orthogonal=False)
    if storage == "bf16":
        w = w.to(torch.bfloat16).float()
    stored = w.double().numpy()
    geo = plate_geometry(w.to(device), 64, 0.9, 512, backend=backend)
    assert geo.basis.q.dtype == torch.float32 and geo.basis.q.device.type == torch.device(device).type
    captured = assert_exact(
        geo.basis.q.cpu().numpy(), geo.k, geo.basis.spectrum.double().cpu().numpy(), stored, geo.b_idx.numpy(), 0.9, 512
    )
    assert geo.basis.captured_energy == pytest.approx(captured, rel=1e-3, abs=1e-9)
