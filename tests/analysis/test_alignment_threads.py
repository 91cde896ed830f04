"""The alignment's eigendecompositions of small matrices run on one BLAS thread (OpenBLAS's threads, busy-waiting
for each other at every level-2 call, made `plate-inspect align` on MiniLM spend 388 of 468 s in 72 eighs of at most
1536 x 1536 on a loaded 2-core machine); larger ones keep the threads they had."""

from __future__ import annotations

import torch
from threadpoolctl import threadpool_info, threadpool_limits

from plate_inspect.analysis import alignment_math
from plate_inspect.analysis.alignment_math import alignment_from_moments


def blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def eigh_threads(monkeypatch, d_in: int) -> list[set[int]]:
    """The BLAS thread counts seen inside each eigh of one layer's alignment, with 2 threads set outside."""
    seen: list[set[int]] = []
    eigh = alignment_math.symmetric_eigh

    def spy(s: torch.Tensor):
        seen.append(blas_threads())
        return eigh(s)

    monkeypatch.setattr(alignment_math, "symmetric_eigh", spy)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, d_in, generator=g, dtype=torch.float64)
    x = torch.randn(200, d_in, generator=g, dtype=torch.float64)
    with threadpool_limits(limits=2, user_api="blas"):
        records = alignment_from_moments("fc", w, x.T @ x / 200, ks=(4,), n_random=2)
        assert blas_threads() == {2}  # restored after the layer
    assert len(records) == 1 and 0 < records[0].ve_weight <= 1
    return seen


def test_small_eighs_run_on_one_blas_thread(monkeypatch):
    assert eigh_threads(monkeypatch, 64) == [{1}, {1}]  # Sigma and W^T W


def test_large_eighs_keep_their_threads(monkeypatch):
    monkeypatch.setattr(alignment_math, "ONE_THREAD_EIGH_MAX_DIM", 32)
    assert eigh_threads(monkeypatch, 64) == [{2}, {2}]
