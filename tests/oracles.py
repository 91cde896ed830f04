"""Independent oracles shared by tests in several directories: every tensor of a checkpoint read with safetensors'
own loader, PLATE's geometry computed by its definition in dense float64 numpy (neither uses plate_inspect), and
byte-identity of two bundles (a scan compared with a reference scan of the same weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file


def load_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint dir, read with safetensors' own loader (independent of plate_inspect)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def dense_oracle(w: np.ndarray, r: int, tau: float, max_rank: int, n_anchors: int = 256):
    """PLATE by definition, dense float64 numpy: scores, B, eigenvalues of G (ascending), k."""
    w = np.asarray(w, dtype=np.float64)
    d_out, d_in = w.shape
    norms = np.linalg.norm(w, axis=1)
    unit = w / np.where(norms > 0, norms, 1.0)[:, None]
    n = min(n_anchors, d_out)
    anchors = [(i * d_out) // n for i in range(n)]
    cos = np.abs(unit @ unit[anchors].T)
    scores = np.zeros(d_out)
    for i in range(d_out):
        others = [c for c, a in enumerate(anchors) if a != i]
        scores[i] = cos[i, others].mean() if others else 0.0
    r_eff = min(r, int(np.floor(0.9 * d_out)))
    b = np.sort(np.argsort(-scores, kind="stable")[:r_eff])
    frozen = np.delete(w, b, axis=0)
    gram = frozen.T @ frozen
    evals = np.clip(np.linalg.eigvalsh(gram), 0, None)  # ascending, length d_in
    desc = evals[::-1]
    total = desc.sum()
    m = int(np.argmax(np.cumsum(desc) >= tau * total)) + 1 if total > 0 else 0
    k = max(1, min(d_in - m, max_rank))
    return scores, b, evals, k, gram


def assert_same_bundle(a: Path, b: Path) -> None:
    """Every bundle file (all but the run statistics) byte-identical in two directories."""
    names = sorted(p.name for p in a.iterdir() if p.name != "scan_stats.json")
    assert names == sorted(p.name for p in b.iterdir() if p.name != "scan_stats.json")
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
