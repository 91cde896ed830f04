"""plan: the mean objective is exact when the dynamic program is too large (three or more different r
on a large bundle), by a search certified with a Lagrangian lower bound; the greedy only when its guards trip."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_plan import brute_force, curve, score

from plate_inspect.cli.main import cli
from plate_inspect.geometry import k_for_tau
from plate_inspect.plan import (
    _lower_bound,
    _top_reachable_spend,
    allocate_greedy,
    allocation,
    captured_energy_curve,
    plan_budget,
)


def spend_of(ranks, ks):
    return sum(r * k for r, k in zip(ranks, ks, strict=True))


def growable_ranks(ranks, k_max):
    return {r for r, m in zip(ranks, k_max, strict=True) if r > 0 and m > 1}


def many_r_instance(seed: int):
    """3-5 modules of 3-4 different r (one module may be a r = 0 gate), d_in 3-6, eigenvalues log-uniform over
    1e-12..1 with some exact zeros (null directions): increments as small as real 7B spectra give."""
    g = np.random.default_rng(seed)
    n = int(g.integers(3, 6))
    pool = [int(r) for r in g.choice(np.arange(1, 9), size=int(g.integers(3, 5)), replace=False)]
    ranks = pool + [int(g.choice(pool + [0])) for _ in range(n - len(pool))] if n >= len(pool) else pool
    curves, k_max = [], []
    for _ in ranks:
        d_in = int(g.integers(3, 7))
        lam = 10.0 ** g.uniform(-12, 0, d_in)
        lam[: int(g.integers(0, 3))] = 0.0
        curves.append(curve(sorted(lam.tolist())))
        k_max.append(int(g.integers(2, d_in + 1)))
    return curves, ranks, k_max


def test_mean_search_equals_brute_force_with_three_and_four_r():
    """Brute force over every per-module k (the largest spend within the budget, then the smallest mean there) on
    seeded instances with 3 or 4 different r, every budget from the minimum to past the capacity: the search
    (forced with limit 0) gives the same spend and mean (1e-12; increments down to 1e-12) and says it is exact.
    Before (HEAD): the greedy ran there, and spent less or had a larger mean on some of these budgets."""
    runs, by_r, greedy_worse = 0, {3: 0, 4: 0}, 0
    for seed in range(80):
        curves, ranks, k_max = many_r_instance(seed)
        distinct = len(growable_ranks(ranks, k_max))
        if distinct < 3:
            continue
        by_r[distinct] += 1
        for budget in range(sum(ranks), spend_of(ranks, k_max) + 3):
            found = allocation(curves, ranks, k_max, budget, "mean", limit=0)
            assert (found.method, found.solver) == ("exact", "Lagrangian search"), (seed, budget, found.reason)
            assert all(1 <= k <= m for k, m in zip(found.ks, k_max, strict=True))
            assert all(k == 1 for k, r in zip(found.ks, ranks, strict=True) if r == 0)
            want_spend, want_value = brute_force(curves, ranks, k_max, budget, "mean")
            assert spend_of(ranks, found.ks) == want_spend, (seed, budget)
            assert found.objective == pytest.approx(want_value, abs=1e-12) == score(curves, found.ks, "mean")
            greedy = allocate_greedy(curves, ranks, k_max, budget, "mean")
            greedy_worse += spend_of(ranks, greedy) < want_spend or score(curves, greedy, "mean") > want_value + 1e-12
            runs += 1
    assert by_r[3] >= 20 and by_r[4] >= 10 and runs > 1000, (by_r, runs)
    assert greedy_worse > 0  # the instances do catch a heuristic


def test_top_reachable_spend_equals_enumeration():
    """The table of reachable spends: the largest sum w.n <= units, every 0 <= n_g <= cap_g, by enumeration."""
    g = np.random.default_rng(3)
    for _ in range(300):
        size = int(g.integers(1, 5))
        weights = [int(w) for w in g.integers(1, 12, size)]
        caps = [int(c) for c in g.integers(0, 5, size)]
        sums = {
            sum(w * n for w, n in zip(weights, ns, strict=True))
            for ns in itertools.product(*[range(c + 1) for c in caps])
        }
        for units in range(0, max(sums) + 3):
            assert _top_reachable_spend(weights, caps, units) == max(s for s in sums if s <= units)


def medium_instance(seed: int, flat: bool):
    """12-16 modules of four r (64/57/28/45 or, with ``flat``, 64/32/57/28 where the even-r modules are mostly null
    space: at the relaxation's price 0 an odd spend then needs one priced column), up to 40 columns each."""
    g = np.random.default_rng(seed)
    rank_pool = [64, 32, 57, 28] if flat else [64, 57, 28, 45]
    curves, ranks, k_max = [], [], []
    for i in range(int(g.integers(12, 17))):
        r = rank_pool[i % 4]
        d_in = int(g.integers(30, 60))
        lam = 10.0 ** g.uniform(-12, 0, d_in)
        zeros = int(g.integers(20, d_in)) if flat and r % 2 == 0 else int(g.integers(0, 4))
        lam[:zeros] = 0.0
        curves.append(curve(sorted(lam.tolist())))
        ranks.append(r)
        k_max.append(int(g.integers(2, min(d_in, 40) + 1)))
    return curves, ranks, k_max


@pytest.mark.parametrize("flat", [False, True])
def test_mean_search_equals_dynamic_program_on_medium_instances(flat):
    """An independent exact method on instances too large for brute force: the dynamic program over the spend
    (the search switched off) and the search (limit 0: no program) agree on the spend and the mean (relative
    1e-12) at 12 budgets each."""
    for seed in range(6):
        curves, ranks, k_max = medium_instance(seed, flat)
        lo, cap = sum(ranks), spend_of(ranks, k_max)
        for budget in np.linspace(lo, cap + 5, 12).astype(int) + np.arange(12) % 2:  # odd budgets too
            dp = allocation(curves, ranks, k_max, int(budget), "mean", large_solvers=False)
            search = allocation(curves, ranks, k_max, int(budget), "mean", limit=0)
            assert (dp.solver, search.solver) == ("dynamic program", "Lagrangian search")
            assert spend_of(ranks, search.ks) == spend_of(ranks, dp.ks), (seed, budget)
            assert search.objective == pytest.approx(dp.objective, rel=1e-12, abs=1e-300), (seed, budget)


QWEN7B_SHAPES = {  # module type -> (d_out, d_in, r): Qwen2.5-7B's shapes at three different r
    "self_attn.q_proj": (3584, 3584, 57),
    "self_attn.k_proj": (512, 3584, 28),
    "self_attn.v_proj": (512, 3584, 28),
    "self_attn.o_proj": (3584, 3584, 57),
    "mlp.gate_proj": (18944, 3584, 64),
    "mlp.up_proj": (18944, 3584, 64),
    "mlp.down_proj": (3584, 18944, 64),
}


def qwen7b_case(seed: int = 0):
    """196 modules (28 layers x 7 Qwen2.5-7B types), r 64/57/28, spectra as tests/reports/test_reports.write_fake_bundle
    draws them (min(d_out - r, d_in) decaying eigenvalues, the rest zeros), k = k(tau=0.9) <= 512."""
    gen = torch.Generator().manual_seed(seed)
    curves, ranks, k_max = [], [], []
    for _ in range(28):
        for d_out, d_in, r in QWEN7B_SHAPES.values():
            n = min(d_out - r, d_in)
            decay = torch.rand(1, generator=gen).item() * 8 + 2
            spectrum = torch.exp(-decay * torch.linspace(0, 1, n)) * (1 + torch.rand(1, generator=gen).item())
            spectrum = torch.sort(spectrum, descending=True).values.to(torch.float32)
            curves.append(captured_energy_curve(spectrum, d_in))
            ranks.append(r)
            k_max.append(k_for_tau(spectrum, 0.9, d_in, 512))
    return curves, ranks, k_max


def test_mean_is_exact_on_the_196_module_case():
    """196 modules at k <= 512 with r 64/57/28 (the dynamic program is over its limit): the plan is exact in a few
    seconds; it spends at least the greedy's; at the greedy's spend (budget = what the greedy spent) its mean is no
    larger than the greedy's and no smaller than the fractional lower bound, so its gap is at most the greedy's."""
    curves, ranks, k_max = qwen7b_case()
    lo, cap = sum(ranks), spend_of(ranks, k_max)
    for fraction in (0.02, 0.5, 0.9):
        budget = lo + int(fraction * (cap - lo)) + 13
        start = time.perf_counter()
        found = allocation(curves, ranks, k_max, budget, "mean")
        seconds = time.perf_counter() - start
        assert (found.method, found.solver) == ("exact", "Lagrangian search") and seconds < 20, seconds
        greedy = allocate_greedy(curves, ranks, k_max, budget, "mean")
        spent = spend_of(ranks, greedy)
        assert spent <= spend_of(ranks, found.ks) <= budget
        at_greedy = allocation(curves, ranks, k_max, spent, "mean")
        assert at_greedy.solver == "Lagrangian search" and spend_of(ranks, at_greedy.ks) == spent
        greedy_mean = score(curves, greedy, "mean")
        bound = _lower_bound(curves, ranks, k_max, spent, "mean")
        assert bound - 1e-15 * bound <= at_greedy.objective <= greedy_mean + 1e-15 * greedy_mean


def test_guards_fall_back_to_the_greedy_and_say_which(monkeypatch):
    """When the search would score too many candidates, or its table of reachable spends would be too large, the
    greedy runs, with that reason and a lower bound."""
    curves, ranks, k_max = medium_instance(0, flat=False)
    budget = (sum(ranks) + spend_of(ranks, k_max)) // 2
    monkeypatch.setattr("plate_inspect.plan.MEAN_SEARCH_LIMIT", 0)
    found = allocation(curves, ranks, k_max, budget, "mean", limit=0)
    assert found.method == "greedy" and found.reason.endswith(
        "the exact mean search scored more than 0 candidate allocations"
    )
    assert found.ks == allocate_greedy(curves, ranks, k_max, budget, "mean") and found.lower_bound <= found.objective
    monkeypatch.setattr("plate_inspect.plan.MEAN_SEARCH_LIMIT", 10**7)
    monkeypatch.setattr("plate_inspect.plan.REACH_LIMIT", 10)
    found = allocation(curves, ranks, k_max, budget, "mean", limit=0)
    assert found.method == "greedy" and "table of reachable spends" in found.reason


def test_plan_file_and_text_say_exact_for_mean(three_r_bundle, tmp_path, monkeypatch):
    """With three different r, `plan --objective mean` runs the search and says exact in text and JSON (solver
    "Lagrangian search"); its plan equals the dynamic program's, which runs when the search trips its guard."""
    b = three_r_bundle
    assert len({rec.r for rec in b}) == 3
    monkeypatch.setattr("plate_inspect.plan.MEAN_SEARCH_LIMIT", 0)
    want = plan_budget(b, "5%", "mean").to_json()
    assert want["optimality"]["solver"] == "dynamic program"
    monkeypatch.undo()
    res = CliRunner().invoke(
        cli, ["plan", str(b.path), "--budget", "5%", "--objective", "mean", "-o", str(tmp_path / "p.json")]
    )
    assert res.exit_code == 0, res.output
    assert "optimal: exact" in res.output and "greedy" not in res.output
    got = json.loads((tmp_path / "p.json").read_text())
    assert got["optimality"]["method"] == "exact" and got["optimality"]["solver"] == "Lagrangian search"
    assert got["budget"]["spent"] == want["budget"]["spent"]
    assert got["summary"]["mean_captured_energy"] == pytest.approx(want["summary"]["mean_captured_energy"], rel=1e-12)
