"""Curvature quantities against closed forms written by hand (no autograd in the oracle): a two-parameter product
model whose Hessian has a known non-Gauss-Newton residual, and a per-token classifier whose outputs are [B, T, C]
(the loss a token mean), so that "per sample" means per sequence in the drift, the GGN and beta.

Paper (Prop. "restricted curvature is bounded by functional drift", appendix "Empirical diagnostic of the
Gauss-Newton decomposition"): H0 = E[J^T (d2 l / df2) J] + E[sum_i (dl/df_i) d2 f_i], q_GN the first term's
quadratic form, q_R = q_H - q_GN, eps(S)^2 = max over unit v in S of E_x ||J(x) v||^2, beta the top eigenvalue of
the per-sample output-space loss Hessian over samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plate_inspect.analysis.curvature import (
    OldTaskProblem,
    analyze_family,
    full_family,
    restricted_operator,
)


# --------------------------------------------------------------------------- f(x) = a b x, squared loss
class Product(nn.Module):
    """f_theta(x) = a * b * x with two scalar parameters: bilinear, so d2 f / dtheta2 = x [[0, 1], [1, 0]]."""

    def __init__(self, a: float, b: float):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([a], dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor([b], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a * self.b * x


A, B = 0.7, -1.3
X = np.array([[0.5], [-1.0], [2.0], [1.5], [-0.25]])
Y = np.array([[0.1], [0.9], [-2.5], [-1.0], [0.6]])


def product_closed_form() -> dict[str, np.ndarray | float]:
    """Per sample l = (f - y)^2 (F.mse_loss of one output): d2 l / df2 = 2, dl/df = 2 (f - y), J = [b x, a x]."""
    x, y = X[:, 0], Y[:, 0]
    f = A * B * x
    jac = np.stack([B * x, A * x], axis=1)  # [N, 2]
    gram = jac.T @ jac / len(x)  # E[J^T J]
    ggn = 2.0 * gram
    swap = np.array([[0.0, 1.0], [1.0, 0.0]])
    residual = np.mean(2.0 * (f - y) * x) * swap
    return {"gram": gram, "ggn": ggn, "hess": ggn + residual, "residual": residual, "beta": 2.0}


def product_loss(a: float, b: float) -> float:
    return float(np.mean((a * b * X[:, 0] - Y[:, 0]) ** 2))


@pytest.fixture(scope="module")
def product_problem() -> tuple[Product, OldTaskProblem]:
    model = Product(A, B)
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    # batches of 3 and 2 samples: the n_b / N weights must give the mean over all five
    return model, OldTaskProblem(model, F.mse_loss, [(x[:3], y[:3]), (x[3:], y[3:])])


def _dense(op) -> np.ndarray:
    return np.column_stack([op.matvec(e) for e in np.eye(op.shape[0])])


def test_product_model_operators_equal_the_hand_computed_hessian_ggn_and_gram(product_problem):
    model, problem = product_problem
    want = product_closed_form()
    assert np.abs(want["residual"]).max() > 0.1  # a real non-Gauss-Newton term
    fam = full_family(model)  # coordinates (a, b)
    for kind, key in (("hessian", "hess"), ("ggn", "ggn"), ("drift", "gram")):
        np.testing.assert_allclose(_dense(restricted_operator(problem, fam, kind)), want[key], rtol=1e-12, atol=1e-14)
    assert problem.output_hessian_bound() == pytest.approx(want["beta"], rel=1e-12)


def test_product_model_probe_decomposition_and_top_quantities(product_problem):
    """q_R vanishes along a or b alone (f is linear in each) and equals +-E[2 (f - y) x] along (1, +-1)/sqrt 2."""
    model, problem = product_problem
    want = product_closed_form()
    r = float(want["residual"][0, 1])
    for v, q_r in (((1.0, 0.0), 0.0), ((0.0, 1.0), 0.0), ((1.0, 1.0), r), ((1.0, -1.0), -r)):
        v = np.array(v) / np.linalg.norm(v)
        delta = {"a": torch.tensor([v[0]]), "b": torch.tensor([v[1]])}
        q_h, q_gn, drift = problem.quadratic_forms(delta)
        assert q_h == pytest.approx(float(v @ want["hess"] @ v), rel=1e-12)
        assert q_gn == pytest.approx(float(v @ want["ggn"] @ v), rel=1e-12)
        assert drift == pytest.approx(float(v @ want["gram"] @ v), rel=1e-12)
        assert q_h - q_gn == pytest.approx(q_r, abs=1e-12)
    rec = analyze_family(problem, full_family(model), n_probes=0, rhos=(0.0, 0.5, 1.0))
    evals, evecs = np.linalg.eigh(want["hess"])
    assert rec.lam == pytest.approx(evals[-1], rel=1e-12)
    assert rec.lam_gn == pytest.approx(np.linalg.eigvalsh(want["ggn"])[-1], rel=1e-12)
    assert rec.eps == pytest.approx(math.sqrt(np.linalg.eigvalsh(want["gram"])[-1]), rel=1e-12)
    assert rec.bound == pytest.approx(2.0 * rec.eps**2, rel=1e-12)
    # F(rho) = L0(theta0 + rho v*) - L0(theta0) with v* the top eigenvector, signed so that g0 . v* >= 0
    x, y = X[:, 0], Y[:, 0]
    g0 = np.array([np.mean(2 * (A * B * x - y) * B * x), np.mean(2 * (A * B * x - y) * A * x)])
    v_star = evecs[:, -1] * (1.0 if g0 @ evecs[:, -1] >= 0 else -1.0)
    for rho, f in rec.forgetting_curve:
        want_f = product_loss(A + rho * v_star[0], B + rho * v_star[1]) - product_loss(A, B)
        assert f == pytest.approx(want_f, rel=1e-10, abs=1e-14)


def test_product_model_bound_fails_where_the_residual_dominates():
    """Prop. (GN bound) holds for the Gauss-Newton part always; with the residual it need not: at a = b = 0 the
    Jacobian vanishes (eps = 0) but the Hessian is the residual alone, E[-2 y x] [[0, 1], [1, 0]]."""
    model = Product(0.0, 0.0)
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    problem = OldTaskProblem(model, F.mse_loss, [(x, y)])
    rec = analyze_family(problem, full_family(model), n_probes=4, rhos=())
    assert rec.eps == pytest.approx(0.0, abs=1e-12) and rec.lam_gn == pytest.approx(0.0, abs=1e-12)
    assert rec.lam == pytest.approx(abs(float(np.mean(-2 * Y[:, 0] * X[:, 0]))), rel=1e-12)
    assert rec.bound_ratio == float("inf")  # lambda > 0 = beta eps^2
    assert rec.to_json()["bound_ratio"] is None


# --------------------------------------------------------------------------- outputs [B, T, C], token-mean loss
D_IN, HIDDEN, T, C = 3, 4, 5, 3


def token_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, C)).double()  # per token


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of the batch (equal lengths: the mean of the per-sequence means)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def softmax_hessian(logits: np.ndarray) -> np.ndarray:
    """d2 CE / d logits2 = diag(p) - p p^T (hand-written)."""
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return np.diag(p) - np.outer(p, p)


def test_sequence_outputs_count_a_sequence_as_one_sample():
    """Per sample x (a sequence of T tokens) the loss is the mean over its tokens, so d2 l / df2 over the T*C
    outputs is block-diagonal with blocks (diag p_t - p_t p_t^T) / T; J(x) is [T*C, P]; E over sequences.
    The drift Gram, the GGN and beta must use exactly these (a per-token E, or a sum over tokens, is T times off)."""
    model = token_model()
    g = torch.Generator().manual_seed(5)
    n = 5
    x = torch.randn(n, T, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (n, T), generator=g)
    problem = OldTaskProblem(model, token_loss, [(x[:3], y[:3]), (x[3:], y[3:])])
    fam = full_family(model, ["2.weight", "2.bias"])  # the head: f is linear in it, so H0 = GGN exactly there
    params = dict(model.named_parameters())
    # J(x) of the head by hand: out[t, c] = sum_j W[c, j] h[t, j] + b[c], h = tanh(W0 x + b0)
    with torch.no_grad():
        h = torch.tanh(model[0](x)).numpy()  # [n, T, HIDDEN]
        logits = model(x).numpy()  # [n, T, C]
    n_w = C * HIDDEN
    gram = np.zeros((fam.dim, fam.dim))
    ggn = np.zeros((fam.dim, fam.dim))
    beta = 0.0
    for i in range(n):
        jac = np.zeros((T * C, fam.dim))
        out_hess = np.zeros((T * C, T * C))
        for t in range(T):
            for c in range(C):
                jac[t * C + c, c * HIDDEN : (c + 1) * HIDDEN] = h[i, t]  # d out[t, c] / d W[c, :]
                jac[t * C + c, n_w + c] = 1.0  # d out[t, c] / d b[c]
            out_hess[t * C : (t + 1) * C, t * C : (t + 1) * C] = softmax_hessian(logits[i, t]) / T
        gram += jac.T @ jac / n
        ggn += jac.T @ out_hess @ jac / n
        beta = max(beta, float(np.linalg.eigvalsh(out_hess)[-1]))
    assert tuple(params["2.weight"].shape) == (C, HIDDEN)
    np.testing.assert_allclose(_dense(restricted_operator(problem, fam, "drift")), gram, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(_dense(restricted_operator(problem, fam, "ggn")), ggn, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(_dense(restricted_operator(problem, fam, "hessian")), ggn, rtol=1e-10, atol=1e-13)
    assert problem.output_hessian_bound() == pytest.approx(beta, rel=1e-10)
    rec = analyze_family(problem, fam, n_probes=3, rhos=())
    assert rec.eps == pytest.approx(math.sqrt(np.linalg.eigvalsh(gram)[-1]), rel=1e-9)
    assert rec.lam == pytest.approx(np.linalg.eigvalsh(ggn)[-1], rel=1e-9)
    assert rec.lam <= rec.bound * (1 + 1e-9)
