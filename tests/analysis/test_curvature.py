"""Restricted curvature and drift against independent oracles: dense Hessian / GGN / Jacobian of tiny networks
(torch.autograd.functional), curvlinops' operators, and closed forms for a linear model with squared loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from helpers_analysis import TinyTransformer, dense_basis, dense_oracles, op_dense, tiny_data, tiny_mlp, unflatten
from torch import nn
from torch.func import functional_call

from plate_inspect.analysis.curvature import (
    OldTaskProblem,
    UpdateFamily,
    analyze_families,
    analyze_family,
    full_family,
    lora_family,
    lora_tangent_block,
    math_attention,
    plate_family,
    restricted_operator,
    selector_basis_block,
    top_eigenpair,
)
from plate_inspect.geometry import random_orthonormal


@pytest.fixture(scope="module")
def tiny():
    model = tiny_mlp()
    x, y = tiny_data()
    hess, ggn, gram, theta = dense_oracles(model, x, y)
    # two batches of unequal size: the n_b / N weighting must reproduce the full-data average
    problem = OldTaskProblem(model, F.cross_entropy, [(x[:7], y[:7]), (x[7:], y[7:])])
    return model, x, y, hess, ggn, gram, problem


def tiny_families(model: nn.Module) -> list[UpdateFamily]:
    w = dict(model.named_parameters())["2.weight"]  # [4, 5]
    q = random_orthonormal(5, 3, seed=3, dtype=torch.float64)
    plate_like = UpdateFamily("plate_like", [selector_basis_block("2.weight", tuple(w.shape), torch.tensor([0, 2]), q)])
    lora = UpdateFamily("lora", [lora_tangent_block("2.weight", tuple(w.shape), 2, seed=5)])
    lora0 = UpdateFamily("lora0", [lora_tangent_block("0.weight", (5, 3), 1, seed=6, zero_b=True)])
    return [full_family(model), plate_like, lora, lora0]


# --------------------------------------------------------------------------- operators vs dense
def test_full_operators_match_dense_hessian_ggn_and_jacobian_gram(tiny):
    model, _, _, hess, ggn, gram, problem = tiny
    fam = full_family(model)
    assert fam.dim == hess.shape[0]
    for kind, dense in (("hessian", hess), ("ggn", ggn), ("drift", gram)):
        got = op_dense(restricted_operator(problem, fam, kind))
        np.testing.assert_allclose(got, dense.numpy(), rtol=1e-9, atol=1e-11)


def test_restricted_operators_are_mt_c_m_for_every_family(tiny):
    model, _, _, hess, ggn, gram, problem = tiny
    for fam in tiny_families(model)[1:]:
        m = dense_basis(fam, model)
        np.testing.assert_allclose((m.T @ m).numpy(), np.eye(fam.dim), atol=1e-12)  # isometric parametrisation
        for kind, dense in (("hessian", hess), ("ggn", ggn), ("drift", gram)):
            got = op_dense(restricted_operator(problem, fam, kind))
            np.testing.assert_allclose(got, (m.T @ dense @ m).numpy(), rtol=1e-9, atol=1e-11, err_msg=fam.name)


def test_lambda_eps_and_lanczos_match_dense_eigenvalues(tiny):
    model, _, _, hess, ggn, gram, problem = tiny
    for fam in tiny_families(model):
        m = dense_basis(fam, model)
        lam = float(torch.linalg.eigvalsh(m.T @ hess @ m).max())
        lam_gn = float(torch.linalg.eigvalsh(m.T @ ggn @ m).max())
        eps = float(torch.linalg.eigvalsh(m.T @ gram @ m).max()) ** 0.5
        rec = analyze_family(problem, fam, n_probes=5, rhos=(0.0, 0.5))
        assert rec.lam == pytest.approx(lam, rel=1e-8, abs=1e-12)
        assert rec.lam_gn == pytest.approx(lam_gn, rel=1e-8, abs=1e-12)
        assert rec.eps == pytest.approx(eps, rel=1e-8, abs=1e-12)
        if fam.dim > 3:  # force the Lanczos path (eigsh) on the same operator
            val, vec = top_eigenpair(restricted_operator(problem, fam, "hessian"), dense_max_dim=0, tol=1e-12)
            assert val == pytest.approx(lam, rel=1e-7, abs=1e-10)
            op_v = restricted_operator(problem, fam, "hessian").matvec(vec)
            np.testing.assert_allclose(op_v, val * vec, atol=1e-6 * max(1.0, abs(val)))


def test_probe_decomposition_matches_dense_quadratic_forms(tiny):
    model, _, _, hess, ggn, gram, problem = tiny
    fam = tiny_families(model)[1]
    m = dense_basis(fam, model)
    g = torch.Generator().manual_seed(11)
    for _ in range(4):
        c = torch.randn(fam.dim, generator=g, dtype=torch.float64)
        c /= c.norm()
        v = m @ c
        q_h, q_gn, drift = problem.quadratic_forms(fam.embed(c))
        assert q_h == pytest.approx(float(v @ hess @ v), rel=1e-9, abs=1e-13)
        assert q_gn == pytest.approx(float(v @ ggn @ v), rel=1e-9, abs=1e-13)
        assert drift == pytest.approx(float(v @ gram @ v), rel=1e-9, abs=1e-13)
    rec = analyze_family(problem, fam, n_probes=30, rhos=(0.0,))
    q_h, q_gn = np.array(rec.q_h), np.array(rec.q_gn)
    assert rec.gn_share_median == pytest.approx(float(np.median(np.abs(q_gn) / np.abs(q_h))))
    assert rec.residual_ratio_median == pytest.approx(float(np.median(np.abs(q_h - q_gn) / np.abs(q_gn))))


def test_forgetting_curve_is_loss_along_top_hessian_direction(tiny):
    model, x, y, hess, _, _, problem = tiny
    fam = tiny_families(model)[2]
    m = dense_basis(fam, model)
    evals, evecs = torch.linalg.eigh(m.T @ hess @ m)
    v = m @ evecs[:, -1]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    loss = lambda flat: float(F.cross_entropy(functional_call(model, unflatten(model, flat), (x,)), y))  # noqa: E731
    g0 = torch.autograd.functional.jacobian(
        lambda flat: F.cross_entropy(functional_call(model, unflatten(model, flat), (x,)), y), theta
    )
    if float(g0 @ v) < 0:
        v = -v
    rhos = (0.0, 0.3, 1.0)
    rec = analyze_family(problem, fam, n_probes=0, rhos=rhos)
    for (rho, f), want_rho in zip(rec.forgetting_curve, rhos, strict=True):
        assert rho == want_rho
        assert f == pytest.approx(loss(theta + want_rho * v) - loss(theta), rel=1e-9, abs=1e-13)


def test_beta_is_top_eigenvalue_of_softmax_hessian(tiny):
    model, x, y, _, _, _, problem = tiny
    p = torch.softmax(model(x), dim=1).detach()
    want = max(float(torch.linalg.eigvalsh(torch.diag(pi) - torch.outer(pi, pi)).max()) for pi in p)
    assert problem.output_hessian_bound() == pytest.approx(want, rel=1e-10)
    assert want <= 0.5
    # Proposition (GN part): lambda_GN(S) <= beta eps(S)^2 holds for every family
    for fam in tiny_families(model):
        rec = analyze_family(problem, fam, n_probes=0, rhos=())
        assert rec.lam_gn <= rec.beta * rec.eps**2 * (1 + 1e-9)


# --------------------------------------------------------------------------- curvlinops as an independent oracle
def test_operators_agree_with_curvlinops(tiny):
    from curvlinops import GGNLinearOperator, HessianLinearOperator

    model, x, y, _, _, _, problem = tiny
    params = list(model.parameters())
    data = [(x[:7], y[:7]), (x[7:], y[7:])]
    loss = nn.CrossEntropyLoss(reduction="mean")
    fam = full_family(model)
    g = torch.Generator().manual_seed(2)
    for cls, kind in ((HessianLinearOperator, "hessian"), (GGNLinearOperator, "ggn")):
        theirs = cls(model, loss, params, data)
        ours = restricted_operator(problem, fam, kind)
        for _ in range(3):
            v = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
            want = torch.cat([t.reshape(-1) for t in theirs @ v]).numpy()
            got = ours.matvec(torch.cat([t.reshape(-1) for t in v]).numpy())
            np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)


# --------------------------------------------------------------------------- closed form: linear model, squared loss
def test_linear_model_with_squared_loss_is_pure_gauss_newton():
    torch.manual_seed(0)
    model = nn.Linear(6, 3).double()
    x = torch.randn(40, 6, dtype=torch.float64)
    y = torch.randn(40, 3, dtype=torch.float64)
    problem = OldTaskProblem(model, F.mse_loss, [(x[:25], y[:25]), (x[25:], y[25:])])
    # closed form: per-sample loss mean_c (f_c - y_c)^2 has output Hessian (2/C) I, so beta = 2/3
    assert problem.output_hessian_bound() == pytest.approx(2.0 / 3.0, rel=1e-12)
    xa = torch.cat([x, torch.ones(40, 1, dtype=torch.float64)], dim=1)
    # H for W (row-major flatten) is (2/C) kron(I_C, E[x x^T]); exactly the GGN
    h_w = (2.0 / 3.0) * torch.kron(torch.eye(3, dtype=torch.float64), x.T @ x / 40)
    fam_w = full_family(model, ["weight"])
    np.testing.assert_allclose(op_dense(restricted_operator(problem, fam_w, "hessian")), h_w.numpy(), atol=1e-12)
    q = random_orthonormal(6, 2, seed=1, dtype=torch.float64)
    fams = [full_family(model), UpdateFamily("sub", [selector_basis_block("weight", (3, 6), torch.tensor([1]), q)])]
    for fam in fams:
        rec = analyze_family(problem, fam, n_probes=20, rhos=(0.0, 0.5, 2.0))
        np.testing.assert_allclose(rec.q_h, rec.q_gn, rtol=1e-10)  # q_R = 0
        assert rec.residual_ratio_median < 1e-10
        assert rec.gn_share_median == pytest.approx(1.0, abs=1e-10)
        assert rec.lam == pytest.approx(rec.lam_gn, rel=1e-9)
        assert rec.bound_ratio == pytest.approx(1.0, rel=1e-8)  # lambda = beta eps^2 exactly
        # the loss is quadratic: F(rho) = rho g.v + rho^2 lambda / 2, with g.v >= 0 by the sign convention
        f1 = dict(rec.forgetting_curve)
        gv = (f1[0.5] - 0.125 * rec.lam) / 0.5
        assert gv >= -1e-12
        assert f1[2.0] == pytest.approx(2.0 * gv + 2.0 * rec.lam, rel=1e-8, abs=1e-12)
    # the full family's lambda is the top eigenvalue of the closed-form Hessian over [W, b]
    h_full = (2.0 / 3.0) * torch.kron(torch.eye(3, dtype=torch.float64), xa.T @ xa / 40)
    rec = analyze_family(problem, fams[0], n_probes=0, rhos=())
    # parameter order is weight (row-major) then bias: permute the closed form accordingly
    perm = [c * 7 + j for c in range(3) for j in range(6)] + [c * 7 + 6 for c in range(3)]
    assert rec.lam == pytest.approx(float(torch.linalg.eigvalsh(h_full[perm][:, perm]).max()), rel=1e-9)


# --------------------------------------------------------------------------- family structure
def test_plate_block_moves_only_b_rows_inside_span_q():
    q = random_orthonormal(7, 3, seed=0, dtype=torch.float64)
    b = torch.tensor([1, 4])
    blk = selector_basis_block("w", (5, 7), b, q)
    c = torch.randn(6, dtype=torch.float64)
    d = blk.embed(c)
    keep = torch.tensor([0, 2, 3])
    assert torch.count_nonzero(d[keep]) == 0
    np.testing.assert_allclose((d[b] - d[b] @ q @ q.T).numpy(), 0, atol=1e-12)  # rows lie in span(Q)
    assert float(d.norm()) == pytest.approx(float(c.norm()), rel=1e-12)
    g = torch.randn(5, 7, dtype=torch.float64)
    assert float((blk.project(g) * c).sum()) == pytest.approx(float((g * d).sum()), rel=1e-12)  # adjoint


@pytest.mark.parametrize("zero_b", [False, True])
def test_lora_block_spans_the_tangent_space_of_ba(zero_b):
    d_out, d_in, r, seed = 6, 5, 2, 9
    blk = lora_tangent_block("w", (d_out, d_in), r, seed=seed, zero_b=zero_b)
    g = torch.Generator().manual_seed(seed)  # the same draws as the block: A0 first, then B0
    a0 = torch.randn(r, d_in, generator=g, dtype=torch.float64)
    b0 = torch.randn(d_out, r, generator=g, dtype=torch.float64) * (0.0 if zero_b else 1.0)
    # tangent generators of (B, A) -> B A at (B0, A0): dB A0 + B0 dA for unit dB, dA
    gens = []
    for i in range(d_out * r):
        db = torch.zeros(d_out * r, dtype=torch.float64)
        db[i] = 1
        gens.append((db.reshape(d_out, r) @ a0).reshape(-1))
    for i in range(r * d_in):
        da = torch.zeros(r * d_in, dtype=torch.float64)
        da[i] = 1
        gens.append((b0 @ da.reshape(r, d_in)).reshape(-1))
    t = torch.stack(gens, dim=1)
    m = torch.stack([blk.embed(e).reshape(-1) for e in torch.eye(blk.dim, dtype=torch.float64)], dim=1)
    expected_dim = d_out * r if zero_b else r * (d_in + d_out) - r * r
    assert blk.dim == expected_dim == int(torch.linalg.matrix_rank(t))
    np.testing.assert_allclose((m.T @ m).numpy(), np.eye(blk.dim), atol=1e-12)
    proj_m = m @ m.T
    u, s, _ = torch.linalg.svd(t, full_matrices=False)
    u = u[:, s > 1e-10 * s[0]]
    np.testing.assert_allclose(proj_m.numpy(), (u @ u.T).numpy(), atol=1e-10)  # same subspace


def test_plate_variants_from_a_scanned_bundle(tmp_path):
    from safetensors.torch import save_file

    import plate_inspect
    from plate_inspect.experiments.digits import DigitsMLP

    torch.manual_seed(0)
    model = DigitsMLP()
    ckpt = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt))
    bundle = plate_inspect.scan(ckpt, tmp_path / "b", r=8, tau=0.9, max_rank=32, target_modules=["fc2", "fc3"])
    fams = {
        v: plate_family(model, bundle, variant=v, seed=1) for v in ("plate", "random_b", "random_q", "high_energy_q")
    }
    dims = {v: f.dim for v, f in fams.items()}
    assert len(set(dims.values())) == 1  # matched capacity
    assert dims["plate"] == sum(bundle.record(m).r * bundle.record(m).k for m in ("fc2", "fc3"))
    w = model.fc2.weight.detach().double()
    b_idx, q = bundle.b_idx("fc2"), bundle.q("fc2", dtype=torch.float64)
    c = torch.randn(fams["plate"].dim, dtype=torch.float64)
    deltas = {v: f.embed(c)["fc2.weight"] for v, f in fams.items()}
    rows = {v: torch.nonzero(d.abs().sum(1)).flatten() for v, d in deltas.items()}
    assert torch.equal(rows["plate"], b_idx) and torch.equal(rows["random_q"], b_idx)
    assert torch.equal(rows["high_energy_q"], b_idx) and not torch.equal(rows["random_b"], b_idx)
    # plate and random_b move rows inside span(Q); high_energy_q inside the top eigenspace of W_f^T W_f
    for v in ("plate", "random_b"):
        d = deltas[v][rows[v]]
        np.testing.assert_allclose((d - d @ q @ q.T).numpy(), 0, atol=1e-6)  # Q is stored as float32
    keep = torch.ones(w.shape[0], dtype=torch.bool)
    keep[b_idx] = False
    wf = w[keep]
    energy = lambda d: float((d @ wf.T).pow(2).sum() / d.pow(2).sum())  # noqa: E731
    assert energy(deltas["high_energy_q"][b_idx]) > 100 * energy(deltas["plate"][b_idx])
    lora = lora_family(model, ["fc2", "fc3"], rank=4)
    assert lora.dim == 2 * (4 * (256 + 256) - 16)


def test_bad_family_inputs_raise_one_line_errors():
    from plate_inspect.errors import PlateInspectError

    model = tiny_mlp()
    with pytest.raises(PlateInspectError, match="not in the model"):
        full_family(model, ["nope.weight"])
    with pytest.raises(PlateInspectError, match="LoRA rank"):
        lora_tangent_block("w", (4, 3), 5, seed=0)
    with pytest.raises(PlateInspectError, match="Q has"):
        selector_basis_block("w", (4, 3), torch.tensor([0]), torch.eye(5)[:, :2])
    with pytest.raises(PlateInspectError, match="empty"):
        OldTaskProblem(model, F.cross_entropy, [])


# --------------------------------------------------------------------------- CLI
def test_curvature_cli_json_records(tmp_path):
    from plate_inspect.cli.main import cli

    out = tmp_path / "deep" / "curv.json"
    args = ["curvature", "--json", "--epochs", "2", "--probes", "3", "--families", "plate,random_q,plate"]
    args += ["--rho", "0,1", "--r", "1", "--max-rank", "2"]  # dim(S) <= 6: few products (each ~0.3 s)
    res = CliRunner().invoke(cli, [*args, "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    recs = json.loads(res.stdout)
    assert json.loads(out.read_text()) == recs  # --json-out: the same records, in a file
    assert [r["family"] for r in recs] == ["plate", "random_q"]  # QA: a family named twice was analysed twice
    for r in recs:
        keys = {"family", "dim", "lambda", "eps", "gn_share_median", "residual_ratio_median", "forgetting_curve"}
        assert keys <= set(r)
        assert [rho for rho, _ in r["forgetting_curve"]] == [0.0, 1.0]
        assert r["forgetting_curve"][0][1] == 0.0
        assert r["dim"] == recs[0]["dim"] and r["eps"] > 0


def test_curvature_cli_rejects_unknown_family():
    from plate_inspect.cli.main import cli

    res = CliRunner().invoke(cli, ["curvature", "--families", "plate,bogus"])
    assert res.exit_code == 2
    assert "bogus" in res.output


def test_custom_forward_sees_replaced_parameters():
    from plate_inspect.experiments.digits import DigitsMLP

    torch.manual_seed(0)
    model = DigitsMLP().double()
    x = torch.randn(16, 64, dtype=torch.float64)
    y = torch.randint(0, 5, (16,))
    plain = OldTaskProblem(model, F.cross_entropy, [(x, y)])
    task2 = OldTaskProblem(model, F.cross_entropy, [(x, y)], forward=lambda m, xb: m(xb, task=2))
    fam = full_family(model, ["fc3.weight", "head2.weight"])
    c = np.random.default_rng(0).standard_normal(fam.dim)
    h_task2 = restricted_operator(task2, fam, "hessian").matvec(c)
    # head2 is only on the task-2 path: the default forward (task 1) has zero curvature there, the custom one does not
    n_fc3 = 256 * 256
    assert np.abs(restricted_operator(plain, fam, "hessian").matvec(c)[n_fc3:]).max() == 0
    assert np.abs(h_task2[n_fc3:]).max() > 0
    # and it equals the dense-free product computed on a model whose forward is task 2
    delta = fam.embed(torch.from_numpy(c))
    f = lambda p: F.cross_entropy(functional_call(model, p, (x,), {"task": 2}), y)  # noqa: E731
    params = {n: p.detach() for n, p in model.named_parameters()}
    _, hv = torch.func.jvp(
        torch.func.grad(f), (params,), ({n: delta.get(n, torch.zeros_like(p)) for n, p in params.items()},)
    )
    want = torch.cat([hv["fc3.weight"].reshape(-1), hv["head2.weight"].reshape(-1)]).numpy()
    np.testing.assert_allclose(h_task2, want, rtol=1e-9, atol=1e-12)


def test_bad_scan_settings_are_refused_before_stage1_training(monkeypatch, tmp_path):
    """QA: `curvature --tau 1.5` trained the digits MLP for 30 epochs (~40 s), then said tau was out of range."""
    from plate_inspect.analysis.curvature import digits_stage1
    from plate_inspect.cli.main import cli
    from plate_inspect.errors import ConfigError
    from plate_inspect.experiments import digits

    def must_not_train(*args, **kwargs):
        raise AssertionError("stage 1 trained before the settings were checked")

    monkeypatch.setattr(digits, "train_stage1", must_not_train)
    for flag, value, what in (("--tau", "1.5", "tau"), ("--tau", "0", "tau"), ("--max-rank", "0", "max")):
        res = CliRunner().invoke(cli, ["curvature", flag, value, "--out", str(tmp_path / "c")])
        assert res.exit_code == 2 and what in res.output and "Traceback" not in res.output, res.output
    with pytest.raises(ConfigError, match="tau must lie strictly between 0 and 1"):
        digits_stage1(tmp_path / "api", tau=1.0)


def test_json_record_is_strict_json_when_a_value_is_undefined(tiny):
    """QA: with no probes the GN medians are NaN, and `json.dumps` wrote the non-JSON token NaN (jq and strict
    parsers reject the whole file). Undefined values are null; defined ones are unchanged."""
    model, *_, problem = tiny
    fam = UpdateFamily(
        "plate_like", [selector_basis_block("2.weight", (4, 5), torch.tensor([0, 2]), torch.eye(5)[:, :2])]
    )
    rec = analyze_family(problem, fam, n_probes=0, rhos=(0.0, 0.5))
    data = json.loads(json.dumps(rec.to_json(), allow_nan=False))
    assert data["gn_share_median"] is None and data["residual_ratio_median"] is None
    assert data["lambda"] == rec.lam and data["eps"] == rec.eps and data["bound_ratio"] == rec.bound_ratio
    assert data["forgetting_curve"] == [[r, f] for r, f in rec.forgetting_curve]


# --------------------------------------------------------------------------- QA session 14
def test_negative_seed_is_refused_before_stage1_training(monkeypatch, tiny):
    """QA: `curvature --seed -5` trained the digits MLP, then died in numpy's default_rng (a ValueError traceback:
    "expected non-negative integer"). Refused up front, in the CLI and in the API."""
    from plate_inspect.cli.main import cli
    from plate_inspect.errors import ConfigError
    from plate_inspect.experiments import digits

    def must_not_train(*args, **kwargs):
        raise AssertionError("stage 1 trained before the seed was checked")

    monkeypatch.setattr(digits, "train_stage1", must_not_train)
    res = CliRunner().invoke(cli, ["curvature", "--seed", "-5", "--families", "plate"])
    assert res.exit_code == 2 and "--seed must be a non-negative integer, got -5" in res.output, res.output
    assert "Traceback" not in res.output
    model, *_, problem = tiny
    with pytest.raises(ConfigError, match="seed must be a non-negative integer"):
        analyze_family(problem, tiny_families(model)[1], n_probes=2, rhos=(0.0,), seed=-1)


@pytest.fixture(scope="module")
def digits_bundle(tmp_path_factory):
    """A DigitsMLP (random init, seed 0), its checkpoint and a bundle of fc2/fc3."""
    from safetensors.torch import save_file

    import plate_inspect
    from plate_inspect.experiments.digits import DigitsMLP

    tmp = tmp_path_factory.mktemp("digits_bundle")
    torch.manual_seed(0)
    model = DigitsMLP()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "m.safetensors"))
    bundle = plate_inspect.scan(tmp / "m.safetensors", tmp / "b", r=4, tau=0.9, max_rank=16, target_modules=["fc2"])
    return model, bundle


def test_plate_family_refuses_a_bundle_made_for_other_weights(digits_bundle):
    """QA: plate_family checked shapes only, so a bundle scanned from another model of the same architecture gave
    a PLATE family built on the wrong B and Q, silently. The weights are checked as apply_bundle checks them."""
    import copy

    from plate_inspect.errors import BundleError
    from plate_inspect.experiments.digits import DigitsMLP

    model, bundle = digits_bundle
    assert plate_family(model, bundle).dim == bundle.record("fc2").r * bundle.record("fc2").k
    torch.manual_seed(1)
    other = DigitsMLP()  # same shapes, other weights
    with pytest.raises(BundleError, match="fc2.*fingerprint differs from the bundle's"):
        plate_family(other, bundle)
    assert plate_family(other, bundle, check_weights=False).dim == plate_family(model, bundle).dim  # opt out
    # an exact float64 upcast of the bundle's weights is the same model (the curvature tests run in float64)
    assert plate_family(copy.deepcopy(model).double(), bundle).dim == plate_family(model, bundle).dim


def test_least_redundant_b_and_random_bq_families(digits_bundle):
    """The paper's other matched-capacity ablations (Least-red.-B, Random-(B+Q)), from the same variant_geometry
    as the training ablations: same dimension as PLATE; rows = the r smallest redundancy scores; random_bq moves
    neither PLATE's rows nor inside span(Q)."""
    model, bundle = digits_bundle
    plate = plate_family(model, bundle)
    least = plate_family(model, bundle, variant="least_redundant_b")
    both = plate_family(model, bundle, variant="random_bq", seed=3)
    assert least.dim == both.dim == plate.dim
    c = torch.randn(plate.dim, dtype=torch.float64)
    r = bundle.record("fc2").r
    rows = lambda fam: torch.nonzero(fam.embed(c)["fc2.weight"].abs().sum(1)).flatten()  # noqa: E731
    red = bundle.redundancy("fc2").double()
    assert set(rows(least).tolist()) == set(torch.argsort(red)[:r].tolist())
    assert not torch.equal(rows(both), bundle.b_idx("fc2"))
    q = bundle.q("fc2", dtype=torch.float64)
    d = least.embed(c)["fc2.weight"][rows(least)]
    np.testing.assert_allclose((d - d @ q @ q.T).numpy(), 0, atol=1e-6)  # least_redundant_b keeps Q
    d = both.embed(c)["fc2.weight"][rows(both)]
    assert float((d - d @ q @ q.T).norm()) > 0.1 * float(d.norm())  # random_bq does not


