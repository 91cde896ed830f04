"""GIL-free LAPACK calls (plate_inspect._lapack_nogil) against dense NumPy oracles, and the GIL actually released."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import scipy.linalg
import torch

from plate_inspect import geometry
from plate_inspect._lapack_nogil import (
    apply_tridiagonal_reflectors,
    tridiagonal_all_eigenvectors,
    tridiagonal_eigenvalues,
    tridiagonal_eigenvectors,
    tridiagonalize,
)


def _symmetric(n: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n + 5))
    return (a @ a.T).astype(dtype)


def _tridiagonal(d: np.ndarray, e: np.ndarray) -> np.ndarray:
    return np.diag(d) + np.diag(e, 1) + np.diag(e, -1)


@pytest.mark.parametrize("n", [2, 60, 300])  # 300: the reflectors in 3 blocks (128, 128, 43)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tridiagonal_reduction_keeps_the_spectrum_and_its_reflectors_map_vectors_back(dtype, n):
    s = _symmetric(n, dtype)
    a = np.asfortranarray(s.copy())
    d, e, tau = tridiagonalize(a)
    oracle = np.linalg.eigvalsh(s.astype(np.float64))
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(tridiagonal_eigenvalues(d, e), oracle, rtol=0, atol=tol * oracle.max())
    # T's eigenvectors, mapped back by the reflectors, are eigenvectors of s
    w, z = np.linalg.eigh(_tridiagonal(d.astype(np.float64), e.astype(np.float64)))
    p = min(7, n)
    v = apply_tridiagonal_reflectors(a, tau, z[:, :p].astype(dtype)).astype(np.float64)
    residual = s.astype(np.float64) @ v - v * w[:p]
    assert np.abs(residual).max() < tol * oracle.max()
    np.testing.assert_allclose(v.T @ v, np.eye(p), atol=10 * tol)
    # all n vectors: H itself, orthogonal, and H T H^T = s
    h = apply_tridiagonal_reflectors(a, tau, np.eye(n, dtype=dtype)).astype(np.float64)
    np.testing.assert_allclose(h.T @ h, np.eye(n), atol=10 * tol)
    t = _tridiagonal(d.astype(np.float64), e.astype(np.float64))
    assert np.abs(h @ t @ h.T - s).max() < tol * oracle.max()


def test_mrrr_eigenvectors_of_an_index_range_match_the_dense_oracle():
    rng = np.random.default_rng(1)
    d, e = rng.standard_normal(80), rng.standard_normal(79)
    w, z = np.linalg.eigh(_tridiagonal(d, e))
    got = tridiagonal_eigenvectors(d, e, 10, 29)
    assert got.shape == (80, 20)
    np.testing.assert_allclose(np.abs(np.sum(got * z[:, 10:30], axis=0)), 1.0, atol=1e-10)  # same vectors, up to sign
    # two ranges computed separately are orthogonal to each other
    rest = tridiagonal_eigenvectors(d, e, 30, 39)
    assert np.abs(got.T @ rest).max() < 1e-10


@pytest.mark.parametrize("n", [1, 2, 90])
def test_divide_and_conquer_eigenvectors_match_the_dense_oracle_and_scipys_wrapper(n):
    """dstevd from the Cython LAPACK (every scipy): T's eigenvectors; on a scipy >= 1.16, whose f2py wrapper of the
    same routine exists, the very same bits."""
    rng = np.random.default_rng(2)
    d, e = rng.standard_normal(n), rng.standard_normal(n - 1)
    d_in, e_in = d.copy(), e.copy()
    got = tridiagonal_all_eigenvectors(d, e)
    np.testing.assert_array_equal(d, d_in)  # the caller's arrays are not overwritten
    np.testing.assert_array_equal(e, e_in)
    w, z = np.linalg.eigh(_tridiagonal(d, e))
    assert got.shape == (n, n) and got.flags.f_contiguous
    np.testing.assert_allclose(np.abs(np.sum(got * z, axis=0)), 1.0, atol=1e-10)  # same vectors, up to sign
    np.testing.assert_allclose(got.T @ got, np.eye(n), atol=1e-12)
    if n > 1 and hasattr(scipy.linalg.lapack, "dstevd"):  # (its wrapper refuses n = 1)
        _, ref, info = scipy.linalg.lapack.dstevd(d.copy(), e.copy())
        assert info == 0
        np.testing.assert_array_equal(got, ref)


def test_tridiagonal_input_is_validated():
    with pytest.raises(ValueError, match="Fortran"):
        tridiagonalize(np.ones((3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="sytrd output"):
        square = np.ones((3, 3), dtype=np.float32)
        apply_tridiagonal_reflectors(square, np.ones(2, np.float32), np.ones((4, 1), np.float32))


def _ticks_while_running(target, *args) -> tuple[int, float]:
    """Iterations of a Python loop in this thread while ``target(*args)`` runs in another, and the seconds taken."""
    worker = threading.Thread(target=target, args=args)
    ticks, started = 0, time.perf_counter()
    worker.start()
    while worker.is_alive():
        ticks += 1
    return ticks, time.perf_counter() - started


def test_the_gil_is_released_during_the_call():
    """A Python loop here keeps running while another thread is inside dstemr, as fast as while it sleeps (with
    the GIL held for the call the loop would be frozen, apart from a few switch intervals around the start)."""
    rng = np.random.default_rng(2)
    d, e = rng.standard_normal(3000), rng.standard_normal(2999)
    free_ticks, free_seconds = _ticks_while_running(time.sleep, 0.1)  # sleep releases the GIL
    ticks, seconds = _ticks_while_running(tridiagonal_eigenvectors, d, e, 0, 599)
    assert seconds > 0.05  # the call is long enough for the check to mean something
    assert ticks / seconds > 0.3 * free_ticks / free_seconds


def test_split_bottom_vectors_equal_the_dense_bottom_eigenspace(monkeypatch):
    """p >= MRRR_SPLIT_MIN: two MRRR runs (cut at an eigenvalue gap) give the same subspace as a dense eigh. The
    threshold is lowered to 64 for the test (the split is the same code at any threshold): n = 560 instead of 1400."""
    monkeypatch.setattr(geometry, "MRRR_SPLIT_MIN", 64)
    n, p = 560, geometry.MRRR_SPLIT_MIN + 40  # 4(p + 30) < n: every round takes the MRRR path, not divide and conquer
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((n, n)))
    values = np.linspace(1.0, 50.0, n)  # distinct, well separated: eigenvectors are well defined
    s = (u * values) @ u.T
    factor = geometry.TridiagonalEigen(torch.from_numpy(s.copy()))
    assert len(factor._mrrr_ranges(0, p)) == 2
    v = factor.bottom_vectors(p).numpy()
    np.testing.assert_allclose(v.T @ v, np.eye(p), atol=1e-10)
    # the span equals the dense bottom-p eigenspace: projecting onto it loses nothing
    bottom = u[:, :p]
    np.testing.assert_allclose(np.linalg.svd(bottom.T @ v, compute_uv=False), 1.0, atol=1e-9)
    # and a later, wider round adds only new, orthogonal columns
    more = factor.bottom_vectors(p + 30, start=p).numpy()
    assert np.abs(v.T @ more).max() < 1e-9
    np.testing.assert_allclose(np.abs(np.sum(more * u[:, p : p + 30], axis=0)), 1.0, atol=1e-8)


def test_a_scipy_with_other_lapack_prototypes_is_refused_clearly(monkeypatch):
    """If scipy's Cython LAPACK ever exported another prototype (e.g. 64-bit ints), calling it would read garbage:
    the capsule's own prototype is checked first."""
    import ctypes

    import scipy.linalg.cython_lapack

    from plate_inspect import _lapack_nogil

    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = ctypes.create_string_buffer(b"void (int64_t *, d *, d *, int64_t *)")  # kept alive by this frame
    fake = new_capsule(ctypes.addressof(name), name, None)
    monkeypatch.setitem(scipy.linalg.cython_lapack.__pyx_capi__, "dsterf", fake)
    _lapack_nogil._lapack_function.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="not supported"):
            tridiagonal_eigenvalues(np.ones(3), np.ones(2))
    finally:
        _lapack_nogil._lapack_function.cache_clear()
