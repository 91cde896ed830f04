"""QA of the "beyond the paper" commands (plan, health, audit) as a user meets them: each test here failed before
its fix, against an independent oracle (weightwatcher's own fit, a hand-computed case, brute force)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from plate_inspect.health import fit_power_law, health_record, matrix_entropy


def pareto_spectrum(n: int = 500, alpha: float = 2.5, seed: int = 0) -> np.ndarray:
    """A planted power-law spectrum: n Pareto(alpha) draws (density ~ x^-alpha for x >= 1), ascending."""
    rng = np.random.default_rng(seed)
    return np.sort((1.0 - rng.random(n)) ** (-1.0 / (alpha - 1.0)))


@pytest.mark.parametrize("tied", [2, 5])
def test_power_law_fit_with_tied_top_eigenvalues_matches_weightwatcher(tied):
    """QA: when the largest eigenvalues tie, the candidate xmin at the tie has a tail with no log-spread (alpha
    inf), its KS distance came out NaN (0 * inf in the exponent) and argmin picked it: alpha None for a clean
    power-law spectrum, and a RuntimeWarning. weightwatcher's own fit (x / xmin = 1 there, whatever alpha) is the
    oracle; the untied spectrum's alpha (2.44 planted 2.5) is kept."""
    from weightwatcher.WW_powerlaw import WWFit

    spectrum = pareto_spectrum()
    spectrum[-tied:] = spectrum[-1]
    theirs = WWFit(spectrum)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mine = fit_power_law(spectrum)
    assert mine is not None
    assert mine.alpha == pytest.approx(theirs.alpha, rel=1e-9) and 2.3 < mine.alpha < 2.6
    assert mine.xmin == theirs.xmin and mine.ks_distance == pytest.approx(theirs.D, rel=1e-9)
    record = health_record(spectrum, (500, 500))
    assert record["alpha"] == pytest.approx(theirs.alpha, rel=1e-9)


@pytest.mark.parametrize("n", [64, 30])
def test_a_flat_spectrum_has_no_power_law_fit_and_a_consistent_record(n):
    """QA: all eigenvalues equal (an orthogonal weight): alpha was inf (None in the record) while xmin and
    num_pl_spikes (all n) were still reported as if a tail had been fitted, with a RuntimeWarning. weightwatcher
    gives alpha inf there: no finite exponent, so no fit, and every power-law field is null."""
    from weightwatcher.WW_powerlaw import WWFit

    assert WWFit(np.ones(n)).alpha == np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_power_law(np.ones(n)) is None
        record = health_record(np.ones(n), (n, n))
    for key in ("alpha", "xmin", "ks_distance", "num_pl_spikes", "alpha_weighted"):
        assert record[key] is None, key
    assert record["stable_rank"] == pytest.approx(n) and record["entropy"] == pytest.approx(1.0, abs=1e-8)
    json.dumps(record, allow_nan=False)


@pytest.mark.parametrize(("spectrum", "shape"), [([5.0] + [0.0] * 63, (64, 64)), ([2.0], (1, 64))])
def test_entropy_of_a_rank_one_spectrum_is_zero(spectrum, shape):
    """QA: the normalised entropy of a rank-one spectrum (all energy in one direction) is 0 by definition; the
    formula divided by log(1 + 1e-10) and gave 1449.6 for a rank-one 64 x 64 weight and -1.0000000001 for a
    one-row W_frozen (a gate), off the [0, 1] scale the health table reads on."""
    assert matrix_entropy(spectrum, max(shape)) == 0.0
    assert health_record(spectrum, shape)["entropy"] == 0.0
    # rank two keeps the formula: two equal eigenvalues are flat (1), [3, 1] is the hand-computed value
    assert matrix_entropy([2.0, 2.0] + [0.0] * 62, 64) == pytest.approx(1.0, abs=1e-6)
    p = np.array([0.75, 0.25])
    assert matrix_entropy([3.0, 1.0, 0.0], 3) == pytest.approx(float(-(p * np.log(p)).sum() / np.log(2)), abs=1e-6)


@pytest.fixture(scope="module")
def gate_bundle(tmp_path_factory):
    """A Qwen2-MoE model scanned at a low tau on q_proj (2 layers) and the one-row shared_expert_gate (r = 0)."""
    from plate_inspect import scan
    from plate_inspect.testing.synthetic import write_family

    root = tmp_path_factory.mktemp("gate")
    ckpt = write_family(root / "qmoe", "qwen2_moe")
    bundle = scan(ckpt.path, root / "b", r=4, tau=0.5, max_rank=16, target_modules=["q_proj", "shared_expert_gate"])
    return bundle, ckpt.path