def test_plate_family_on_conv1d_moves_b_rows_of_the_oriented_weight(tmp_path):
    """QA: GPT-2's Conv1D stores W as [d_in, d_out]; plate_family indexed B rows of the stored tensor, so on a
    square Conv1D (attn.c_proj) it moved columns of W (input coordinates) instead of output rows, without error.
    The oriented delta (stored.T) must have nonzero rows exactly at B, each inside span(Q); isometric."""
    transformers = pytest.importorskip("transformers")
    import plate_inspect

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8)
    model = transformers.GPT2Model(config)
    model.save_pretrained(tmp_path / "gpt2")
    bundle = plate_inspect.scan(
        tmp_path / "gpt2", tmp_path / "b", r=3, tau=0.9, max_rank=8, target_modules=["attn.c_proj", "mlp.c_fc"]
    )
    assert bundle.record("h.0.attn.c_proj").layout == "conv1d"
    fam = plate_family(model, bundle)
    c = torch.randn(fam.dim, dtype=torch.float64)
    deltas = fam.embed(c)
    assert float(torch.cat([d.reshape(-1) for d in deltas.values()]).norm()) == pytest.approx(float(c.norm()))
    for name in ("h.0.attn.c_proj", "h.0.mlp.c_fc"):
        stored = dict(model.named_parameters())[f"{name}.weight"]
        assert deltas[f"{name}.weight"].shape == stored.shape  # [d_in, d_out], as stored
        oriented = deltas[f"{name}.weight"].T  # [d_out, d_in]
        b_idx, q = bundle.b_idx(name), bundle.q(name, dtype=torch.float64)
        assert torch.equal(torch.nonzero(oriented.abs().sum(1)).flatten(), b_idx.sort().values)
        d = oriented[b_idx]
        np.testing.assert_allclose((d - d @ q @ q.T).numpy(), 0, atol=1e-6)
    # the adjoint: <project(g), c> = <g, embed(c)> for a stored-layout gradient g
    g = {n: torch.randn_like(d) for n, d in deltas.items()}
    assert float((fam.project(g) * c).sum()) == pytest.approx(sum(float((g[n] * deltas[n]).sum()) for n in g))


