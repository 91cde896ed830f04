"""Plan a trainable-parameter budget from a bundle's spectra: per-module k at the bundle's r, no rescan.

A module's bundle holds the eigenvalues of G = W_f^T W_f (descending; the d_in - len missing ones are exact zeros)
and Q, an orthonormal basis of G's bottom-K eigenspace in ascending energy order (K = the bundle's k). A prefix
Q[:, :k] (k <= K) is a bottom-k eigenspace basis (see :func:`planned_captured_energy`), so a plan only chooses k
per module, and its captured energy is known exactly from the spectrum: c(k) = (sum of the k smallest
eigenvalues) / tr(G). Trainable parameters are r * k per module.

The plan is exact (:func:`allocation`): it spends the most parameters the budget allows (sum r*k, k in [1, bundle
k]), and among the allocations spending that much it has the smallest objective:

- ``minimax`` (default): the largest captured energy over modules. With equal r this is a common protected level
  (a per-module tau equalised across modules: k_i = k_i(tau) at one tau), refined column by column.
- ``mean``: the mean captured energy (each module's increments are its ascending eigenvalues: c(k) is convex).

Within one r the best n columns are the n smallest levels (minimax) or increments (mean), so modules of equal r are
solved in closed form; across different r (effective r capped at 90% of small modules' rows, a router at r = 0
aside) a dynamic program over the spend in units of the gcd of the r's finds the optimum, or, when that program
would be too large (:data:`EXACT_WORK_LIMIT`), for minimax integer feasibility programs over one count per r
(scipy's HiGHS, answers checked in integers); for mean with three or more different r a search certified by a
Lagrangian lower bound (:func:`_mean_counts`) runs before the program. Only when those give no answer within their
guards does the greedy of session 15 run
(:func:`allocate_greedy`: one column at a time, optimal with equal r), and the plan says so, with a lower bound on
the optimum.
"""

from __future__ import annotations

import heapq
import json
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plate_inspect.bundle import Bundle, ModuleRecord
from plate_inspect.errors import ConfigError

PLAN_FORMAT = "plate-plan"
PLAN_VERSION = 1
OBJECTIVES = ("minimax", "mean")


# --------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Budget:
    """A parsed budget: what was asked (``spec``), how (``kind``) and the parameter count it means."""

    spec: str
    kind: str  # absolute | percent | lora
    value: float  # the number in the spec (parameters, percent, or LoRA rank)
    params: int

    def to_json(self) -> dict[str, Any]:
        """The budget as the plan file records it."""
        return {"spec": self.spec, "kind": self.kind, "value": self.value, "params": self.params}


#: The largest absolute budget read (a float's range, as before counts were read exactly): far past any model.
_LARGEST_BUDGET = Decimal(sys.float_info.max)


def parse_budget(spec: str, records: list[ModuleRecord]) -> Budget:
    """'2e6' / '2,000,000' / '2_000_000' (parameters), '1%' (of the target modules' weights sum d_out*d_in),
    'lora:16' or 'as LoRA r=16' (LoRA's sum r*(d_in+d_out) at r=16 on the same modules). Commas group thousands
    only: '1,5e6' (a decimal comma) and '1,00' are refused, not read as 15e6 and 100."""
    text = str(spec).strip()
    low = text.lower().replace(" ", "")
    lora = re.fullmatch(r"(?:as)?lora(?::|=|r=|:r=|,r=|r)?(\d+)", low)  # 'lora:16', 'as LoRA r=16', 'lora 16'
    try:
        if lora:
            rank = int(lora.group(1))
            if rank < 1:
                raise ValueError
            return Budget(text, "lora", float(rank), rank * sum(r.d_in + r.d_out for r in records))
        if low.endswith("%"):
            pct = float(low[:-1])
            if not 0 < pct <= 100:
                raise ValueError
            total = sum(r.d_in * r.d_out for r in records)
            return Budget(text, "percent", pct, int(math.floor(pct / 100 * total)))
        if "," in low and not re.fullmatch(r"[0-9]{1,3}(,[0-9]{3})+", low):  # '1,5e6' is 1.5e6 in many locales
            raise ValueError
        # read as a decimal, so a count past 2^53 is the count written ('123456789012345678' was ...680 as a float)
        value = Decimal(low.replace(",", ""))
        if not (value.is_finite() and 1 <= value <= _LARGEST_BUDGET and value == value.to_integral_value()):
            raise ValueError  # a count: 2e6 yes, 1.5 no
        return Budget(text, "absolute", float(value), int(value))
    except (ValueError, InvalidOperation):
        raise ConfigError(
            f"--budget '{spec}': not a budget; use a whole parameter count ('2e6'), a percentage of the target weights "
            "('1%', in (0, 100]), or a LoRA-equivalent rank ('lora:16' or 'as LoRA r=16')"
        ) from None


