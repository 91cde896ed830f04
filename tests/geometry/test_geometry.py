"""PLATE geometry against dense float64 oracles, hand-computed cases and planted structure."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import dense_oracle

import plate_inspect.batched
import plate_inspect.geometry as geometry
from plate_inspect.batched import batched_plate_geometry
from plate_inspect.errors import ConfigError
from plate_inspect.geometry import (
    anchor_indices,
    energy_rank,
    frozen_energy_basis,
    high_energy_basis,
    ieee_float32_matmul,
    k_for_tau,
    least_redundant_rows,
    null_vectors,
    plate_geometry,
    random_orthonormal,
    random_rows,
    redundancy_scores,
)
from plate_inspect.testing.synthetic import structured_weight


def test_k_for_tau_hand_computed():
    # energies 5, 3, 1, 1 (total 10): tau 0.5 -> m=1 (5 >= 5); tau 0.8 -> m=2; tau 0.85 -> m=3 (9 >= 8.5)
    s = torch.tensor([5.0, 3.0, 1.0, 1.0])
    assert [energy_rank(s, t) for t in (0.5, 0.8, 0.85, 0.95)] == [1, 2, 3, 4]
    assert k_for_tau(s, 0.5, d_in=4, max_rank=10) == 3
    assert k_for_tau(s, 0.5, d_in=4, max_rank=2) == 2
    assert k_for_tau(s, 0.95, d_in=4, max_rank=10) == 1  # d_in - m = 0 -> at least 1
    assert k_for_tau(torch.zeros(3), 0.9, d_in=6, max_rank=4) == 4  # no energy: m = 0


def test_anchor_indices_strided_and_all_rows_when_few():
    assert anchor_indices(10, 256).tolist() == list(range(10))
    idx = anchor_indices(1000, 4).tolist()
    assert idx == [0, 250, 500, 750]


@pytest.mark.parametrize(
    "shape, r",
    [((96, 40), 8), ((40, 96), 8), ((64, 64), 16), ((30, 200), 4), ((200, 30), 50)],
    ids=["tall", "wide-pure-null", "square-mixed", "very-wide", "tall-large-r"],
)
def test_plate_geometry_matches_dense_oracle(shape, r):
    gen = torch.Generator().manual_seed(sum(shape) + r)
    w, _ = structured_weight(*shape, gen)
    w = w.double()
    tau, max_rank = 0.9, 48
    scores, b, evals, k, gram = dense_oracle(w.numpy(), r, tau, max_rank)
    geo = plate_geometry(w, r, tau, max_rank)
    np.testing.assert_allclose(geo.redundancy.numpy(), scores, rtol=1e-5, atol=1e-7)
    assert geo.b_idx.tolist() == b.tolist()
    assert geo.k == k
    q = geo.basis.q.numpy()
    assert q.shape == (shape[1], k)
    np.testing.assert_allclose(q.T @ q, np.eye(k), atol=1e-10)
    # Q spans the exact bottom-k eigenspace: its energy equals the sum of the k smallest eigenvalues
    energy = np.trace(q.T @ gram @ q)
    assert energy == pytest.approx(evals[:k].sum(), rel=1e-7, abs=1e-10 * evals.sum())
    assert geo.basis.captured_energy == pytest.approx(evals[:k].sum() / evals.sum(), rel=1e-6, abs=1e-12)
    n_frozen = shape[0] - len(b)
    np.testing.assert_allclose(
        geo.basis.spectrum.numpy(), evals[::-1][: min(n_frozen, shape[1])], rtol=1e-5, atol=1e-6 * evals.max()
    )
    # the input was not modified without overwrite_input
    assert torch.isfinite(w).all() and not (w == 0).all(dim=1).any()


def test_wide_case_q_lies_in_null_space_when_k_fits():
    gen = torch.Generator().manual_seed(3)
    w, _ = structured_weight(48, 300, gen)
    geo = plate_geometry(w.double(), 8, 0.9, 64)
    frozen = np.delete(w.double().numpy(), geo.b_idx.numpy(), axis=0)
    assert geo.k == 64  # capped by max_rank, below the null dimension 300 - 40
    assert np.abs(frozen @ geo.basis.q.numpy()).max() < 1e-10
    assert geo.basis.captured_energy < 1e-20


def test_wide_mixed_case_takes_whole_null_space_then_smallest_directions():
    gen = torch.Generator().manual_seed(4)
    w, _ = structured_weight(64, 80, gen)  # n_frozen = 56 -> null dim 24; k = 80 - m(0.5) > 24
    geo = plate_geometry(w.double(), 8, 0.5, 80)
    frozen = np.delete(w.double().numpy(), geo.b_idx.numpy(), axis=0)
    _, s, vt = np.linalg.svd(frozen)
    null = vt[56:].T  # exact null space basis (24 dims)
    q = geo.basis.q.numpy()
    assert geo.k > 24
    # the null space is contained in span(Q): projecting it onto Q loses nothing
    np.testing.assert_allclose(q @ (q.T @ null), null, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rank_deficient_frozen_rows_count_extra_null_directions(dtype):
    gen = torch.Generator().manual_seed(5)
    low = torch.randn(40, 5, generator=gen, dtype=torch.float64) @ torch.randn(
        5, 60, generator=gen, dtype=torch.float64
    )
    low = low.to(dtype)
    basis = frozen_energy_basis(low.clone(), tau=0.99, max_rank=100)
    gram = low.double().numpy().T @ low.double().numpy()
    evals = np.clip(np.linalg.eigvalsh(gram), 0, None)  # oracle: rank 5, so 55 zero eigenvalues
    cums = np.cumsum(evals[::-1])
    m = int(np.argmax(cums >= 0.99 * cums[-1])) + 1
    assert m <= 5 and basis.k == 60 - m
    q = basis.q.double().numpy()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert np.trace(q.T @ gram @ q) <= evals[: basis.k].sum() * 1.01 + tol * evals.sum()


def _null_residual_and_orthogonality(c: torch.Tensor, z: torch.Tensor) -> tuple[float, float]:
    """||C Z||_F / ||C||_F and max |Z^T Z - I|, in float64."""
    c64, z64 = c.double(), z.double()
    eye = torch.eye(z.shape[1], dtype=torch.float64)
    return float((c64 @ z64).norm() / c64.norm()), float((z64.T @ z64 - eye).abs().max())


@pytest.mark.parametrize("backend", ["lapack", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lu_null_vectors_are_null_and_orthonormal_for_rank_deficient_blocks(dtype, backend):
    # a 60 x 130 block of rank 7 (LU meets near-zero pivots), more columns than n + k: C Z = 0 to rounding
    gen = torch.Generator().manual_seed(8)
    low = torch.randn(60, 7, generator=gen, dtype=torch.float64) @ torch.randn(
        7, 130, generator=gen, dtype=torch.float64
    )
    z = null_vectors(low.to(dtype), 50, backend, method="lu")
    residual, orthogonality = _null_residual_and_orthogonality(low, z)
    eps = torch.finfo(dtype).eps
    assert z.shape == (130, 50) and z.dtype == dtype
    assert residual < 100 * eps and orthogonality < 100 * eps


@pytest.mark.parametrize("method", ["lu", "householder"])
def test_null_vectors_factorise_in_place_only_when_allowed(method):
    # overwrite_c lets LAPACK reuse C's storage (the scan's memory peak on wide modules); without it C is intact
    gen = torch.Generator().manual_seed(9)
    c = torch.randn(40, 7, generator=gen) @ torch.randn(7, 100, generator=gen)
    original = c.clone()
    kept = null_vectors(c, 30, "lapack", method)
    assert torch.equal(c, original)
    overwritten = null_vectors(c, 30, "lapack", method, overwrite_c=True)
    assert not torch.equal(c, original)  # the factors took C's place
    assert torch.equal(kept, overwritten)  # same factorisation, same bits
    residual, orthogonality = _null_residual_and_orthogonality(original, overwritten)
    assert residual < 1e-5 and orthogonality < 1e-5


def test_null_space_basis_leaves_the_weight_intact():
    # the column block is factorised in place: it must be a gathered copy, never the caller's weight
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(48, 200, generator=gen)
    original = w.clone()
    basis = frozen_energy_basis(w, tau=0.9, max_rank=64)
    assert torch.equal(w, original) and basis.k == 64
    residual, _ = _null_residual_and_orthogonality(w.double(), basis.q.double())
    assert residual < 1e-6


def test_null_space_q_falls_back_to_householder_when_lu_grows():
    # W_f^T = Wilkinson's matrix (1 on the diagonal, -1 below, 1 in the last column) over 8 rows of small
    # entries: partial pivoting keeps the diagonal, U's last column doubles at every step (growth 2^59), and the
    # LU null vectors are far from null; the basis must detect it and take Householder's
    n, k = 60, 8
    wilkinson = torch.eye(n, dtype=torch.float64) - torch.tril(torch.ones(n, n, dtype=torch.float64), -1)
    wilkinson[:, -1] = 1.0
    extra = torch.full((k, n), -0.25, dtype=torch.float64)
    frozen = torch.cat([wilkinson, extra]).T.contiguous()  # n x (n + k): every column takes part in the block
    lu_residual, _ = _null_residual_and_orthogonality(frozen, null_vectors(frozen, k, method="lu"))
    assert lu_residual > 1e-6  # LU alone fails here, so the check below tests the fallback
    basis = frozen_energy_basis(frozen.clone(), tau=0.9, max_rank=k)
    residual, orthogonality = _null_residual_and_orthogonality(frozen, basis.q)
    assert basis.k == k and residual < 1e-13 and orthogonality < 1e-13
    assert basis.captured_energy < 1e-25


def test_planted_duplicate_rows_are_selected_by_b():
    gen = torch.Generator().manual_seed(6)
    w, planted = structured_weight(128, 64, gen, planted=12)
    geo = plate_geometry(w, 12, 0.9, 32)
    assert geo.b_idx.tolist() == planted


def test_anchor_self_similarity_is_excluded():
    # rows 0 and 2 are anchors (stride 2 of 4 rows with 2 anchors); row 0 == row 1, the rest orthogonal
    w = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]])
    s = redundancy_scores(w, n_anchors=2)
    # row 0 (anchor): only anchor 2 counts -> |cos| = 0; row 1: anchors 0 and 2 -> (1 + 0) / 2
    assert s.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0])


def test_scores_from_the_row_gram_equal_the_direct_ones_and_wide_weights_plant_b():
    """Wide weights take their scores from K = W W^T (its anchor columns); same scores, same planted B."""
    gen = torch.Generator().manual_seed(17)
    w, planted = structured_weight(48, 400, gen, planted=6)  # wide: k = 64 fits in the null space
    direct = redundancy_scores(w.double())
    via_gram = redundancy_scores(w.double(), row_gram=w.double() @ w.double().T)
    torch.testing.assert_close(via_gram, direct, rtol=0, atol=1e-12)
    w[5] = 0  # an all-zero row scores 0 either way
    assert float(redundancy_scores(w, row_gram=w @ w.T)[5]) == 0.0
    geo = plate_geometry(w, 6, 0.9, 64)
    assert geo.b_idx.tolist() == planted
    frozen = w.double().clone()
    frozen[geo.b_idx] = 0
    assert float((frozen @ geo.basis.q.double()).norm()) < 1e-4 * float(frozen.norm())  # Q: null directions


def test_sketched_scores_approach_exact_with_large_sketch():
    gen = torch.Generator().manual_seed(7)
    w, _ = structured_weight(64, 32, gen, planted=8)
    exact = redundancy_scores(w.double())
    sketched = redundancy_scores(w.double(), sketch_dim=20000, seed=1)
    assert torch.allclose(sketched, exact, atol=0.03)
    small = redundancy_scores(w.double(), sketch_dim=4, seed=1)
    assert not torch.allclose(small, exact, atol=0.03)  # a tiny sketch really is an approximation


def test_overwrite_input_zeroes_b_rows_in_place():
    gen = torch.Generator().manual_seed(8)
    w, _ = structured_weight(32, 16, gen)
    geo = plate_geometry(w, 4, 0.9, 8, overwrite_input=True)
    assert (w[geo.b_idx] == 0).all()


def test_effective_r_leaves_ten_percent_frozen():
    w, _ = structured_weight(20, 8, torch.Generator().manual_seed(9))
    assert plate_geometry(w, 64, 0.9, 8).b_idx.numel() == 18


@pytest.mark.parametrize("kwargs", [{"r": 0}, {"tau": 1.0}, {"tau": 0.0}, {"max_rank": 0}])
def test_settings_out_of_range_are_rejected(kwargs):
    w = torch.randn(8, 8)
    args = {"r": 2, "tau": 0.9, "max_rank": 4} | kwargs
    with pytest.raises(ConfigError):
        plate_geometry(w, args["r"], args["tau"], args["max_rank"])


def test_ablation_helpers():
    rows = random_rows(100, 10, seed=1)
    assert rows.tolist() == sorted(set(rows.tolist())) and len(rows) == 10
    assert rows.tolist() != random_rows(100, 10, seed=2).tolist()
    scores = torch.tensor([0.5, 0.1, 0.9, 0.1, 0.3])
    assert least_redundant_rows(scores, 2).tolist() == [1, 3]
    q = random_orthonormal(50, 7, seed=3, dtype=torch.float64)
    assert torch.allclose(q.T @ q, torch.eye(7, dtype=torch.float64), atol=1e-12)
    w = torch.randn(30, 20, dtype=torch.float64)
    top = high_energy_basis(w, 5).numpy()
    gram = w.numpy().T @ w.numpy()
    evals = np.linalg.eigvalsh(gram)
    assert np.trace(top.T @ gram @ top) == pytest.approx(evals[-5:].sum(), rel=1e-10)


@pytest.fixture
def user_matmul_precision():
    """Restores torch's float32 matmul precision (process-wide) after a test that sets it as a user would."""
    saved = geometry._matmul_precision()
    yield
    geometry._set_matmul_precision(saved)


