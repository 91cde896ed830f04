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
new frozen rows would change two things at once.) What describes the frozen rows does follow the new B: a variant
with another B stores the spectrum of its own W_f (one float64 small-side eigvalsh per module), with the health
metrics and k(tau) derived from it, as a scan would; its k stays PLATE's (matched capacity). Every variant goes
through the same trainer path as PLATE (``apply_bundle`` / the PEFT method), and its manifest records ``variant``
per module and, at the top, the ablation's identity (kind, seed, identity of the base bundle): a second ablation or
seed into the same directory is refused unless ``overwrite``.
"""

from __future__ import annotations

import os
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import torch

from plate_inspect.arguments import bool_argument, seed_argument
from plate_inspect.atomic import path_argument
from plate_inspect.bundle import (
    Bundle,
    BundleWriter,
    Manifest,
    ModuleRecord,
    geometry_digest,
    read_part_tensors,
    scores_digest,
    weight_key,
)
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.geometry import (
    high_energy_basis,
    k_for_tau,
    least_redundant_rows,
    module_seed,
    random_orthonormal,
    random_rows,
)
from plate_inspect.health import health_record, weight_spectrum
from plate_inspect.targets import TargetModule, load_target, modules_by_name, name_list

VARIANTS = ("random_b", "least_redundant_b", "random_q", "high_energy_q", "random_bq")
#: The variants whose B differs from PLATE's: their frozen rows, hence their spectrum and health, are their own.
OTHER_B_VARIANTS = ("random_b", "least_redundant_b", "random_bq")


def variant_geometry(
    variant: str,
    weight: torch.Tensor,
    b_idx: torch.Tensor,
    q: torch.Tensor,
    redundancy: torch.Tensor,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Q) of one module for an ablation, same r and k as PLATE's (b_idx, q). ``weight`` is [d_out, d_in]."""
    seed = seed_argument(seed)  # None was a RuntimeError from torch.manual_seed
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


def _check_variants(names: list[str]) -> list[str]:
    """``names`` when each is a known ablation, given once; else a ConfigError naming the first bad one."""
    for name in names:
        if name not in VARIANTS:
            raise ConfigError(f"unknown variant {name!r:.80}; choose one of {', '.join(VARIANTS)}")
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ConfigError(f"variants lists '{twice}' twice; give each variant once")
    return names


def variant_identity(base: Bundle, variant: str, seed: int) -> dict[str, object]:
    """What makes an ablation bundle what it is: its kind, its seed and the identity of the bundle it derives from."""
    return {"kind": variant, "seed": seed, "base_identity": base.manifest.identity or base.manifest.content_identity()}


def make_variant(
    bundle: Bundle | str | os.PathLike,
    checkpoint: str | os.PathLike,
    variant: str,
    out: str | os.PathLike,
    seed: int = 0,
    overwrite: bool = False,
) -> Bundle:
    """Write the ``variant`` ablation of a scanned bundle to ``out`` (needs the checkpoint for W and fingerprints).

    ``out`` may hold an unfinished or finished build of the same ablation (same kind, seed and base bundle): it is
    resumed or kept. Another ablation, seed or base bundle there is refused unless ``overwrite``.
    """
    _check_variants([variant])
    out = path_argument(out, "out")
    seed = seed_argument(seed)
    bool_argument(overwrite, "overwrite")
    src = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
    ckpt = Checkpoint.open(checkpoint)
    m = src.manifest
    manifest = Manifest(
        source=m.source,
        settings=m.settings,
        planned=list(m.planned),
        source_signature=m.source_signature,
        model_type=m.model_type,
        selection_note=f"{m.selection_note}; ablation {variant} (seed {seed}) of {src.path}",
        variant=variant_identity(src, variant, seed),
    )
    modules = modules_by_name(ckpt)  # every weight by module name, 3-D expert slices and quantized storage included
    if len(src):  # a wrong checkpoint is refused before ``out`` is touched (its smallest module, one extra read)
        _source_weight(src, min(src, key=lambda rec: rec.d_out * rec.d_in), ckpt, modules, checkpoint)
    writer = BundleWriter(out, manifest, overwrite=overwrite, cli_hints=False)  # no CLI command: Python keywords
    with closing(writer):
        writer.open()
        _write_variant(src, ckpt, modules, checkpoint, writer, variant, seed)
    return Bundle.load(out)


