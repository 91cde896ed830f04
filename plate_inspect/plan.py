"""Plan a trainable-parameter budget from a bundle's spectra: per-module k at the bundle's r, no rescan.

A module's bundle holds the eigenvalues of G = W_f^T W_f (descending; the d_in - len missing ones are exact zeros)
and Q, an orthonormal basis of G's bottom-K eigenspace in ascending energy order (K = the bundle's k). A prefix
Q[:, :k] (k <= K) is a bottom-k eigenspace basis (see :func:`planned_captured_energy`), so a plan only chooses k
per module, and its captured energy is known exactly from the spectrum: c(k) = (sum of the k smallest
eigenvalues) / tr(G). Trainable parameters are r * k per module.

Objectives (both spend the budget greedily, one column of Q at a time, until no module can take another within it):

- ``minimax`` (default): next column to the module whose captured energy after it is smallest. With equal r this
  minimises the largest captured energy over modules among all allocations of the same size: it is a common
  protected level (a per-module tau equalised across modules: k_i = k_i(tau) at one tau), refined column by column.
- ``mean``: next column where it adds the least captured energy per parameter. With equal r this minimises the
  mean captured energy (the increments are the ascending eigenvalues, so each module's c(k) is convex).

With unequal r (effective r capped at 90% of small modules' rows) the greedy skips columns that no longer fit.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        return {"spec": self.spec, "kind": self.kind, "value": self.value, "params": self.params}


def parse_budget(spec: str, records: list[ModuleRecord]) -> Budget:
    """'2e6' / '2,000,000' (parameters), '1%' (of the target modules' weights sum d_out*d_in), 'lora:16' or
    'as LoRA r=16' (LoRA's sum r*(d_in+d_out) at r=16 on the same modules)."""
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
        value = float(low.replace(",", "").replace("_", ""))
        if not (value >= 1 and math.isfinite(value) and value == int(value)):  # a count: 2e6 yes, 1.5 no
            raise ValueError
        return Budget(text, "absolute", value, int(value))
    except ValueError:
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
def allocate(
    curves: list[torch.Tensor], ranks: list[int], k_max: list[int], budget: int, objective: str = "minimax"
) -> list[int]:
    """Per-module k in [1, k_max] with sum r*k <= budget, greedily by the objective (see the module docstring);
    a module with r = 0 (it trains nothing) stays at k = 1."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    ks = [1] * len(curves)
    spent = sum(ranks)
    if spent > budget:
        raise ConfigError(
            f"budget of {budget:,} parameters is below the minimum {spent:,} (k=1 in every module: sum of r); "
            "raise the budget or scan with a smaller r"
        )

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


# --------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    """A budget plan: per-module k, tau, captured energy; ``to_json`` is the plan file (format plate-plan v1)."""

    bundle_identity: str
    bundle_path: str
    objective: str
    budget: Budget
    modules: dict[str, dict[str, Any]]

    @property
    def spent(self) -> int:
        return sum(m["params"] for m in self.modules.values())

    @property
    def max_captured_energy(self) -> float:
        return max(m["captured_energy"] for m in self.modules.values())

    @property
    def mean_captured_energy(self) -> float:
        return sum(m["captured_energy"] for m in self.modules.values()) / len(self.modules)

    def to_json(self) -> dict[str, Any]:
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
            "modules": self.modules,
        }


def plan_budget(bundle: Bundle | str | os.PathLike, budget: str | int, objective: str = "minimax") -> Plan:
    """Choose k per module for ``budget`` (a spec string or a parameter count) from the bundle's spectra."""
    b = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
    refuse_ablation_bundle(b)
    records = list(b)
    parsed = parse_budget(str(budget), records)
    curves = [captured_energy_curve(b.spectrum(rec.name), rec.d_in) for rec in records]
    ranks = [rec.r for rec in records]
    ks = allocate(curves, ranks, [rec.k for rec in records], parsed.params, objective)
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
    return Plan(identity, str(Path(b.path).resolve()), objective, parsed, modules)


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


def write_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Write the plan JSON (atomically); ConfigError naming the path when it cannot be written."""
    from plate_inspect.atomic import atomic_write, make_dirs, os_error_reason

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give a file name, e.g. -o {path / 'plan.json'}")
    make_dirs(path.parent, "the plan's directory", "-o")
    try:
        atomic_write(path, json.dumps(plan.to_json(), indent=2) + "\n")
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the plan ({os_error_reason(path, e)}); choose another -o") from None
    return path