def test_lora_family_on_conv1d_restricts_the_input_side_with_zero_b():
    """QA: lora_family built the tangent block on Conv1D's stored [d_in, d_out] tensor, so with zero_b (PEFT's
    B0 = 0) the update's *output* side was confined to an r-dim subspace instead of its input side (row(A0)).
    Oriented deltas of any coordinates must share one r-dim row space in R^{d_in}; the basis is isometric."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    d_in, d_out, r = 6, 9, 2
    model = nn.Sequential(Conv1D(d_out, d_in)).double()  # weight stored [d_in, d_out]
    assert tuple(model[0].weight.shape) == (d_in, d_out)
    fam = lora_family(model, ["0"], rank=r, zero_b=True)
    assert fam.dim == d_out * r
    m = dense_basis(fam, model)
    np.testing.assert_allclose((m.T @ m).numpy(), np.eye(fam.dim), atol=1e-12)
    g = torch.Generator().manual_seed(0)
    oriented = [fam.embed(torch.randn(fam.dim, generator=g, dtype=torch.float64))["0.weight"].T for _ in range(3)]
    assert all(d.shape == (d_out, d_in) for d in oriented)
    assert int(torch.linalg.matrix_rank(torch.cat(oriented, dim=0))) == r  # one shared input subspace
    full = lora_family(model, ["0"], rank=r)
    assert full.dim == r * (d_in + d_out) - r * r


def test_curvature_json_out_is_checked_first_and_left_alone_by_a_failed_run(monkeypatch, tmp_path):
    """QA: the only way to keep the records was `--json > file`, which the shell truncates before a minute-long
    run (a failed run left an empty file). --json-out (written atomically after the run: see
    test_curvature_cli_json_records) is checked before the training: a directory or a FIFO is one line; a failed
    run leaves an existing file untouched."""
    import os

    from plate_inspect.analysis import curvature as curvature_mod
    from plate_inspect.cli.main import cli
    from plate_inspect.errors import CurvatureError

    args = ["curvature", "--epochs", "1", "--families", "plate", "--probes", "2", "-q"]

    def must_not_train(*a, **k):
        raise AssertionError("trained before --json-out was checked")

    monkeypatch.setattr(curvature_mod, "digits_stage1", must_not_train)
    os.mkfifo(tmp_path / "fifo")
    for bad, what in ((tmp_path, "is a directory"), (tmp_path / "fifo", "not a regular file")):
        res = CliRunner().invoke(cli, [*args, "--json-out", str(bad)])
        assert res.exit_code == 2 and what in res.output and "Traceback" not in res.output, res.output

    def fail(*a, **k):
        raise CurvatureError("simulated failure")

    monkeypatch.setattr(curvature_mod, "digits_stage1", fail)
    target = tmp_path / "curv.json"
    previous = '[{"family": "plate"}]\n'  # earlier records (another kind of file is refused up front: test_qa18)
    target.write_text(previous)
    res = CliRunner().invoke(cli, [*args, "--json-out", str(target)])
    assert res.exit_code != 0 and "simulated failure" in res.output
    assert target.read_text() == previous


def test_analyze_families_leaves_the_models_training_mode_as_it_was():
    """QA: analyze_families switched a model in training mode to eval for good (OldTaskProblem calls eval(): dropout
    off for a deterministic L0), so a user training on afterwards silently trained without dropout. The records are
    those of the eval-mode model (dropout off), and the mode is restored."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 3)).double()
    x, y = tiny_data()
    fam = full_family(model, ["3.weight"])
    model.train()
    (rec,) = analyze_families(model, F.cross_entropy, [(x, y)], [fam], n_probes=2, rhos=(0.0,))
    assert model.training and model[2].training
    model.eval()
    (want,) = analyze_families(model, F.cross_entropy, [(x, y)], [fam], n_probes=2, rhos=(0.0,))
    assert not model.training
    assert rec.lam == pytest.approx(want.lam, rel=1e-12) and rec.eps == pytest.approx(want.eps, rel=1e-12)


