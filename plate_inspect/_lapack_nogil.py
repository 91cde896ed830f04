"""LAPACK routines called without the GIL, so that two Python threads can run them on two cores at once.

scipy's f2py wrappers hold the GIL for the whole call; its Cython LAPACK (``scipy.linalg.cython_lapack``, a public,
stable API) exports every routine as a C function pointer, and ctypes releases the GIL around foreign calls.
Only what the scan needs is here: the tridiagonal reduction of a symmetric matrix (sytrd), the tridiagonal
matrix's eigenvalues (sterf), its MRRR eigenvectors for an index range (dstemr) or all of them by divide and
conquer (dstevd), and the back-transformation of vectors by the reduction's reflectors (larft + larfb, blocked as
ormtr does it).
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import scipy.linalg.cython_lapack

if TYPE_CHECKING:
    from collections.abc import Callable

    from numpy.typing import DTypeLike

_int_p = ctypes.POINTER(ctypes.c_int)
_double_p = ctypes.POINTER(ctypes.c_double)
_char_p = ctypes.c_char_p
_float_p = ctypes.POINTER(ctypes.c_float)
#: How scipy's Cython LAPACK spells each argument type in its capsules' prototypes.
_C_NAMES = {_char_p: "char *", _int_p: "int *", _float_p: "s *", _double_p: "d *"}


@cache
def _lapack_function(name: str, *argtypes: type[ctypes._Pointer] | type[ctypes.c_char_p]) -> Callable[..., None]:
    """A routine of scipy's Cython LAPACK as a ctypes function (Fortran convention: every argument by reference).

    The capsule names its C prototype; it must be exactly the one ``argtypes`` describe (32-bit ints), or the call
    would read garbage, so a scipy built differently is refused with a clear error instead.
    """
    capsule = scipy.linalg.cython_lapack.__pyx_capi__[name]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    signature = get_name(capsule)
    expected = "void (" + ", ".join(_C_NAMES[t] for t in argtypes) + ")"
    if signature.decode().replace("__pyx_t_5scipy_6linalg_13cython_lapack_", "") != expected:
        raise RuntimeError(
            f"scipy.linalg.cython_lapack.{name} has the prototype {signature.decode()!r}, not {expected!r}: this "
            "scipy build is not supported by plate_inspect._lapack_nogil; please report it with `pip show scipy`"
        )
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.CFUNCTYPE(None, *argtypes)(get_pointer(capsule, signature))


def _ptr(a: np.ndarray, kind: type[ctypes._Pointer] | None = None) -> ctypes._Pointer:
    return a.ctypes.data_as(kind if kind is not None else _real_p(a.dtype))


def _real_p(dtype: DTypeLike) -> type[ctypes._Pointer]:
    return _float_p if np.dtype(dtype) == np.float32 else _double_p


def _ints(*values: int) -> list[ctypes.c_int]:
    return [ctypes.c_int(v) for v in values]


def tridiagonal_eigenvectors(diag: np.ndarray, offdiag: np.ndarray, first: int, last: int) -> np.ndarray:
    """Eigenvectors ``first..last`` (0-based, inclusive, ascending eigenvalues) of the symmetric tridiagonal
    matrix with ``diag`` (n) and ``offdiag`` (n - 1), float64, by MRRR (LAPACK dstemr), as an n x m array.

    Releases the GIL for the whole computation. Raises ``np.linalg.LinAlgError`` when LAPACK reports failure.
    """
    n = int(diag.shape[0])
    m_wanted = last - first + 1
    d = np.array(diag, dtype=np.float64)  # dstemr overwrites d and e
    e = np.zeros(n, dtype=np.float64)
    e[: n - 1] = offdiag
    n_, il, iu, ldz, nzc, found, info, tryrac = _ints(n, first + 1, last + 1, n, m_wanted, 0, 0, 1)
    vl, vu = ctypes.c_double(0.0), ctypes.c_double(0.0)
    kinds = ("c", "c", "i", "r", "r", "r", "r", "i", "i", "i", "r", "r", "i", "i", "i", "i", "r", "i", "i", "i", "i")
    dstemr = _real_function("stemr", np.float64, *kinds)
    w = np.zeros(n, dtype=np.float64)
    z = np.zeros((n, m_wanted), dtype=np.float64, order="F")
    isuppz = np.zeros(2 * max(1, m_wanted), dtype=np.int32)

    def call(work: np.ndarray, lwork: int, iwork: np.ndarray, liwork: int) -> None:
        dstemr(
            b"V", b"I", ctypes.byref(n_), _ptr(d), _ptr(e), ctypes.byref(vl), ctypes.byref(vu), ctypes.byref(il),
            ctypes.byref(iu), ctypes.byref(found), _ptr(w), _ptr(z), ctypes.byref(ldz), ctypes.byref(nzc),
            _ptr(isuppz, _int_p), ctypes.byref(tryrac), _ptr(work), ctypes.byref(ctypes.c_int(lwork)),
            _ptr(iwork, _int_p), ctypes.byref(ctypes.c_int(liwork)), ctypes.byref(info),
        )  # fmt: skip

    query_work, query_iwork = np.zeros(1, dtype=np.float64), np.zeros(1, dtype=np.int32)
    call(query_work, -1, query_iwork, -1)
    lwork, liwork = max(1, int(query_work[0])), max(1, int(query_iwork[0]))
    call(np.zeros(lwork, dtype=np.float64), lwork, np.zeros(liwork, dtype=np.int32), liwork)
    if info.value != 0 or found.value < m_wanted:
        raise np.linalg.LinAlgError(
            f"dstemr failed (info={info.value}, found {found.value} of {m_wanted} eigenvectors)"
        )
    return z


def tridiagonal_all_eigenvectors(diag: np.ndarray, offdiag: np.ndarray) -> np.ndarray:
    """All eigenvectors (ascending eigenvalues) of the symmetric tridiagonal matrix with ``diag`` (n) and
    ``offdiag`` (n - 1), float64, by divide and conquer (LAPACK dstevd), as an n x n Fortran array.

    The routine ``scipy.linalg.lapack.dstevd`` wraps, taken from the Cython LAPACK because that wrapper exists
    only from scipy 1.16 on; the GIL is released. Raises ``np.linalg.LinAlgError`` when LAPACK reports failure.
    """
    n = int(diag.shape[0])
    d = np.array(diag, dtype=np.float64)  # dstevd overwrites d (eigenvalues) and e
    e = np.zeros(max(1, n - 1), dtype=np.float64)
    e[: n - 1] = offdiag
    z = np.zeros((n, n), dtype=np.float64, order="F")
    dstevd = _real_function("stevd", np.float64, "c", "i", "r", "r", "r", "i", "r", "i", "i", "i", "i")
    n_, ldz, info = _ints(n, max(1, n), 0)

    def call(work: np.ndarray, lwork: int, iwork: np.ndarray, liwork: int) -> None:
        dstevd(
            b"V", ctypes.byref(n_), _ptr(d), _ptr(e), _ptr(z), ctypes.byref(ldz), _ptr(work),
            ctypes.byref(ctypes.c_int(lwork)), _ptr(iwork, _int_p), ctypes.byref(ctypes.c_int(liwork)),
            ctypes.byref(info),
        )  # fmt: skip

    query_work, query_iwork = np.zeros(1, dtype=np.float64), np.zeros(1, dtype=np.int32)
    call(query_work, -1, query_iwork, -1)
    lwork, liwork = max(1, int(query_work[0])), max(1, int(query_iwork[0]))
    call(np.zeros(lwork, dtype=np.float64), lwork, np.zeros(liwork, dtype=np.int32), liwork)
    if info.value != 0:
        raise np.linalg.LinAlgError(f"dstevd failed (info={info.value})")
    return z


#: Reflectors applied per block by :func:`apply_tridiagonal_reflectors`. LAPACK's ormtr uses ILAENV's block (32 in
#: OpenBLAS); 128 applied 576 vectors 28-32% faster at n = 1536 and 3584 on this project's 2-core machine (larger
#: blocks make the rank-nb updates BLAS-3 enough; 256 was no faster).
REFLECTOR_BLOCK = 128


def apply_tridiagonal_reflectors(reflectors: np.ndarray, tau: np.ndarray, x: np.ndarray) -> np.ndarray:
    """H x, where H holds the Householder reflectors of a lower sytrd (``reflectors``: the n x n array sytrd
    overwrote, Fortran order; ``tau``: n - 1 scalars) and x is n x p, on a Fortran copy of x.

    What LAPACK ormtr does (ormqr on the reflectors below the subdiagonal), with blocks of REFLECTOR_BLOCK
    reflectors: larft forms a block's triangular factor, larfb applies it with matrix products, the last block
    first (H = H_1 H_2 ... H_{n-1}). Reads the reflectors where they lie (no copy of the n x n array) and releases
    the GIL.
    """
    n, p = x.shape
    if not (reflectors.flags.f_contiguous and reflectors.shape == (n, n) and reflectors.dtype == x.dtype):
        raise ValueError("apply_tridiagonal_reflectors needs the n x n Fortran-ordered sytrd output of x's dtype")
    c = np.array(x, order="F", copy=True)
    k = n - 1  # reflectors; number i acts on rows i + 1 .. n - 1, its vector stored from row i + 2 of column i
    if k < 1 or p == 0:
        return c
    dtype = x.dtype
    tau = np.ascontiguousarray(tau, dtype=dtype)
    larft = _real_function("larft", dtype, "c", "c", "i", "i", "r", "i", "r", "r", "i")
    larfb = _real_function("larfb", dtype, "c", "c", "c", "c", "i", "i", "i", "r", "i", "r", "i", "r", "i", "r", "i")
    nb = min(REFLECTOR_BLOCK, k)
    t = np.zeros((nb, nb), dtype=dtype, order="F")
    work = np.zeros((p, nb), dtype=dtype, order="F")
    ld, cols, ldt = _ints(n, p, nb)
    real_p = _real_p(dtype)

    def at(a: np.ndarray, offset: int) -> ctypes._Pointer:
        """A pointer to element ``offset`` of a (column-major flat index)."""
        return ctypes.cast(a.ctypes.data + offset * a.itemsize, real_p)

    for i in range(((k - 1) // nb) * nb, -1, -nb):
        rows, width = _ints(k - i, min(nb, k - i))
        v = at(reflectors, (i + 1) + i * n)  # the block's unit lower trapezoid starts at A[i + 1, i]
        larft(
            b"F", b"C", ctypes.byref(rows), ctypes.byref(width), v, ctypes.byref(ld), at(tau, i), _ptr(t),
            ctypes.byref(ldt),
        )  # fmt: skip
        larfb(
            b"L", b"N", b"F", b"C", ctypes.byref(rows), ctypes.byref(cols), ctypes.byref(width), v, ctypes.byref(ld),
            _ptr(t), ctypes.byref(ldt), at(c, i + 1), ctypes.byref(ld), _ptr(work), ctypes.byref(cols),
        )  # fmt: skip
    return c


def _run_with_workspace(
    call: Callable[[np.ndarray, int], None], dtype: DTypeLike, name: str, info: ctypes.c_int
) -> None:
    """LAPACK's workspace protocol: ask with lwork = -1, run with the size it answers, raise if info != 0."""
    query = np.zeros(1, dtype=dtype)
    call(query, -1)
    lwork = max(1, int(query[0]))
    call(np.zeros(lwork, dtype=dtype), lwork)
    if info.value != 0:
        raise np.linalg.LinAlgError(f"{name} failed (info={info.value})")


