"""plan: the allocation is exact with unequal r (brute force over every per-module k; an exhaustive dynamic
program over the spend; a module with r = 0), the greedy only as a fallback that says so with a valid lower bound;
the optimality statement in text and JSON."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_cli import run_cli
from helpers_plan import brute_force, curve, every_allocation, score
from safetensors.numpy import load_file

import plate_inspect
from plate_inspect import scan
from plate_inspect.cli.main import cli
from plate_inspect.plan import allocate_greedy, allocation, plan_budget
from plate_inspect.testing.synthetic import write_llama_like


def instance(seed: int, equal_r: bool):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 5, (1,), generator=g))
    curves, ranks, k_max = [], [], []
    for _ in range(n):
        d_in = int(torch.randint(3, 7, (1,), generator=g))
        lam = torch.rand(d_in, generator=g, dtype=torch.float64) ** 3
        lam[: int(torch.randint(0, 3, (1,), generator=g))] = 0.0  # null directions
        curves.append(curve(sorted(lam.tolist())))
        k_max.append(int(torch.randint(1, d_in + 1, (1,), generator=g)))
        ranks.append(3 if equal_r else int(torch.randint(0, 6, (1,), generator=g)))  # r = 0: a one-row gate
    return curves, ranks, k_max


@pytest.mark.parametrize("equal_r", [True, False])
@pytest.mark.parametrize("objective", ["minimax", "mean"])
def test_exact_allocation_equals_brute_force(objective, equal_r):
    """60 seeded random instances (2-4 modules, r in 0..5 or all 3, k_max 1..6), every budget from sum r to past
    the capacity: the plan's spend and objective equal brute force's; it spends at least the greedy's, and at the
    same spend its objective is no larger. Before: the greedy was off on 7% of unequal-r cases (session 15)."""
    better = 0
    for seed in range(60):
        curves, ranks, k_max = instance(seed, equal_r)
        for budget in range(sum(ranks), sum(r * m for r, m in zip(ranks, k_max, strict=True)) + 3):
            found = allocation(curves, ranks, k_max, budget, objective)
            ks = found.ks
            assert found.method == "exact" and all(1 <= k <= m for k, m in zip(ks, k_max, strict=True))
            assert all(k == 1 for k, r in zip(ks, ranks, strict=True) if r == 0)
            spend = sum(r * k for r, k in zip(ranks, ks, strict=True))
            want_spend, want_value = brute_force(curves, ranks, k_max, budget, objective)
            assert spend == want_spend, (seed, budget)
            assert found.objective == pytest.approx(want_value, abs=1e-12) == score(curves, ks, objective)
            greedy = allocate_greedy(curves, ranks, k_max, budget, objective)
            greedy_spend = sum(r * k for r, k in zip(ranks, greedy, strict=True))
            assert spend >= greedy_spend
            if spend == greedy_spend:
                assert found.objective <= score(curves, greedy, objective) + 1e-12
            better += spend > greedy_spend or found.objective < score(curves, greedy, objective) - 1e-12
            if equal_r:  # the greedy was already optimal there: same spend, same objective
                assert spend == greedy_spend
                assert found.objective == pytest.approx(score(curves, greedy, objective), abs=1e-12)
    assert (better > 0) == (not equal_r)  # the exact plan does improve on the greedy with unequal r


@pytest.mark.parametrize("objective", ["minimax", "mean"])
def test_large_program_solvers_equal_brute_force(objective):
    """The path for programs too large to enumerate (limit 0): minimax's integer feasibility programs over one count
    per r, and mean's Lagrangian search (session 18; it was the greedy before), give the same spend and objective
    as brute force on the unequal-r instances with 2+ different r."""
    runs = 0
    for seed in range(60):
        curves, ranks, k_max = instance(seed, equal_r=False)
        if len({r for r, m in zip(ranks, k_max, strict=True) if r > 0 and m > 1}) < 2:
            continue  # one r that can grow: closed form
        for budget in range(sum(ranks), sum(r * m for r, m in zip(ranks, k_max, strict=True)) + 3):
            found = allocation(curves, ranks, k_max, budget, objective, limit=0)
            solver = "integer program" if objective == "minimax" else "Lagrangian search"
            assert (found.method, found.solver) == ("exact", solver)
            spend = sum(r * k for r, k in zip(ranks, found.ks, strict=True))
            want_spend, want_value = brute_force(curves, ranks, k_max, budget, objective)
            assert spend == want_spend and found.objective == pytest.approx(want_value, abs=1e-12), (seed, budget)
            runs += 1
    assert runs > 200


@pytest.mark.parametrize("objective", ["minimax", "mean"])
def test_greedy_fallback_states_a_valid_lower_bound(objective):
    """With no exact answer (limit 0, no integer programs or mean search) the greedy runs, says why, and its lower
    bound is <= the best objective brute force finds among allocations spending at least as much, and <= the
    greedy's own."""
    for seed in range(40):
        curves, ranks, k_max = instance(seed, equal_r=False)
        if len({r for r, m in zip(ranks, k_max, strict=True) if r > 0 and m > 1}) < 2:
            continue  # one r that can grow: closed form, never the fallback
        for budget in range(sum(ranks), sum(r * m for r, m in zip(ranks, k_max, strict=True)) + 1):
            found = allocation(curves, ranks, k_max, budget, objective, limit=0, large_solvers=False)
            assert found.method == "greedy" and "exact program" in found.reason
            assert found.ks == allocate_greedy(curves, ranks, k_max, budget, objective)
            spend = sum(r * k for r, k in zip(ranks, found.ks, strict=True))
            best = min(
                score(curves, ks, objective)
                for ks in every_allocation(ranks, k_max)
                if spend <= sum(r * k for r, k in zip(ranks, ks, strict=True)) <= budget
            )
            assert found.lower_bound <= best + 1e-12 and found.lower_bound <= found.objective + 1e-12
            assert found.to_json()["gap"] == pytest.approx(found.objective - found.lower_bound)


