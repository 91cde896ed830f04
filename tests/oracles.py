"""Independent oracles shared by tests in several directories: every tensor of a checkpoint read with safetensors'
own loader, PLATE's geometry computed by its definition in dense float64 numpy (neither uses plate_inspect),
byte-identity of two bundles (a scan compared with a reference scan of the same weights), and FP8 / MXFP4 storage
decoded from the format definitions.

The decoders read bits with numpy (OCP FP8: E4M3 bias 7, NaN only at S.1111.111; E5M2 bias 15, IEEE-like;
OCP MX v1.0: FP4 E2M1 bias 1, E8M0 scale 2^(x-127), 255 = NaN), multiply in float64 (exact: a 4-bit and a 24-bit
significand fit in 53 bits) and round once to float32: what an exact float32 dequantization must return."""

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


# --------------------------------------------------------------------------- FP8 / MXFP4 from the format definitions
def decode_e4m3(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(s == 1, -mag, mag)


def decode_e5m2(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    s, e, m = b >> 7, (b >> 2) & 0x1F, b & 0x3
    mag = np.where(e == 0, m / 4.0 * 2.0**-14, (1 + m / 4.0) * 2.0 ** (e - 15))
    mag = np.where(e == 31, np.where(m == 0, np.inf, np.nan), mag)
    return np.where(s == 1, -mag, mag)


def decode_e2m1(nibble: np.ndarray) -> np.ndarray:
    n = nibble.astype(np.int64)
    s, e, m = n >> 3, (n >> 1) & 0x3, n & 0x1
    mag = np.where(e == 0, m * 0.5, (1 + m / 2.0) * 2.0 ** (e - 1))
    return np.where(s == 1, -mag, mag)


def decode_e8m0(x: np.ndarray) -> np.ndarray:
    return np.where(x == 255, np.nan, 2.0 ** (x.astype(np.float64) - 127))


def fp8_oracle(raw: np.ndarray, fmt: str) -> np.ndarray:
    return decode_e4m3(raw) if fmt == "F8_E4M3" else decode_e5m2(raw)


def block_oracle(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Element [.., i, j] times scale [.., i // br, j // bc], in float64, by explicit index arithmetic."""
    rows, cols = values.shape[-2:]
    i = np.arange(rows)[:, None] // block[0]
    j = np.arange(cols)[None, :] // block[1]
    return (values * scale[..., i, j]).astype(np.float32)


def mxfp4_oracle(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Element 2t of a block is the low nibble of byte t, element 2t+1 the high nibble; times 2^(scale-127)."""
    lo, hi = decode_e2m1(blocks & 0x0F), decode_e2m1(blocks >> 4)
    values = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    out = values * decode_e8m0(scales)[..., None]
    with np.errstate(over="ignore"):  # 6 x 2^127 rounds to float32 infinity, as it must
        return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2).astype(np.float32)


def stored_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's stored bytes (uint8, flat), whatever its dtype: what the decoders read."""
    return t.contiguous().view(torch.uint8).numpy().copy()


def matrix_key(w: torch.Tensor) -> tuple:
    """A weight matrix's identity by value (shape and raw bf16 bits): random bf16 weights make each one unique, so two
    modules hold the same matrix exactly when their keys are equal, whatever their names."""
    return (tuple(w.shape), w.detach().contiguous().view(torch.uint16).numpy().tobytes())


def with_random_bf16_weights(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter drawn from N(0, 1) (seed 0) and cast to bf16: the tiny transformers models'
    weights, each matrix unique by value (:func:`matrix_key`)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.to(torch.bfloat16)