def _set_tf32_as_users_do(how: str) -> None:
    if how == "legacy":  # torch.set_float32_matmul_precision: Lightning's advice, the TF32 docs
        torch.set_float32_matmul_precision("high")
    elif how == "allow_tf32":  # what HF Trainer's tf32=True sets
        torch.backends.cuda.matmul.allow_tf32 = True
    else:  # torch >= 2.9's per-backend API
        torch.backends.cuda.matmul.fp32_precision = "tf32"


@pytest.mark.parametrize("how", ["legacy", "allow_tf32", "per-backend"])
def test_geometry_runs_in_ieee_float32_whatever_the_process_tf32_setting(how, user_matmul_precision, monkeypatch):
    # a TF32 Gram matrix keeps ~3 digits: the geometry must switch it off while it runs and give it back after
    if how == "per-backend" and not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend precision API")
    _set_tf32_as_users_do(how)
    users = geometry._matmul_precision()
    assert "tf32" in users or "high" in users  # the setting took: the test checks a real change
    seen, real_validate = [], geometry.validate_settings

    def spy(**settings):  # validate_settings: the first call inside both decorated functions
        seen.append(geometry._matmul_precision())
        return real_validate(**settings)

    monkeypatch.setattr(geometry, "validate_settings", spy)
    monkeypatch.setattr(plate_inspect.batched, "validate_settings", spy)
    plate_geometry(torch.randn(64, 48), 4, 0.9, 16)
    batched_plate_geometry(torch.randn(2, 64, 48), 4, 0.9, 16, seeds=[0, 1])
    assert len(seen) == 2 and all(state in (("ieee", "ieee"), ("highest",)) for state in seen)
    assert geometry._matmul_precision() == users  # the user's setting is back


