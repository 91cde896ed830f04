"""Matched-capacity ablation bundles (paper, appendix "Matched-capacity ablations"), written as real bundles.

From a scanned bundle and its checkpoint, ``make_variant`` writes a bundle with the same modules, the same r and
k per module (so A has exactly PLATE's parameter count) and a different B and/or Q:

- ``random_b``: r output rows drawn uniformly at random; **PLATE's Q kept**.
- ``least_redundant_b``: the r rows with the lowest redundancy scores; **PLATE's Q kept**.
- ``random_q``: a Haar-random orthonormal k-frame; PLATE's B kept.
- ``high_energy_q``: the top-k eigenvectors of W_f^T W_f (W_f = the rows outside PLATE's B); PLATE's B kept.
- ``random_bq``: random rows and a random k-frame.

Keeping PLATE's Q for the B ablations follows the paper: it compares B choices "at the same fixed Q and parameter
count" and calls Random-B and Least-red.-B the "Q-preserving variants", so only B changes. (Recomputing Q from the
new frozen rows would change two things at once.) Every variant goes through the same trainer path as PLATE
(``apply_bundle`` / the PEFT method), and its manifest records ``variant`` per module.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from plate_inspect.bundle import Bundle, BundleWriter, Manifest
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.geometry import (
    high_energy_basis,
    least_redundant_rows,
    module_seed,
    random_orthonormal,
    random_rows,
)

VARIANTS = ("random_b", "least_redundant_b", "random_q", "high_energy_q", "random_bq")


def variant_geometry(
    variant: str,
    weight: torch.Tensor,
    b_idx: torch.Tensor,
    q: torch.Tensor,
    redundancy: torch.Tensor,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Q) of one module for an ablation, same r and k as PLATE's (b_idx, q). ``weight`` is [d_out, d_in]."""
    d_out, d_in = weight.shape
    r, k = int(b_idx.numel()), int(q.shape[1])
    if variant == "random_b":
        return random_rows(d_out, r, seed), q
    if variant == "least_redundant_b":
        return least_redundant_rows(redundancy, r), q
    if variant == "random_q":
        return b_idx, random_orthonormal(d_in, k, seed, dtype=q.dtype)
    if variant == "high_energy_q":
        keep = torch.ones(d_out, dtype=torch.bool)
        keep[b_idx] = False
        return b_idx, high_energy_basis(weight.to(torch.float64)[keep], k).to(q.dtype)
    if variant == "random_bq":
        return random_rows(d_out, r, seed), random_orthonormal(d_in, k, seed + 1, dtype=q.dtype)
    raise ConfigError(f"unknown variant '{variant}'; choose one of {', '.join(VARIANTS)}")


def make_variant(
    bundle: Bundle | str | os.PathLike,
    checkpoint: str | os.PathLike,
    variant: str,
    out: str | os.PathLike,
    seed: int = 0,
    overwrite: bool = False,
) -> Bundle:
    """Write the ``variant`` ablation of a scanned bundle to ``out`` (needs the checkpoint for W and fingerprints)."""
    if variant not in VARIANTS:
        raise ConfigError(f"unknown variant '{variant}'; choose one of {', '.join(VARIANTS)}")
    src = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
    ckpt = Checkpoint.open(checkpoint)
    if src.manifest.source_signature and ckpt.signature() != src.manifest.source_signature:
        raise BundleError(f"{src.path}: was scanned from other weights than {checkpoint} (source signature differs)")
    m = src.manifest
    manifest = Manifest(
        source=m.source,
        settings=m.settings,
        planned=list(m.planned),
        source_signature=m.source_signature,
        model_type=m.model_type,
        selection_note=f"{m.selection_note}; ablation {variant} (seed {seed}) of {src.path}",
    )
    writer = BundleWriter(out, manifest, overwrite=overwrite)
    manifest = writer.open()
    if manifest.complete:
        return Bundle.load(out)
    parts: dict[str, list[str]] = {}
    for rec in src:
        parts.setdefault(rec.file, []).append(rec.name)
    for part, names in parts.items():
        if all(n in manifest.modules for n in names):
            continue
        tensors: dict[str, torch.Tensor] = {}
        records = []
        for name in names:
            rec = src.record(name)
            stored, fp = ckpt.read(f"{name}.weight")
            if fp != rec.fingerprint:
                raise BundleError(f"{src.path}: module '{name}' was scanned from other weights than {checkpoint}")
            w = (stored.T if rec.layout == "conv1d" else stored).to(torch.float64)
            b_idx, q = variant_geometry(
                variant, w, src.b_idx(name), src.q(name, dtype=None), src.redundancy(name), module_seed(seed, name)
            )
            new = type(rec)(**{**rec.__dict__, "variant": variant})
            new.r, new.k = int(b_idx.numel()), int(q.shape[1])
            keep = torch.ones(w.shape[0], dtype=torch.bool)
            keep[b_idx] = False
            total = float((w[keep] ** 2).sum())
            new.total_energy = total
            new.captured_energy = float(((w[keep] @ q.to(torch.float64)) ** 2).sum()) / total if total > 0 else 0.0
            if (new.r, new.k) != (rec.r, rec.k):  # pragma: no cover - the helpers keep shapes by construction
                raise BundleError(f"{name}: variant {variant} changed r/k")
            records.append(new)
            tensors[f"{name}.plate_B_idx"] = b_idx.to(torch.int64).contiguous()
            tensors[f"{name}.plate_Q"] = q.contiguous()
            tensors[f"{name}.redundancy"] = src.redundancy(name)
            tensors[f"{name}.spectrum"] = src.spectrum(name)
        writer.write_part(part, records, tensors)
    writer.finalize({"variant": variant, "seed": seed, "from": str(Path(src.path).resolve())})
    return Bundle.load(out)


def make_variants(
    bundle: Bundle | str | os.PathLike,
    checkpoint: str | os.PathLike,
    out_root: str | os.PathLike,
    variants: tuple[str, ...] = VARIANTS,
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, Bundle]:
    """All requested ablations, each in ``out_root/<variant>``."""
    return {
        v: make_variant(bundle, checkpoint, v, Path(out_root) / v, seed=seed, overwrite=overwrite) for v in variants
    }