def test_operators_on_a_tiny_transformer_match_dense_oracles():
    """Attention (MultiheadAttention's functional in/out projections), LayerNorm and a ReLU FFN: the restricted
    Hessian, GGN and drift Gram on PLATE-like blocks of the attention's in_proj (q, k and v rows) and of linear2
    equal M^T C M of the dense float64 matrices; lambda and eps follow. QA: products through attention raised
    "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented" (the fused
    kernel has no double backward); OldTaskProblem now evaluates the model with the math attention kernel."""
    torch.manual_seed(0)
    model = TinyTransformer().double().eval()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 5, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=g)
    with math_attention():  # the oracle's double backward: CPU flash attention has none
        hess, ggn, gram, _ = dense_oracles(model, x, y)
    problem = OldTaskProblem(model, F.cross_entropy, [(x, y)])  # default attention kernels outside
    q_in, q = (
        random_orthonormal(4, 2, seed=2, dtype=torch.float64),
        random_orthonormal(6, 2, seed=1, dtype=torch.float64),
    )
    fams = [  # small families: each product through attention costs ~0.1-0.5 s of torch.func overhead
        UpdateFamily(
            "in_proj", [selector_basis_block("enc.self_attn.in_proj_weight", (12, 4), torch.tensor([0, 5, 9]), q_in)]
        ),
        UpdateFamily("plate_like", [selector_basis_block("enc.linear2.weight", (4, 6), torch.tensor([1, 3]), q)]),
    ]
    for fam in fams:
        m = dense_basis(fam, model)
        for kind, dense in (("hessian", hess), ("ggn", ggn), ("drift", gram)):
            want = (m.T @ dense @ m).numpy()
            got = op_dense(restricted_operator(problem, fam, kind))
            np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10 * np.abs(want).max(), err_msg=fam.name)
        rec = analyze_family(problem, fam, n_probes=2, rhos=(0.0,))
        assert rec.lam == pytest.approx(float(torch.linalg.eigvalsh(m.T @ hess @ m).max()), rel=1e-8)
        assert rec.eps == pytest.approx(float(torch.linalg.eigvalsh(m.T @ gram @ m).max()) ** 0.5, rel=1e-8)
        assert rec.lam_gn <= rec.beta * rec.eps**2 * (1 + 1e-9)
    assert abs(float((hess - ggn).abs().max())) > 1e-3  # a real residual term: attention and LayerNorm are curved