def _write_variant(
    src: Bundle,
    ckpt: Checkpoint,
    modules: dict[str, TargetModule],
    checkpoint: str | os.PathLike,
    writer: BundleWriter,
    variant: str,
    seed: int,
) -> None:
    """Every part of the ablation bundle: kept where an earlier build of it is still valid, else computed."""
    parts: dict[str, list[str]] = {}
    for rec in src:
        parts.setdefault(rec.file, []).append(rec.name)
    for part, names in parts.items():
        old = writer.reusable(part)
        records = []
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            rec = src.record(name)
            oriented = _source_weight(src, rec, ckpt, modules, checkpoint)
            # an ablation built before its spectrum followed its B carries the source's scores digest: rebuilt
            stale = variant in OTHER_B_VARIANTS and old.get(name) and old[name].scores_digest == rec.scores_digest
            if name in old and weight_key(old[name]) == weight_key(rec) and not stale:
                records.append(old[name])
                continue
            w = oriented.to(torch.float64)
            new, module_tensors = _variant_module(src, rec, w, variant, seed)
            records.append(new)
            tensors.update(module_tensors)
        if len(tensors) == 0 and set(old) == set(names):
            writer.add_records(records)
            continue
        kept = [n for n in names if f"{n}.plate_Q" not in tensors]
        tensors.update(read_part_tensors(writer.path / part, kept) if kept else {})
        writer.write_part(part, records, tensors)
    writer.finalize({"variant": variant, "seed": seed, "from": str(Path(src.path).resolve())})


def _variant_module(
    src: Bundle, rec: ModuleRecord, w: torch.Tensor, variant: str, seed: int
) -> tuple[ModuleRecord, dict[str, torch.Tensor]]:
    """The ablation's record and tensors for one module of ``src`` (``w`` is its float64 d_out x d_in weight)."""
    name = rec.name
    b_idx, q = variant_geometry(
        variant, w, src.b_idx(name), src.q(name, dtype=None), src.redundancy(name), module_seed(seed, name)
    )
    new = replace(rec, variant=variant, r=int(b_idx.numel()), k=int(q.shape[1]))
    keep = torch.ones(w.shape[0], dtype=torch.bool)
    keep[b_idx] = False
    total = float((w[keep] ** 2).sum())
    new.total_energy = total
    new.captured_energy = float(((w[keep] @ q.to(torch.float64)) ** 2).sum()) / total if total > 0 else 0.0
    if (new.r, new.k) != (rec.r, rec.k):  # pragma: no cover - the helpers keep shapes by construction
        raise BundleError(f"{name}: variant {variant} changed r/k")
    spectrum = src.spectrum(name)
    if variant in OTHER_B_VARIANTS:  # the frozen rows are this B's complement: their own spectrum, health, k(tau)
        spectrum = weight_spectrum(w[keep]).to(spectrum.dtype)
        new.health = health_record(spectrum, (int(keep.sum()), w.shape[1]), "W_frozen")
        max_rank = src.manifest.settings.max_rank
        new.k_by_tau = {key: k_for_tau(spectrum, float(key), w.shape[1], max_rank) for key in rec.k_by_tau}
    tensors = {
        f"{name}.plate_B_idx": b_idx.to(torch.int64).contiguous(),
        f"{name}.plate_Q": q.contiguous(),
        f"{name}.redundancy": src.redundancy(name),
        f"{name}.spectrum": spectrum.contiguous(),
    }
    new.geometry_digest = geometry_digest(tensors[f"{name}.plate_B_idx"], tensors[f"{name}.plate_Q"])
    new.scores_digest = scores_digest(tensors[f"{name}.redundancy"], tensors[f"{name}.spectrum"])
    return new, tensors


def _source_weight(
    src: Bundle, rec: ModuleRecord, ckpt: Checkpoint, modules: dict[str, TargetModule], checkpoint: str | os.PathLike
) -> torch.Tensor:
    """The module's weight (oriented [d_out, d_in]), refused unless it is the one the bundle was scanned from."""
    if rec.name not in modules:
        raise BundleError(f"{src.path}: module '{rec.name}' has no weight in {checkpoint}")
    oriented, fp = load_target(ckpt, modules[rec.name])
    if fp != rec.fingerprint:
        raise BundleError(f"{src.path}: module '{rec.name}' was scanned from other weights than {checkpoint}")
    return oriented


def make_variants(
    bundle: Bundle | str | os.PathLike,
    checkpoint: str | os.PathLike,
    out_root: str | os.PathLike,
    variants: tuple[str, ...] = VARIANTS,
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, Bundle]:
    """All requested ablations, each in ``out_root/<variant>`` (every argument is checked before the first is
    written)."""
    variants = tuple(_check_variants(name_list(variants, "variants")))
    out_root = path_argument(out_root, "out_root")
    seed = seed_argument(seed)
    bool_argument(overwrite, "overwrite")
    return {
        v: make_variant(bundle, checkpoint, v, Path(out_root) / v, seed=seed, overwrite=overwrite) for v in variants
    }