# --------------------------------------------------------------------------- captured energy from a spectrum
def captured_energy_curve(spectrum: torch.Tensor, d_in: int) -> torch.Tensor:
    """c(k) for k = 0..d_in, float64: the k smallest eigenvalues of G (zeros included) over tr(G).

    ``spectrum`` is the bundle's (descending, length min(n_frozen, d_in)); G's other d_in - len eigenvalues are 0.
    An all-zero G captures nothing: c = 0.
    """
    lam = spectrum.detach().to("cpu", torch.float64).clamp_min(0).flip(0)  # ascending
    full = torch.cat([torch.zeros(d_in - lam.numel(), dtype=torch.float64), lam])
    total = float(full.sum())
    curve = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(full, 0)])
    return curve / total if total > 0 else torch.zeros_like(curve)


def planned_captured_energy(spectrum: torch.Tensor, d_in: int, k: int) -> float:
    """Captured energy tr(Q_k^T G Q_k)/tr(G) of the prefix Q[:, :k], from the spectrum alone.

    Q's columns are eigenvectors in ascending energy (tall W_f: eigh's bottom eigenvectors in order; wide W_f: an
    orthonormal basis of the null space first, then the smallest nonzero eigenvectors ascending, orthonormalised
    in column order). A prefix is therefore a bottom-k eigenspace: inside the null space any orthonormal
    directions have eigenvalue 0, so any prefix of a null-space basis is a bottom eigenspace basis.
    """
    return float(captured_energy_curve(spectrum, d_in)[k])


def protected_tau(curve: torch.Tensor, k: int) -> float:
    """1 - c(k): the protected energy fraction; the largest tau with k(tau) >= k (before the max_rank cap)."""
    return 1.0 - float(curve[k])


# --------------------------------------------------------------------------- allocation
#: Most (frontier states x choices) the dynamic program may enumerate in one step before integer programs run.
EXACT_WORK_LIMIT = 20_000_000


@dataclass(frozen=True)
class Allocation:
    """Per-module k and how it was found: ``exact`` (the optimum: the largest spend within the budget, then the
    smallest objective among allocations spending that much; ``solver``) or ``greedy`` (no exact answer: ``reason``),
    with ``lower_bound``: no allocation spending at least as much has a smaller objective."""

    ks: list[int]
    method: str  # "exact" | "greedy"
    objective: float  # max (minimax) or mean (mean) captured energy over all modules
    reason: str = ""
    lower_bound: float | None = None
    solver: str = ""  # exact: "closed form" (one r), "dynamic program" or "integer program"

    def to_json(self) -> dict[str, Any]:
        """How the allocation was found, as the plan file's ``optimality`` (solver, or greedy's reason and bound)."""
        out: dict[str, Any] = {"method": self.method, "objective": self.objective}
        if self.method == "exact":
            out["solver"] = self.solver
        if self.method == "greedy":
            gap = None if self.lower_bound is None else self.objective - self.lower_bound
            out.update(reason=self.reason, lower_bound=self.lower_bound, gap=gap)
        return out


def objective_value(curves: list[torch.Tensor], ks: list[int], objective: str) -> float:
    """The plan's objective: the largest (minimax) or the mean (mean) captured energy c_i(k_i) over modules."""
    levels = [float(c[k]) for c, k in zip(curves, ks, strict=True)]
    return max(levels) if objective == "minimax" else sum(levels) / len(levels)