def test_plan_states_its_optimality_in_text_and_json(three_r_bundle, tmp_path, monkeypatch):
    b = three_r_bundle
    assert len({rec.r for rec in b}) == 3
    plan = plan_budget(b, "5%", "minimax").to_json()
    assert plan["optimality"]["method"] == "exact"
    assert plan["optimality"]["objective"] == plan["summary"]["max_captured_energy"]
    res = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "5%", "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert "optimal: exact" in res.output
    assert json.loads((tmp_path / "p.json").read_text())["optimality"]["method"] == "exact"

    monkeypatch.setattr("plate_inspect.plan.EXACT_WORK_LIMIT", 0)  # a program too large to enumerate
    assert plan_budget(b, "5%", "minimax").optimality == {**plan["optimality"], "solver": "integer program"}
    monkeypatch.setattr("plate_inspect.plan._milp_counts", lambda *args: None)  # ... and no integer answer
    res = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "5%", "--json"])
    assert res.exit_code == 0, res.output
    opt = json.loads(res.output)["optimality"]
    assert opt["method"] == "greedy" and opt["lower_bound"] <= opt["objective"] and "3 different r" in opt["reason"]
    res = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "5%", "-o", str(tmp_path / "g.json")])
    assert res.exit_code == 0 and "greedy fallback" in res.output and "lower bound" in res.output, res.output


# --------------------------------------------------------------------------- plan --budget against a brute force
def _oracle_plan(bundle_dir, modules: dict, budget: int, objective: str) -> tuple[int, float]:
    """(most parameters spendable within ``budget``, the best objective among plans spending exactly that), by
    dynamic programming over the spend with every k in 1..bundle k, from the bundle's stored spectra."""
    spectra = {}
    for f in bundle_dir.glob("*.safetensors"):
        spectra.update({k[: -len(".spectrum")]: v for k, v in load_file(f).items() if k.endswith(".spectrum")})
    curves, ranks, kmax = [], [], []
    for name, m in modules.items():
        lam = np.sort(spectra[name].astype(np.float64).clip(0))  # ascending; G's other d_in - len are zero
        lam = np.concatenate([np.zeros(m["d_in"] - len(lam)), lam])
        curves.append(np.concatenate([[0.0], np.cumsum(lam)]) / lam.sum())
        ranks.append(m["r"])
        kmax.append(m["bundle_k"])
    # best[s] = best objective (max or sum) over the modules so far spending exactly s (inf: not reachable)
    best = np.full(budget + 1, np.inf)
    best[0] = 0.0
    for c, r, kk in zip(curves, ranks, kmax, strict=True):
        nxt = np.full(budget + 1, np.inf)
        for k in range(1, min(kk, budget // r) + 1):
            shifted = best[: budget + 1 - r * k]
            value = np.maximum(shifted, c[k]) if objective == "minimax" else shifted + c[k]
            nxt[r * k :] = np.minimum(nxt[r * k :], value)
        best = nxt
    spend = int(np.flatnonzero(np.isfinite(best)).max())
    return spend, best[spend] / (len(curves) if objective == "mean" else 1)


@pytest.fixture(scope="module")
def three_r_bundle_tau_06(tmp_path_factory):
    """The model of conftest's three_r_bundle scanned at tau 0.6: q/o/down keep r = 57, k/v 28, gate/up 64."""
    root = tmp_path_factory.mktemp("three_r_tau_06")
    ckpt = write_llama_like(root / "model", layers=2, dtype=torch.float32, planted_fraction=0.1)
    return plate_inspect.scan(ckpt.path, root / "bundle", r=64, tau=0.6, max_rank=512)


@pytest.mark.parametrize("objective", ["minimax", "mean"])
def test_plan_budget_equals_an_exhaustive_search(three_r_bundle_tau_06, objective, tmp_path):
    """The CLI's plan file spends the most the budget allows and has the best objective at that spend, for budgets
    at the edges: just above the minimum (sum of r), 1%, mid-range, and beyond what the bundle holds."""
    b = three_r_bundle_tau_06
    assert len({rec.r for rec in b}) == 3
    minimum = sum(rec.r for rec in b)
    capacity = sum(rec.r * rec.k for rec in b)
    for budget in (minimum, minimum + 1, minimum + 211, 3000, capacity - 1, capacity + 10**6):
        out = tmp_path / f"{objective}-{budget}.json"
        code, output = run_cli("plan", b.path, "--budget", budget, "--objective", objective, "-o", out)
        assert code == 0, output
        plan = json.loads(out.read_text())
        spend, best = _oracle_plan(b.path, plan["modules"], min(budget, capacity), objective)
        assert plan["budget"]["spent"] == spend == sum(m["r"] * m["k"] for m in plan["modules"].values()), budget
        key = "max_captured_energy" if objective == "minimax" else "mean_captured_energy"
        assert plan["summary"][key] == pytest.approx(best, rel=1e-9, abs=1e-15), budget
        assert plan["optimality"]["method"] == "exact"
        assert plan["budget"]["limited_by_bundle"] == (budget > capacity)
    code, output = run_cli("plan", b.path, "--budget", minimum - 1, "-o", tmp_path / "low.json")
    assert code == 2 and f"below the minimum {minimum}" in output, output


@pytest.fixture(scope="module")
def gate_bundle(tmp_path_factory):
    """A Qwen2-MoE model scanned at a low tau on q_proj (2 layers) and the one-row shared_expert_gate (r = 0)."""
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

    from click.testing import CliRunner
    from oracles import load_all

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