def _real_function(name: str, dtype: DTypeLike, *kinds: str) -> Callable[..., None]:
    """``s<name>``/``d<name>`` with argument kinds: c (char), i (int), r (real array or scalar of ``dtype``)."""
    prefix = "s" if np.dtype(dtype) == np.float32 else "d"
    types = {"c": _char_p, "i": _int_p, "r": _real_p(dtype)}
    return _lapack_function(prefix + name, *(types[k] for k in kinds))


def tridiagonalize(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reduce the symmetric n x n Fortran-ordered ``a`` (lower triangle read) to tridiagonal T = H^T a H in place
    (LAPACK sytrd, lower). Returns T's diagonal, off-diagonal and the reflectors' scalars tau; ``a`` keeps the
    reflectors (for :func:`apply_tridiagonal_reflectors`). Releases the GIL.
    """
    n = a.shape[0]
    if not (a.flags.f_contiguous and a.shape == (n, n) and a.dtype in (np.float32, np.float64)):
        raise ValueError("tridiagonalize needs a square Fortran-ordered float32/float64 array")
    sytrd = _real_function("sytrd", a.dtype, "c", "i", "r", "i", "r", "r", "r", "r", "i", "i")
    d = np.zeros(n, dtype=a.dtype)
    e = np.zeros(max(1, n - 1), dtype=a.dtype)
    tau = np.zeros(max(1, n - 1), dtype=a.dtype)
    n_, lda, info = _ints(n, max(1, n), 0)

    def call(work: np.ndarray, lwork: int) -> None:
        sytrd(
            b"L", ctypes.byref(n_), _ptr(a), ctypes.byref(lda), _ptr(d), _ptr(e), _ptr(tau), _ptr(work),
            ctypes.byref(ctypes.c_int(lwork)), ctypes.byref(info),
        )  # fmt: skip

    _run_with_workspace(call, a.dtype, "sytrd", info)
    return d, e[: max(0, n - 1)], tau[: max(0, n - 1)]


def tridiagonal_eigenvalues(diag: np.ndarray, offdiag: np.ndarray) -> np.ndarray:
    """All eigenvalues, ascending, of the symmetric tridiagonal matrix (LAPACK sterf, in T's dtype). GIL-free."""
    d = np.array(diag, copy=True)
    e = np.zeros(max(1, d.shape[0] - 1), dtype=d.dtype)
    e[: d.shape[0] - 1] = offdiag
    sterf = _real_function("sterf", d.dtype, "i", "r", "r", "i")
    n_, info = _ints(d.shape[0], 0)
    sterf(ctypes.byref(n_), _ptr(d), _ptr(e), ctypes.byref(info))
    if info.value != 0:
        raise np.linalg.LinAlgError(f"sterf failed (info={info.value})")
    return d