def test_lanczos_without_convergence_is_a_one_line_error():
    """QA: eigsh's ArpackNoConvergence escaped as a scipy traceback. It is a CurvatureError saying what to change;
    with room to converge the same operator gives the dense top eigenvalue."""
    from scipy.sparse.linalg import aslinearoperator

    from plate_inspect.errors import CurvatureError

    rng = np.random.default_rng(0)
    a = rng.standard_normal((200, 200))
    sym = aslinearoperator(a + a.T)
    with pytest.raises(CurvatureError, match=r"200-dimensional .* within 1 iterations at tol=1e-14"):
        top_eigenpair(sym, tol=1e-14, dense_max_dim=0, maxiter=1)
    val, _ = top_eigenpair(sym, dense_max_dim=0, tol=1e-10)
    assert val == pytest.approx(float(np.linalg.eigvalsh(a + a.T)[-1]), rel=1e-8)


def test_half_precision_models_are_refused_with_the_remedy(tiny):
    """QA: a bfloat16 model ran: its products (and the coordinates, cast to bfloat16) keep ~2-3 significant digits,
    fewer for q_R = q_H - q_GN, silently. Refused, naming the cast that works; the float32 copy runs
    and agrees with float64 (see test_analysis_float32)."""
    import copy

    from plate_inspect.errors import ConfigError

    model, x, y, *_ = tiny
    for dtype in (torch.bfloat16, torch.float16):
        low = copy.deepcopy(model).to(dtype)
        with pytest.raises(ConfigError, match=rf"{str(dtype)[6:]} parameters.*copy\.deepcopy\(model\)\.float\(\)"):
            OldTaskProblem(low, F.cross_entropy, [(x.to(dtype), y)])
    OldTaskProblem(copy.deepcopy(model).float(), F.cross_entropy, [(x.float(), y)])


def test_curvature_cli_explains_a_forgetting_curve_that_overflows(tmp_path):
    """--rho 1e30: F was 'nan' in the table, unexplained; now a line names the rho and what to do."""
    from plate_inspect.cli.main import cli

    args = ["curvature", "--epochs", "2", "--probes", "3", "--families", "plate", "--rho", "0,1,1e30"]
    res = CliRunner().invoke(cli, [*args, "--r", "1", "--max-rank", "2", "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert "F is not finite at rho = 1e+30" in " ".join(res.output.split())
    assert "rho = 1," not in res.output and "rho = 0" not in res.output  # finite values are not named