def _check(curves: list[torch.Tensor], ranks: list[int], budget: int, objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if sum(ranks) > budget:
        raise ConfigError(
            f"budget of {budget:,} parameters is below the minimum {sum(ranks):,} (k=1 in every module: sum of r); "
            "raise the budget or scan with a smaller r"
        )


def allocate_greedy(
    curves: list[torch.Tensor], ranks: list[int], k_max: list[int], budget: int, objective: str = "minimax"
) -> list[int]:
    """Per-module k in [1, k_max] with sum r*k <= budget, one column at a time (the module docstring's rules): the
    optimum when every r is equal, a heuristic otherwise. A module with r = 0 (it trains nothing) stays at k = 1."""
    _check(curves, ranks, budget, objective)
    ks = [1] * len(curves)
    spent = sum(ranks)

    def key(i: int) -> float:
        k, c = ks[i], curves[i]
        return float(c[k + 1]) if objective == "minimax" else float(c[k + 1] - c[k]) / ranks[i]

    # r = 0 (a one-row gate: nothing to train) keeps k = 1: its columns cost nothing and would price nothing
    heap = [(key(i), i) for i in range(len(curves)) if ks[i] < k_max[i] and ranks[i] > 0]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        if spent + ranks[i] > budget:
            continue  # this module no longer fits; the remaining budget only shrinks
        ks[i] += 1
        spent += ranks[i]
        if ks[i] < k_max[i]:
            heapq.heappush(heap, (key(i), i))
    return ks


@dataclass
class _RankGroup:
    """Modules of one r: their extra columns (k = 2..k_max) as items in the order a count n of them is best taken,
    and f[n], the group's objective with its n best items (max or sum of its modules' c)."""

    rank: int
    owners: np.ndarray  # module index of each item, best first
    f: np.ndarray  # [count + 1]
    values: np.ndarray  # [count]: each item's level (minimax) or increment (mean), ascending


def _rank_groups(curves: list[torch.Tensor], ranks: list[int], k_max: list[int], objective: str) -> list[_RankGroup]:
    """Within one r the n best extra columns are exact and nest: minimax takes the n smallest levels c_i(k) (each
    module's levels rise with k, so they are prefixes), mean the n smallest increments c_i(k) - c_i(k-1) (each
    module's increments are its ascending eigenvalues: prefixes again)."""
    groups = []
    for rank in sorted({r for r, m in zip(ranks, k_max, strict=True) if r > 0 and m > 1}):
        members = [i for i in range(len(curves)) if ranks[i] == rank and k_max[i] > 1]
        values, owners, order_k = [], [], []
        for i in members:
            c = curves[i].numpy()
            ks = np.arange(2, k_max[i] + 1)
            values.append(c[ks] if objective == "minimax" else c[ks] - c[ks - 1])
            owners.append(np.full(ks.size, i))
            order_k.append(ks)
        value, owner, k = (np.concatenate(a) for a in (values, owners, order_k))
        order = np.lexsort((k, owner, value))  # ascending value; ties by module, then k (keeps prefixes)
        base = [float(curves[i][1]) for i in members]
        if objective == "minimax":
            f = np.maximum(max(base), np.concatenate([[-np.inf], value[order]]))
        else:
            f = sum(base) + np.concatenate([[0.0], np.cumsum(value[order])])
        groups.append(_RankGroup(rank, owner[order], f, value[order]))
    return groups


def _exact_counts(groups: list[_RankGroup], units: int, unit: int, objective: str, limit: int) -> list[int] | None:
    """How many extra columns each r-group takes: the largest spend <= units * unit, then the best objective at it.

    A dynamic program over the spend (in units of the gcd of the r's) across groups: the states are the distinct
    spends of the first groups (each with its best objective and how it was reached), the last group is closed
    form. None when a step would enumerate more than ``limit`` (state, choice) pairs, found before any step runs
    from a bound on each step's states (distinct spends: at most the product of the earlier groups' count choices,
    their summed spend, or the budget, plus 1), so a program too large costs nothing."""
    states, reach = 1, 0
    for group in groups[:-1]:
        if states * group.f.size > limit:
            return None
        reach += (group.rank // unit) * (group.f.size - 1)
        states = min(states * group.f.size, reach + 1, units + 1)
    combine = np.maximum if objective == "minimax" else np.add
    spend = np.zeros(1, dtype=np.int64)
    value = np.array([-np.inf if objective == "minimax" else 0.0])
    steps: list[tuple[np.ndarray, np.ndarray]] = []
    for group in groups[:-1]:
        n = np.arange(group.f.size, dtype=np.int64)
        if spend.size * n.size > limit:
            return None
        cand_spend = (spend[:, None] + n[None, :] * (group.rank // unit)).ravel()
        cand_value = combine(value[:, None], group.f[None, :]).ravel()
        parent = np.repeat(np.arange(spend.size), n.size)
        taken = np.tile(n, spend.size)
        fits = cand_spend <= units
        cand_spend, cand_value, parent, taken = cand_spend[fits], cand_value[fits], parent[fits], taken[fits]
        order = np.lexsort((cand_value, cand_spend))  # by spend, then objective (stable: first reached wins ties)
        cand_spend, cand_value, parent, taken = (a[order] for a in (cand_spend, cand_value, parent, taken))
        first = np.ones(cand_spend.size, dtype=bool)
        first[1:] = cand_spend[1:] != cand_spend[:-1]
        spend, value = cand_spend[first], cand_value[first]
        steps.append((parent[first], taken[first]))
    last = groups[-1]
    weight = last.rank // unit
    n_last = np.minimum(last.f.size - 1, (units - spend) // weight)
    total = spend + n_last * weight
    best = np.nonzero(total == total.max())[0]
    j = int(best[np.argmin(combine(value[best], last.f[n_last[best]]))])
    counts = [int(n_last[j])]
    for parent, taken in reversed(steps):
        counts.append(int(taken[j]))
        j = int(parent[j])
    return counts[::-1]


def _milp_counts(groups: list[_RankGroup], units: int, unit: int) -> list[int] | None:
    """Minimax's optimum as integer programs (scipy's HiGHS) over one integer per r-group (its count of extra
    columns), for a program too large to enumerate: the largest spend, then the smallest level at which the
    groups' columns up to it can spend exactly that (a feasibility program per level, bisected). Feasibility only,
    checked in integers, so the solver's tolerances never decide between captured energies (for the mean objective
    they would: its costs are far below HiGHS's tolerances, so mean has no such path). None when a check fails."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    g = len(groups)
    w = np.array([grp.rank // unit for grp in groups], dtype=np.int64)
    row = w[None, :].astype(float)
    cap = np.array([grp.f.size - 1 for grp in groups], dtype=np.int64)
    exact = {"mip_rel_gap": 0.0}

    def counts(res: Any, upper: np.ndarray) -> np.ndarray | None:
        if not res.success or res.x is None:
            return None
        n = np.round(res.x).astype(np.int64)
        return n if bool(((n >= 0) & (n <= upper)).all()) and int(w @ n) <= units else None

    most = counts(
        milp(
            -w.astype(float),
            integrality=np.ones(g),
            bounds=Bounds(0, cap),
            constraints=LinearConstraint(row, 0, units),
            options=exact,
        ),
        cap,
    )
    if most is None:
        return None
    spend = int(w @ most)

    def feasible(level: float) -> np.ndarray | None:
        upper = np.array([np.searchsorted(grp.f, level, side="right") - 1 for grp in groups], dtype=np.int64)
        if bool((upper < 0).any()):
            return None
        res = milp(
            np.zeros(g),
            integrality=np.ones(g),
            bounds=Bounds(0, upper),
            constraints=LinearConstraint(row, spend, spend),
            options=exact,
        )
        n = counts(res, upper)
        return n if n is not None and int(w @ n) == spend else None

    levels = np.unique(np.concatenate([grp.f for grp in groups]))
    lo, hi, found = 0, levels.size - 1, feasible(float(levels[-1]))
    if found is None:
        return None
    while lo < hi:  # the smallest feasible level (feasibility only grows with the level)
        mid = (lo + hi) // 2
        n = feasible(float(levels[mid]))
        if n is None:
            lo = mid + 1
        else:
            hi, found = mid, n
    return [int(v) for v in found]


#: Most candidate allocations the exact mean search (:func:`_mean_counts`) may score, and the most entries (spends in
#: units of the gcd of the r's, times r-groups) its table of reachable spends may hold; past either the dynamic
#: program runs if it fits, else the greedy.
MEAN_SEARCH_LIMIT = 10_000_000
REACH_LIMIT = 50_000_000


def _top_reachable_spend(weights: list[int], caps: list[int], units: int) -> int:
    """The largest s <= units with s = sum w_g n_g for some integers 0 <= n_g <= cap_g: a table of reachable spends,
    one group at a time (a spend is reachable with group g if one of s, s - w_g, ..., s - cap_g*w_g was without it:
    a sliding window over each residue class mod w_g)."""
    reach = np.zeros(units + 1, dtype=bool)
    reach[0] = True
    for w, cap in zip(weights, caps, strict=True):
        rows = -(-(units + 1) // w)
        table = np.zeros(rows * w, dtype=np.int32)
        table[: units + 1] = reach
        seen = np.cumsum(table.reshape(rows, w), axis=0, dtype=np.int32)  # row q, column s mod w: spend q*w + col
        window = seen.copy()
        if cap + 1 < rows:
            window[cap + 1 :] -= seen[: rows - cap - 1]
        reach = (window > 0).ravel()[: units + 1]
    return int(np.flatnonzero(reach)[-1])


def _pair_best(
    ea: np.ndarray, eb: np.ndarray, wa: int, wb: int, spend: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each spend T: min ea[na] + eb[nb] over integers with wa*na + wb*nb = T, 0 <= na < len(ea), 0 <= nb <
    len(eb) (inf where there is none), and the minimiser. The solutions lie on a line, na = na0 + t*wb/g, nb = nb0 -
    t*wa/g (g = gcd), along which the sum of two convex sequences is convex in t: a bisection on its slope."""
    g = math.gcd(wa, wb)
    a, b = wa // g, wb // g
    whole = (spend >= 0) & (spend % g == 0)
    tp = np.where(whole, spend, 0) // g
    na0 = (tp % b) * (pow(a, -1, b) if b > 1 else 0) % b
    nb0 = (tp - a * na0) // b
    lo = np.maximum(0, -((eb.size - 1 - nb0) // a))  # nb <= len(eb) - 1
    hi = np.minimum((ea.size - 1 - na0) // b, nb0 // a)  # na <= len(ea) - 1, nb >= 0
    ok = whole & (lo <= hi)
    lo, hi = np.where(ok, lo, 0), np.where(ok, hi, 0)
    na0, nb0 = np.where(ok, na0, 0), np.where(ok, nb0, 0)

    def phi(t: np.ndarray) -> np.ndarray:
        return ea[na0 + t * b] + eb[nb0 - t * a]

    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        active = lo < hi
        up = np.where(active, phi(np.where(active, mid + 1, lo)) >= phi(np.where(active, mid, lo)), False)
        hi = np.where(active & up, mid, hi)
        lo = np.where(active & ~up, mid + 1, lo)
    na, nb = na0 + lo * b, nb0 - lo * a
    return np.where(ok, phi(lo), np.inf), na, nb


def _mean_counts(groups: list[_RankGroup], units: int, unit: int, limit: int) -> tuple[list[int] | None, str]:
    """The mean objective's optimum (the largest spend <= units * unit, then the smallest sum of the groups' f at
    it) with a certificate, for three or more r-groups (or a program too large); (None, why) when a guard trips.

    The spend: :func:`_top_reachable_spend`. At that spend S, for any multiplier mu, h_g(n) = f_g(n) - mu*w_g*n
    gives sum_g f_g(n_g) = mu*S + sum_g h_g(n_g) on every allocation spending S; each h_g is convex (f_g's
    increments ascend), so with n_g* its minimiser and e_g = h_g - h_g(n_g*) >= 0, an allocation's objective is the
    Lagrangian lower bound mu*S + sum_g h_g(n_g*) plus sum_g e_g(n_g). mu is the continuous relaxation's marginal
    price (its bound is the best one). The search: every count of the other groups whose excesses sum to at most a
    threshold, the two groups with the most counts near their optimum solved exactly for the rest of the spend
    (:func:`_pair_best`); the best allocation found with excess <= the threshold is optimal (any better one has a
    smaller excess, so it was scored). The threshold starts at the excess of moving max(w) columns per group and
    grows x16 until an allocation is found. Compared in float64 with a tolerance of 32 ulps of the objective's terms
    (the dynamic program compares the same float64 sums). ``limit`` caps the candidates scored."""
    weights = [grp.rank // unit for grp in groups]
    caps = [grp.f.size - 1 for grp in groups]
    if (units + 1) * len(groups) > REACH_LIMIT:
        return (
            None,
            f"its table of reachable spends would hold {(units + 1) * len(groups):,} entries (> {REACH_LIMIT:,})",
        )
    spend = _top_reachable_spend(weights, caps, units)
    ratio = np.concatenate([grp.values / w for grp, w in zip(groups, weights, strict=True)])
    cost = np.concatenate([np.full(grp.values.size, w) for grp, w in zip(groups, weights, strict=True)])
    order = np.argsort(ratio, kind="stable")  # ties in group order: each group's taken columns are a prefix
    filled = int(np.searchsorted(np.cumsum(cost[order]), spend))  # the column the relaxation takes in part
    mu = float(ratio[order[min(filled, order.size - 1)]]) if spend > 0 else 0.0
    owner = np.concatenate([np.full(grp.values.size, g) for g, grp in enumerate(groups)])
    best_n = np.bincount(owner[order[:filled]], minlength=len(groups)).tolist()  # the relaxation's whole columns
    excess = []
    for grp, w, n_star in zip(groups, weights, best_n, strict=True):
        h = grp.f - mu * w * np.arange(grp.f.size)  # minimal at n_star: columns priced <= mu before it, >= mu after
        excess.append(h - h[n_star])
    tol = (
        32
        * np.finfo(float).eps
        * sum(float(np.abs(grp.f).max()) + abs(mu) * w * cap for grp, w, cap in zip(groups, weights, caps, strict=True))
    )
    if len(groups) == 1:
        return [spend // weights[0]], ""
    threshold = sum(
        float(e[min(n + max(weights), e.size - 1)] + e[max(n - max(weights), 0)])
        for e, n in zip(excess, best_n, strict=True)
    )
    # the pair solved on its line: the two groups that can move furthest both ways from the relaxation's counts
    # within the threshold (flat excess: ties at mu, e.g. null-space columns at mu = 0); of the rest, the widest is
    # scored in one vectorised step, the others looped over
    near = [np.flatnonzero(e <= threshold + tol) for e in excess]  # an interval around best_n (e is convex)
    both_ways = [min(n - int(x.min()), int(x.max()) - n) for x, n in zip(near, best_n, strict=True)]
    by_freedom = sorted(range(len(groups)), key=lambda g: (both_ways[g], near[g].size))
    ia, ib = by_freedom[-2:]
    outer = sorted(by_freedom[:-2], key=lambda g: near[g].size)
    # what the groups after each outer level can spend: a multiple of their gcd, at most their capacity
    after = [[*outer[level + 1 :], ia, ib] for level in range(len(outer))]
    step = [math.gcd(*(weights[g] for g in rest)) for rest in after]
    room = [sum(weights[g] * caps[g] for g in rest) for rest in after]
    work = 0
    found: tuple[float, list[int]] | None = None

    def search(level: int, rest: int, partial: float, counts: list[int], threshold: float) -> bool:
        """Score the allocations extending ``counts`` (the first ``level`` outer groups); False when over the limit."""
        nonlocal work, found
        if found is not None and found[0] <= tol:
            return True  # at the lower bound (every allocation's excess is >= 0): nothing is better
        bound = min(threshold, found[0] if found else np.inf) + tol - partial
        g = outer[level]
        e = excess[g]
        xs = np.flatnonzero(e[: min(caps[g], rest // weights[g]) + 1] <= bound)
        left = rest - xs * weights[g]
        xs = xs[(left % step[level] == 0) & (left <= room[level])]  # the later groups can spend what is left
        if level < len(outer) - 1:
            # smallest excess first, ties (flat excess) nearest the relaxation's count: good allocations early
            for x in xs[np.lexsort((np.abs(xs - best_n[g]), e[xs]))]:
                if partial + e[x] > min(threshold, found[0] if found else np.inf) + tol or (found and found[0] <= tol):
                    break
                if not search(
                    level + 1, rest - int(x) * weights[g], partial + float(e[x]), [*counts, int(x)], threshold
                ):
                    return False
            return True
        work += xs.size + 64  # a call costs about as much as scoring 64 candidates
        if work > limit:
            return False
        value, na, nb = _pair_best(excess[ia], excess[ib], weights[ia], weights[ib], rest - xs * weights[g])
        total = partial + e[xs] + value
        if xs.size and np.isfinite(total).any():
            j = int(np.argmin(total))
            if found is None or total[j] < found[0]:
                found = (float(total[j]), [*counts, int(xs[j]), int(na[j]), int(nb[j])])
        return True

    while True:
        if outer:
            if not search(0, spend, 0.0, [], threshold):
                return None, f"the exact mean search scored more than {limit:,} candidate allocations"
        else:
            value, na, nb = _pair_best(excess[ia], excess[ib], weights[ia], weights[ib], np.array([spend]))
            if np.isfinite(value[0]):
                found = (float(value[0]), [int(na[0]), int(nb[0])])
        if found is not None and found[0] <= threshold + tol:
            break
        if not np.isfinite(threshold):
            return None, "the exact mean search found no allocation at the reachable spend"  # not expected
        threshold = (
            threshold * 16
            if threshold > 0
            else min((float(e[e > tol].min()) for e in excess if (e > tol).any()), default=np.inf)
        )
    counts = [0] * len(groups)
    for g, n in zip([*outer, ia, ib], found[1], strict=True):
        counts[g] = n
    return counts, ""


def _lower_bound(curves: list[torch.Tensor], ranks: list[int], k_max: list[int], spent: int, objective: str) -> float:
    """No allocation spending >= ``spent`` has a smaller objective. minimax: the smallest level lambda whose
    columns at or below it (every module up to its largest k with c(k) <= lambda) hold ``spent`` parameters;
    mean: the fractional relaxation (cheapest captured energy per parameter first, the last column in part)."""
    n = len(curves)
    base = [float(c[1]) for c in curves]
    need = spent - sum(ranks)
    cols = [(i, k) for i in range(n) if ranks[i] > 0 for k in range(2, k_max[i] + 1)]
    if objective == "minimax":
        bound = max(base)
        for level, i in sorted((float(curves[i][k]), i) for i, k in cols):
            if need <= 0:
                break
            need -= ranks[i]
            bound = max(bound, level)
        return bound
    total = sum(base)
    for ratio, i in sorted((float(curves[i][k] - curves[i][k - 1]) / ranks[i], i) for i, k in cols):
        if need <= 0:
            break
        take = min(ranks[i], need)
        total += ratio * take
        need -= take
    return total / n


def allocation(
    curves: list[torch.Tensor],
    ranks: list[int],
    k_max: list[int],
    budget: int,
    objective: str = "minimax",
    limit: int | None = None,
    large_solvers: bool = True,
) -> Allocation:
    """Per-module k in [1, k_max] with sum r*k <= budget: exactly optimal (the most parameters the budget allows,
    then the smallest objective among allocations spending that much). Modules of one r in closed form; across r
    a dynamic program over the spend (:func:`_exact_counts`), or, when that would enumerate more than ``limit``
    (default :data:`EXACT_WORK_LIMIT`), integer programs for minimax (:func:`_milp_counts`). For mean with three or
    more different r a search certified by a Lagrangian bound (:func:`_mean_counts`) runs first (faster than the
    program there), the program if it trips its guard. ``large_solvers=False`` skips the integer programs and the
    search; the greedy with a lower bound when none gives a checked answer. A module with r = 0 (it trains nothing)
    stays at k = 1."""
    _check(curves, ranks, budget, objective)
    limit = EXACT_WORK_LIMIT if limit is None else limit
    groups = sorted(_rank_groups(curves, ranks, k_max, objective), key=lambda g: g.f.size)  # largest: closed form
    ks = [1] * len(curves)
    counts: list[int] | None = []
    solver = "closed form" if len(groups) <= 1 else "dynamic program"
    why = ""
    if len(groups) > 0:
        unit = math.gcd(*(g.rank for g in groups))
        capacity = sum(g.rank * (g.f.size - 1) for g in groups)
        units = min(budget - sum(ranks), capacity) // unit
        search_first = objective == "mean" and large_solvers and len(groups) >= 3  # faster than the program there
        counts = None
        if search_first:
            counts, why = _mean_counts(groups, units, unit, MEAN_SEARCH_LIMIT)
            solver, why = "Lagrangian search", f", and {why}"
        if counts is None:
            counts = _exact_counts(groups, units, unit, objective, limit)
            solver = "closed form" if len(groups) <= 1 else "dynamic program"
        if counts is None and large_solvers and objective == "minimax":
            counts, solver = _milp_counts(groups, units, unit), "integer program"
            why = ", and the integer programs gave no checked answer"
        if counts is None and large_solvers and objective == "mean" and not search_first:
            counts, why = _mean_counts(groups, units, unit, MEAN_SEARCH_LIMIT)
            solver, why = "Lagrangian search", f", and {why}"
    if counts is None:
        ks = allocate_greedy(curves, ranks, k_max, budget, objective)
        spent = sum(r * k for r, k in zip(ranks, ks, strict=True))
        reason = (
            f"the exact program over {len(groups)} different r ({', '.join(str(g.rank) for g in groups)}) exceeds "
            f"{limit:,} states x choices{why}"
        )
        value = objective_value(curves, ks, objective)
        bound = min(_lower_bound(curves, ranks, k_max, spent, objective), value)  # summation order: a 1e-21 excess
        return Allocation(ks, "greedy", value, reason, bound)
    for group, count in zip(groups, counts, strict=True):
        for i in group.owners[:count]:
            ks[int(i)] += 1
    return Allocation(ks, "exact", objective_value(curves, ks, objective), solver=solver)


def allocate(
    curves: list[torch.Tensor], ranks: list[int], k_max: list[int], budget: int, objective: str = "minimax"
) -> list[int]:
    """The k of :func:`allocation` (exact when the program fits, else greedy)."""
    return allocation(curves, ranks, k_max, budget, objective).ks


# --------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    """A budget plan: per-module k, tau, captured energy; ``to_json`` is the plan file (format plate-plan v1)."""

    bundle_identity: str
    bundle_path: str
    objective: str
    budget: Budget
    modules: dict[str, dict[str, Any]]
    optimality: dict[str, Any] | None = None  # Allocation.to_json(): exact, or greedy with its bound

    def __repr__(self) -> str:
        """One line, whatever the module count (the dataclass repr printed every module's dict: megabytes for a
        15k-module bundle in a notebook cell); the modules are in ``modules``, the whole plan in ``to_json()``."""
        method = (self.optimality or {}).get("method", "unknown")
        energy = f"max_captured_energy={self.max_captured_energy:.3e}, " if self.modules else ""  # max() of nothing
        return (
            f"Plan({self.bundle_path!r}, objective={self.objective!r}, budget={self.budget.spec!r} "
            f"({self.budget.params:,} parameters), spent={self.spent:,}, modules={len(self.modules)}, {energy}{method})"
        )

    @property
    def spent(self) -> int:
        """Trainable parameters the plan spends: the sum of its modules' ``params``."""
        return sum(m["params"] for m in self.modules.values())

    @property
    def max_captured_energy(self) -> float:
        """The largest captured energy tr(Q^T G Q) / tr(G) among the plan's modules."""
        return max(m["captured_energy"] for m in self.modules.values())

    @property
    def mean_captured_energy(self) -> float:
        """The mean captured energy over the plan's modules."""
        return sum(m["captured_energy"] for m in self.modules.values()) / len(self.modules)

    def to_json(self) -> dict[str, Any]:
        """The plan file (format plate-plan v1): bundle identity, budget, objective and per-module k."""
        capacity = sum(m["r"] * m["bundle_k"] for m in self.modules.values())
        return {
            "format": PLAN_FORMAT,
            "format_version": PLAN_VERSION,
            "bundle": {"identity": self.bundle_identity, "path": self.bundle_path},
            "objective": self.objective,
            "budget": {
                **self.budget.to_json(),
                "spent": self.spent,
                "capacity": capacity,  # sum r * (bundle k): the most the bundle's Q columns allow
                "limited_by_bundle": self.spent == capacity and capacity < self.budget.params,
            },
            "summary": {
                "max_captured_energy": self.max_captured_energy,
                "mean_captured_energy": self.mean_captured_energy,
            },
            **({"optimality": self.optimality} if self.optimality is not None else {}),
            "modules": self.modules,
        }


def plan_budget(bundle: Bundle | str | os.PathLike, budget: str | int, objective: str = "minimax") -> Plan:
    """Choose k per module for ``budget`` (a spec string or a parameter count) from the bundle's spectra."""
    from plate_inspect.atomic import path_argument

    if isinstance(budget, bool) or not isinstance(budget, (str, numbers.Real)):  # None was read as the spec 'None'
        raise ConfigError(
            f"budget must be a string such as '1%', 'lora:16' or '2e6', or a whole parameter count, got {budget!r:.80}"
        )
    b = bundle if isinstance(bundle, Bundle) else Bundle.load(path_argument(bundle, "bundle"))
    refuse_ablation_bundle(b)
    records = list(b)
    parsed = parse_budget(str(budget), records)
    curves = [captured_energy_curve(b.spectrum(rec.name), rec.d_in) for rec in records]
    ranks = [rec.r for rec in records]
    found = allocation(curves, ranks, [rec.k for rec in records], parsed.params, objective)
    ks = found.ks
    modules = {}
    for rec, curve, k in zip(records, curves, ks, strict=True):
        modules[rec.name] = {
            "k": int(k),
            "tau": protected_tau(curve, k),
            "captured_energy": float(curve[k]),
            "r": rec.r,
            "params": rec.r * int(k),
            "bundle_k": rec.k,
            "d_in": rec.d_in,
            "d_out": rec.d_out,
        }
    identity = b.manifest.identity or b.manifest.source_signature  # content identity; layout-only for old bundles
    return Plan(identity, str(Path(b.path).resolve()), objective, parsed, modules, found.to_json())


def refuse_ablation_bundle(b: Bundle) -> None:
    """An ablation bundle's (Random-B, Random-Q, ...) Q is not the bottom eigenspace of its own W_frozen (another
    B, or another Q): c(k) from the spectrum would not be what Q[:, :k] captures (0.005 planned vs 0.06-0.996
    measured on a test model), so it is not planned."""
    variant = b.manifest.variant
    if variant:
        kind = variant.get("kind", "an ablation") if isinstance(variant, dict) else str(variant)
        raise ConfigError(
            f"{b.path}: is a {kind} ablation bundle; its Q is not the bottom eigenspace of its frozen rows, so the "
            "stored spectrum does not give what Q[:, :k] captures and no k can be planned from it; plan the PLATE "
            "bundle it was made from (plate-inspect plan <that bundle>)"
        )


def _holds_a_plan(path: Path) -> bool:
    """Whether an existing file is a plan JSON (an earlier plan, which -o may replace)."""
    from plate_inspect.errors import json_file_holds

    return json_file_holds(path, lambda v: isinstance(v, dict) and v.get("format") == PLAN_FORMAT)


def write_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Write the plan JSON (atomically); ConfigError naming the path when it cannot be written."""
    from plate_inspect.atomic import atomic_write, make_dirs, os_error_reason
    from plate_inspect.errors import refuse_to_replace

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give a file name, e.g. -o {path / 'plan.json'}")
    refuse_to_replace(path, _holds_a_plan, "a plan JSON", "the plan", "-o", "plan.json")  # weights, a manifest
    make_dirs(path.parent, "the plan's directory", "-o")
    try:
        atomic_write(path, json.dumps(plan.to_json(), indent=2) + "\n")
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the plan ({os_error_reason(path, e)}); choose another -o") from None
    return path