@pytest.mark.parametrize("objective", ["mean", "minimax"])
def test_plan_with_a_zero_r_module_is_optimal_by_brute_force(gate_bundle, objective):
    """QA: `plan --objective mean` on a bundle holding a one-row gate (r = 0: scan notes it trains nothing) ended
    in a ZeroDivisionError traceback (captured energy per parameter, over r = 0). That module now stays at k = 1
    (0 parameters), and the other modules' k are optimal: brute force over every allocation, with captured energy
    from numpy's eigenvalues of W_f (W without the bundle's B rows) in float64."""
    import itertools

    from click.testing import CliRunner
    from conftest import load_all

    from plate_inspect.cli.main import cli
    from plate_inspect.plan import plan_budget

    bundle, ckpt = gate_bundle
    weights = load_all(ckpt)
    zero = [rec.name for rec in bundle if rec.r == 0]
    trained = [rec for rec in bundle if rec.r > 0]
    assert zero and len(trained) == 2 and len({rec.r for rec in trained}) == 1
    curves = {}
    for rec in trained:
        w = weights[f"{rec.name}.weight"].double().numpy()
        frozen = np.delete(w, bundle.b_idx(rec.name).numpy(), axis=0)
        lam = np.sort(np.linalg.eigvalsh(frozen.T @ frozen).clip(0))
        curves[rec.name] = np.concatenate([[0.0], np.cumsum(lam)]) / lam.sum()
    r = trained[0].r
    for budget in (r * 2, r * 5, r * 9, r * 17):
        plan = plan_budget(bundle, str(budget), objective).to_json()
        assert all(plan["modules"][n]["k"] == 1 and plan["modules"][n]["params"] == 0 for n in zero)
        ks = [plan["modules"][rec.name]["k"] for rec in trained]
        spent = r * sum(ks)
        assert plan["budget"]["spent"] == spent == min(budget, r * sum(rec.k for rec in trained))

        def score(alloc):
            levels = [curves[rec.name][k] for rec, k in zip(trained, alloc, strict=True)]
            return max(levels) if objective == "minimax" else sum(levels)

        allocs = itertools.product(*[range(1, rec.k + 1) for rec in trained])
        best = min(score(a) for a in allocs if r * sum(a) == spent)
        assert score(ks) <= best + 1e-9, (budget, ks)
    result = CliRunner().invoke(cli, ["plan", str(bundle.path), "--budget", "1%", "--objective", objective, "--json"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output


def test_a_bf16_save_of_an_fp32_fine_tune_scores_its_update_not_the_rounding(tmp_path):
    """QA: TUNED stored in bf16 over an fp32 BASE: dW was TUNED - BASE, so every weight's storage rounding counted
    as an update. A bf16 copy of BASE itself audited as "3/3 modules changed", ||dW||/||W|| 1.5e-3, frozen-row
    share 0.94, protected share at chance; a PLATE fine-tune (merged by `plate-inspect merge`, then saved in bf16)
    showed a frozen-row share of up to 7e-4 where PLATE touches none, and 2.5x its risk. Now dW = TUNED - BASE
    rounded to bf16: the copy is unchanged, and the merged PLATE update keeps frozen-row share exactly 0 (oracle:
    the fp32 merge's own audit, where dW is exactly rho A Q^T on B's rows) and its ||dW|| to bf16 rounding."""
    import torch
    from click.testing import CliRunner
    from helpers_train import digits_bundle, digits_checkpoint, randomize_adapters
    from safetensors.torch import load_file, save_file

    from plate_inspect.auditing import audit
    from plate_inspect.cli.main import cli
    from plate_inspect.train.layer import apply_bundle, save_adapter

    model, ckpt = digits_checkpoint(tmp_path / "base")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.8)
    randomize_adapters(apply_bundle(model, bundle, rho=0.5), seed=1, scale=0.05)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    merged = tmp_path / "merged"
    res = CliRunner().invoke(cli, ["merge", str(ckpt.parent), str(adapter), "--out", str(merged), "-q"])
    assert res.exit_code == 0, res.output
    for name, source in (("copy16", ckpt), ("merged16", merged / "model.safetensors")):
        (tmp_path / name).mkdir()
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(source)).items()}
        save_file(tensors, str(tmp_path / name / "model.safetensors"))

    copy = audit(ckpt.parent, tmp_path / "copy16", bundle=bundle, tau=0.8)
    assert [r.delta_norm for r in copy] == [0.0] * len(copy) and {r.base_rounded_to for r in copy} == {"bfloat16"}
    exact = {r.module: r for r in audit(ckpt.parent, merged, bundle=bundle, tau=0.8)}
    assert all(r.frozen_row_share == 0.0 and r.protected_input_share < 1e-6 for r in exact.values())
    assert all(r.base_rounded_to is None for r in exact.values())
    for rec in audit(ckpt.parent, tmp_path / "merged16", bundle=bundle, tau=0.8):
        assert rec.frozen_row_share == 0.0, rec.module
        assert rec.delta_norm == pytest.approx(exact[rec.module].delta_norm, rel=2**-7)
        assert rec.protected_input_share < 1e-3  # the B rows' bf16 rounding only (chance is 0.38-0.61)
    res = CliRunner().invoke(cli, ["audit", str(ckpt.parent), str(tmp_path / "copy16"), "--bundle", str(bundle.path)])
    assert res.exit_code == 0 and "model: 0/3 modules changed" in res.output, res.output
    assert "note: TUNED stores 3 modules in bfloat16, which does not hold BASE's values exactly: dW = TUNED - BASE" in (
        res.output
    )
