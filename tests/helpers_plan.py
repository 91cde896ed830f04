"""Brute-force oracles of the budget plan, for the plan tests: captured-energy curves computed by their definition
and every allocation of a small bundle tried."""

from __future__ import annotations

import itertools

import torch


def curve(eigenvalues: list[float]) -> torch.Tensor:
    """c(k) for k = 0..d_in from ascending eigenvalues, float64 (the oracle's own cumulative sum)."""
    lam = torch.tensor(eigenvalues, dtype=torch.float64)
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(lam, 0)]) / lam.sum()


def every_allocation(ranks, k_max):
    """Every per-module k (k = 1 where r = 0)."""
    return itertools.product(*[range(1, m + 1) if r > 0 else [1] for r, m in zip(ranks, k_max, strict=True)])


def brute_force(curves, ranks, k_max, budget, objective):
    """Every allocation: the largest spend within the budget, and the smallest objective at that spend."""
    best = None
    for ks in every_allocation(ranks, k_max):
        spend = sum(r * k for r, k in zip(ranks, ks, strict=True))
        if spend > budget:
            continue
        levels = [float(c[k]) for c, k in zip(curves, ks, strict=True)]
        value = max(levels) if objective == "minimax" else sum(levels) / len(levels)
        if best is None or (spend, -value) > (best[0], -best[1]):
            best = (spend, value)
    return best


def score(curves, ks, objective):
    """The objective of one allocation: the largest (minimax) or the mean curve level at its k."""
    levels = [float(c[k]) for c, k in zip(curves, ks, strict=True)]
    return max(levels) if objective == "minimax" else sum(levels) / len(levels)