def test_precision_guard_holds_until_the_last_concurrent_user_leaves(user_matmul_precision):
    torch.set_float32_matmul_precision("high")
    users = geometry._matmul_precision()
    first, second = ieee_float32_matmul(), ieee_float32_matmul()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # another thread's geometry is still running: stays IEEE
    assert geometry._matmul_precision() in (("ieee", "ieee"), ("highest",))
    second.__exit__(None, None, None)
    assert geometry._matmul_precision() == users


def test_weight_spectrum_for_health_runs_in_ieee_float32_too(user_matmul_precision, monkeypatch):
    from plate_inspect.health import weight_spectrum

    torch.set_float32_matmul_precision("high")
    users, seen, real_factor = geometry._matmul_precision(), [], geometry.factor_symmetric

    def spy(*args, **kwargs):
        seen.append(geometry._matmul_precision())
        return real_factor(*args, **kwargs)

    monkeypatch.setattr(geometry, "factor_symmetric", spy)
    weight = torch.randn(30, 20, dtype=torch.float64)
    spectrum = weight_spectrum(weight)
    assert seen and seen[0] in (("ieee", "ieee"), ("highest",)) and geometry._matmul_precision() == users
    np.testing.assert_allclose(spectrum.numpy(), np.linalg.svd(weight.numpy(), compute_uv=False) ** 2, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_models_own_low_precision_parameter_is_read_exactly(dtype):
    """plate_geometry(layer.weight) on a bf16/fp16 model: its values (exact in float32), no autograd, no change."""
    w, _ = structured_weight(96, 40, torch.Generator().manual_seed(21))
    param = torch.nn.Parameter(w.to(dtype))
    before = param.detach().clone()
    scores, b, evals, k, gram = dense_oracle(param.detach().double().numpy(), 8, 0.9, 16)
    geo = plate_geometry(param, 8, 0.9, 16, overwrite_input=True)
    assert geo.b_idx.tolist() == b.tolist() and geo.k == k
    np.testing.assert_allclose(geo.redundancy.numpy(), scores, rtol=1e-5, atol=1e-6)
    q = geo.basis.q.double().numpy()
    assert np.trace(q.T @ gram @ q) == pytest.approx(evals[:k].sum(), rel=1e-3, abs=1e-6 * evals.sum())
    assert torch.equal(param.detach(), before) and param.grad is None  # the upcast copy took overwrite_input


def test_weights_without_values_or_with_nan_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="meta device"):
        plate_geometry(torch.empty(16, 8, device="meta"), 2, 0.9, 4)
    w, _ = structured_weight(32, 16, torch.Generator().manual_seed(5))
    w[7, 3] = float("nan")
    w[20, 0] = float("inf")
    with pytest.raises(ConfigError, match="has 2 NaN/Inf entries"):
        plate_geometry(w, 4, 0.9, 8)
    with pytest.raises(ConfigError, match="2-D floating-point"):
        plate_geometry(torch.ones(8, 8, dtype=torch.int32), 2, 0.9, 4)
