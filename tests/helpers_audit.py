"""The audit's scores by their definitions, densely in float64 numpy (projector P formed explicitly), and the audit
command's --json records, for the audit tests."""

from __future__ import annotations

import json
import math

import numpy as np
from helpers_cli import run_cli


def oracle_scores(w: np.ndarray, dw: np.ndarray, b: np.ndarray, tau: float) -> dict[str, float]:
    """Definitions, densely: P = V_top V_top^T from numpy's eigh of W_f^T W_f (d_in x d_in), all float64."""
    w, dw = np.asarray(w, np.float64), np.asarray(dw, np.float64)
    frozen = np.delete(w, b, axis=0)
    evals, evecs = np.linalg.eigh(frozen.T @ frozen)
    desc = np.clip(evals[::-1], 0, None)
    m = int(np.argmax(np.cumsum(desc) >= tau * desc.sum())) + 1
    top = evecs[:, ::-1][:, :m]
    p = top @ top.T
    total = float((dw**2).sum())
    keep = np.setdiff1d(np.arange(w.shape[0]), b)
    return {
        "protected_input_share": float(((dw @ p) ** 2).sum()) / total,
        "frozen_row_share": float((dw[keep] ** 2).sum()) / total,
        "delta_norm": math.sqrt(total),
        "relative_delta": math.sqrt(total) / float(np.linalg.norm(w)),
        "m": m,
    }


def audit_json(*args: object) -> list[dict]:
    """``plate-inspect audit ARGS --json -q`` in-process: its records (the command must succeed)."""
    code, output = run_cli("audit", *args, "--json", "-q")
    assert code == 0, output
    return json.loads(output)
