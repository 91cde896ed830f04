"""Pure data preparation for the HTML reports: everything a plot shows, computed from bundles.

Nothing here draws; :mod:`plate_inspect.reports.figures` turns these records into plotly figures. Every
number comes from the bundle's manifest (``ModuleRecord``), its stored tensors (spectrum, redundancy scores,
B indices) and ``scan_stats.json``, so tests can check each plot's data against the bundle directly.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plate_inspect import __version__
from plate_inspect.bundle import Q_DTYPES, Bundle, ModuleRecord
from plate_inspect.errors import BundleError
from plate_inspect.geometry import energy_rank

#: Metrics drawn as layer x module-type heatmaps: record attribute -> (title, number format for hover).
HEATMAP_METRICS: dict[str, tuple[str, str]] = {
    "mean_redundancy": ("mean redundancy score", ".4f"),
    "k": ("k (dimension of Q)", "d"),
    "captured_energy": ("fraction of frozen energy Q captures", ".3e"),
}
#: Spectra longer than this are downsampled for display (evenly spaced eigenvalue indices).
DEFAULT_MAX_POINTS = 300
#: Bins of the per-module redundancy score histograms.
DEFAULT_BINS = 40
OTHER_LAYER = "other"


def _sig(x: float, digits: int = 4) -> float | None:
    """Round to a few significant digits for compact JSON; None for non-finite values."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


# --------------------------------------------------------------------------- bundles
def bundle_labels(bundles: list[Bundle], labels: list[str] | None = None) -> list[str]:
    """Display names: the given labels, else each bundle directory's name (made unique with #n)."""
    if labels is not None:
        if len(labels) != len(bundles):
            raise BundleError(f"{len(labels)} labels given for {len(bundles)} bundles; give one label per bundle")
        return [str(x) for x in labels]
    names = [Path(b.path).resolve().name or str(b.path) for b in bundles]
    out = []
    for i, name in enumerate(names):
        out.append(f"{name} #{i + 1}" if names.count(name) > 1 else name)
    return out


def check_bundles(bundles: list[Bundle]) -> list[str]:
    """Refuse empty, incomplete or mutually incompatible bundles; return the module names to show.

    Comparison needs at least one module name in common, and each common module must have the same
    [d_out, d_in] in every bundle. Modules missing from some bundle are left out (the report says so).
    """
    if not bundles:
        raise BundleError("no bundle given: name at least one bundle directory (plate-inspect report BUNDLE)")
    for b in bundles:
        if not isinstance(b, Bundle):
            raise BundleError(f"expected a plate_inspect.Bundle, got {type(b).__name__} (use Bundle.load(path))")
        m = b.manifest
        if not m.complete:
            raise BundleError(
                f"{b.path}: bundle is incomplete ({len(m.modules)}/{len(m.planned)} modules): "
                "finish the scan first (rerun the same scan command to resume it)"
            )
        if len(b) == 0:
            raise BundleError(f"{b.path}: bundle holds no modules; nothing to report")
    ref = bundles[0]
    common = [n for n in ref.modules if all(n in b for b in bundles[1:])]
    for b in bundles[1:]:
        if not common:
            raise BundleError(
                f"incompatible bundles: {ref.path} and {b.path} have no module in common "
                f"(e.g. {ref.modules[0]!r} vs {b.modules[0]!r}); compare bundles of the same architecture"
            )
        for name in common:
            if ref.record(name).shape != b.record(name).shape:
                raise BundleError(
                    f"incompatible bundles: module '{name}' is {ref.record(name).shape} in {ref.path} "
                    f"but {b.record(name).shape} in {b.path}; compare bundles of the same architecture"
                )
    return common


# --------------------------------------------------------------------------- header
@dataclass
class BundleSummary:
    """The report header for one bundle: provenance, settings and totals."""

    label: str
    path: str
    model: str
    model_type: str | None
    source: dict[str, Any]
    config: dict[str, Any]
    selection: str
    bundle_tool_version: str
    report_tool_version: str
    modules: int
    plate_params: int
    lora_params: int
    q_dtype: str
    q_bytes: int
    scan_seconds: float | None
    scan_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def plate_over_lora(self) -> float:
        return self.plate_params / self.lora_params if self.lora_params else float("nan")


def q_bytes(record: ModuleRecord, q_dtype: str) -> int:
    """Memory of one module's Q (d_in x k) stored in ``q_dtype``."""
    itemsize = torch.empty((), dtype=Q_DTYPES[q_dtype]).element_size()
    return record.d_in * record.k * itemsize


def bundle_summary(bundle: Bundle, label: str | None = None) -> BundleSummary:
    """Header numbers for one bundle: PLATE r*k vs LoRA r*(d_in+d_out) parameters, Q memory, scan time."""
    m = bundle.manifest
    s = m.settings
    records = list(bundle)
    stats = bundle.stats()
    wall = stats.get("wall_seconds")
    src = m.source or {}
    model = str(src.get("id", "?")) + (f"@{src['revision']}" if src.get("revision") else "")
    return BundleSummary(
        label=label or Path(bundle.path).name,
        path=str(bundle.path),
        model=model,
        model_type=m.model_type,
        source=dict(src),
        config=s.to_json(),
        selection=m.selection_note,
        bundle_tool_version=m.tool_version,
        report_tool_version=__version__,
        modules=len(records),
        plate_params=sum(r.trainable_params for r in records),
        lora_params=sum(r.lora_params for r in records),
        q_dtype=s.q_dtype,
        q_bytes=sum(q_bytes(r, s.q_dtype) for r in records),
        scan_seconds=float(wall) if wall is not None else None,
        scan_stats=stats,
    )


# --------------------------------------------------------------------------- heatmaps
def layer_label(layer: int | None) -> str:
    return OTHER_LAYER if layer is None else str(layer)


def grid_axes(records: list[ModuleRecord]) -> tuple[list[str], list[str]]:
    """Heatmap axes: layer labels (numeric order, modules outside numbered layers last) and module types."""
    layers = sorted({r.layer for r in records if r.layer is not None})
    rows = [str(x) for x in layers] + ([OTHER_LAYER] if any(r.layer is None for r in records) else [])
    types: list[str] = []
    for r in records:
        if r.module_type not in types:
            types.append(r.module_type)
    return rows, types


@dataclass
class Heatmap:
    """z[i][j] = metric of the module at layer rows[i], type cols[j] (None where there is none)."""

    metric: str
    title: str
    rows: list[str]
    cols: list[str]
    z: list[list[float | None]]
    names: list[list[str | None]]
    hover: list[list[str]]


def module_hover(rec: ModuleRecord) -> str:
    """The exact numbers of one module, as shown on hover (plotly understands <br>)."""
    return (
        f"<b>{rec.name}</b><br>[d_out, d_in] = [{rec.d_out}, {rec.d_in}]<br>r = {rec.r}, k = {rec.k}"
        f"<br>captured energy = {rec.captured_energy:.6e}<br>mean redundancy = {rec.mean_redundancy:.6f}"
        f"<br>PLATE r*k = {rec.trainable_params:,}, LoRA r*(d_in+d_out) = {rec.lora_params:,}"
    )


def heatmap(records: list[ModuleRecord], metric: str, axes: tuple[list[str], list[str]] | None = None) -> Heatmap:
    """Layer x module-type grid of one record metric (mean_redundancy | k | captured_energy)."""
    if metric not in HEATMAP_METRICS:
        raise ValueError(f"unknown heatmap metric {metric!r}; one of {sorted(HEATMAP_METRICS)}")
    rows, cols = axes or grid_axes(records)
    z: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    names: list[list[str | None]] = [[None] * len(cols) for _ in rows]
    hover = [[""] * len(cols) for _ in rows]
    for rec in records:
        i, j = rows.index(layer_label(rec.layer)), cols.index(rec.module_type)
        if names[i][j] is not None:  # two modules share a cell (e.g. unnumbered modules of one type)
            hover[i][j] += "<br>(+ " + rec.name + ")"
            continue
        value = getattr(rec, metric)
        z[i][j] = int(value) if metric == "k" else float(value)
        names[i][j] = rec.name
        hover[i][j] = module_hover(rec)
    return Heatmap(metric, HEATMAP_METRICS[metric][0], rows, cols, z, names, hover)


def heatmap_difference(a: Heatmap, b: Heatmap) -> Heatmap:
    """b - a cell by cell (None where either lacks the module); same axes required."""
    if (a.rows, a.cols, a.metric) != (b.rows, b.cols, b.metric):
        raise ValueError("heatmaps to difference must share metric and axes")
    z = [
        [None if x is None or y is None else y - x for x, y in zip(ra, rb, strict=True)]
        for ra, rb in zip(a.z, b.z, strict=True)
    ]
    hover = [
        [
            "" if za is None else f"{name}<br>{a.title}: {x} -> {y} (change {za:+.6g})"
            for name, x, y, za in zip(na, ra, rb, zr, strict=True)
        ]
        for na, ra, rb, zr in zip(a.names, a.z, b.z, z, strict=True)
    ]
    return Heatmap(a.metric, f"change in {a.title}", a.rows, a.cols, z, a.names, hover)


# --------------------------------------------------------------------------- k(tau)
@dataclass
class KTauCurve:
    """k over the manifest's tau grid for one module type: mean, min and max over its modules."""

    module_type: str
    taus: list[float]
    mean_k: list[float]
    min_k: list[int]
    max_k: list[int]
    modules: int


def k_tau_curves(records: list[ModuleRecord]) -> list[KTauCurve]:
    """Per module type, k(tau) from each record's ``k_by_tau`` (tau grid plus the bundle's tau)."""
    groups: dict[str, list[ModuleRecord]] = defaultdict(list)
    for rec in records:
        groups[rec.module_type].append(rec)
    curves = []
    for module_type, recs in groups.items():
        taus = sorted({float(t) for rec in recs for t in rec.k_by_tau})
        mean_k, min_k, max_k = [], [], []
        for tau in taus:
            ks = [_k_at(rec, tau) for rec in recs]
            ks = [k for k in ks if k is not None]
            mean_k.append(sum(ks) / len(ks))
            min_k.append(min(ks))
            max_k.append(max(ks))
        curves.append(KTauCurve(module_type, taus, mean_k, min_k, max_k, len(recs)))
    return curves


def _k_at(rec: ModuleRecord, tau: float) -> int | None:
    for key, k in rec.k_by_tau.items():
        if math.isclose(float(key), tau, rel_tol=0, abs_tol=1e-9):
            return int(k)
    return None


def params_by_tau(records: list[ModuleRecord]) -> tuple[list[float], list[int]]:
    """Total PLATE trainable parameters sum(r * k(tau)) over the modules, at every tau all records know."""
    taus = sorted({float(t) for rec in records for t in rec.k_by_tau})
    out_t, out_p = [], []
    for tau in taus:
        ks = [_k_at(rec, tau) for rec in records]
        if all(k is not None for k in ks):
            out_t.append(tau)
            out_p.append(sum(rec.r * k for rec, k in zip(records, ks, strict=True)))
    return out_t, out_p


# --------------------------------------------------------------------------- spectra
@dataclass
class SpectrumView:
    """One module's frozen-energy spectrum prepared for display.

    ``index`` is the 1-based eigen-direction index (descending eigenvalue), ``values`` the eigenvalues at
    those indices (None where the eigenvalue is exactly 0: not drawable on a log axis), ``cum_energy``
    the fraction of energy in the directions 1..index. The stored spectrum has ``n_stored`` =
    min(d_out - r, d_in) entries; the other d_in - n_stored directions are exact null directions
    (eigenvalue 0). The tau cut is after direction ``m_tau`` (the top m_tau hold >= tau of the energy);
    Q spans the bottom ``k`` directions, ``d_in - k + 1 .. d_in``.
    """

    name: str
    d_in: int
    k: int
    tau: float
    m_tau: int
    n_stored: int
    index: list[int]
    values: list[float | None]
    cum_energy: list[float]
    downsampled: bool
    zero_eigenvalues: int

    @property
    def null_directions(self) -> int:
        return self.d_in - self.n_stored

    @property
    def k_start(self) -> int:
        """First (1-based) direction spanned by Q."""
        return self.d_in - self.k + 1


def display_indices(n: int, max_points: int, keep: list[int] | tuple[int, ...] = ()) -> np.ndarray:
    """0-based indices to draw: all of them if n <= max_points, else evenly spaced ones plus first, last and keep."""
    if n <= max_points:
        return np.arange(n)
    idx = np.unique(np.round(np.linspace(0, n - 1, max_points)).astype(np.int64))
    extra = [i for i in keep if 0 <= i < n]
    return np.unique(np.concatenate([idx, np.asarray(extra, dtype=np.int64)]))


def spectrum_view(
    bundle: Bundle, name: str, max_points: int = DEFAULT_MAX_POINTS, spectrum: np.ndarray | None = None
) -> SpectrumView:
    """The spectrum of module ``name`` with its tau cut and bottom-k directions, downsampled past max_points."""
    rec = bundle.record(name)
    s = bundle.spectrum(name).double().numpy() if spectrum is None else np.asarray(spectrum, dtype=np.float64)
    tau = bundle.settings.tau
    m = energy_rank(torch.from_numpy(s), tau)
    n = len(s)
    total = float(s.sum())
    cum = np.cumsum(s) / total if total > 0 else np.zeros(n)
    keep = [m - 1, m, rec.d_in - rec.k, rec.d_in - rec.k - 1]
    idx = display_indices(n, max_points, keep)
    vals = s[idx]
    return SpectrumView(
        name=name,
        d_in=rec.d_in,
        k=rec.k,
        tau=tau,
        m_tau=m,
        n_stored=n,
        index=(idx + 1).tolist(),
        values=[_sig(v) if v > 0 else None for v in vals],
        cum_energy=[_sig(c, 4) for c in cum[idx]],
        downsampled=len(idx) < n,
        zero_eigenvalues=int((s <= 0).sum()),
    )


# --------------------------------------------------------------------------- redundancy scores
@dataclass
class ScoreHistogram:
    """Histogram of one module's redundancy scores and the B cut-off (smallest score among the r chosen rows)."""

    name: str
    edges: list[float]
    counts: list[int]
    r: int
    d_out: int
    cutoff: float
    b_min: float
    rest_max: float | None


def score_edges(score_arrays: list[np.ndarray], bins: int = DEFAULT_BINS) -> np.ndarray:
    """Common histogram edges spanning every given score array (so comparison histograms line up)."""
    lo = min(float(a.min()) for a in score_arrays)
    hi = max(float(a.max()) for a in score_arrays)
    if hi <= lo:
        hi = lo + 1e-6
    return np.linspace(lo, hi, bins + 1)


def score_histogram(name: str, scores: np.ndarray, b_idx: np.ndarray, edges: np.ndarray) -> ScoreHistogram:
    """Counts of scores per bin; cut-off = min score of B's rows (B = the top-r rows by score)."""
    scores = np.asarray(scores, dtype=np.float64)
    b_idx = np.asarray(b_idx, dtype=np.int64)
    counts, _ = np.histogram(scores, bins=edges)
    chosen = np.zeros(len(scores), dtype=bool)
    chosen[b_idx] = True
    b_min = float(scores[chosen].min()) if chosen.any() else float("nan")
    rest_max = float(scores[~chosen].max()) if (~chosen).any() else None
    return ScoreHistogram(
        name=name,
        edges=[float(e) for e in edges],
        counts=counts.astype(int).tolist(),
        r=int(len(b_idx)),
        d_out=int(len(scores)),
        cutoff=b_min,
        b_min=b_min,
        rest_max=rest_max,
    )


# --------------------------------------------------------------------------- table
def table_row(rec: ModuleRecord) -> dict[str, Any]:
    """One module's row of the per-module table."""
    return {
        "name": rec.name,
        "type": rec.module_type,
        "layer": rec.layer,
        "shape": f"{rec.d_out}x{rec.d_in}",
        "r": rec.r,
        "k": rec.k,
        "energy": rec.captured_energy,
        "score": rec.mean_redundancy,
        "plate": rec.trainable_params,
        "lora": rec.lora_params,
    }


def b_overlap(a: np.ndarray, b: np.ndarray) -> float:
    """|B_a intersect B_b| / max(|B_a|, |B_b|): 1 when two bundles choose the same redundant rows."""
    sa, sb = set(np.asarray(a).tolist()), set(np.asarray(b).tolist())
    return len(sa & sb) / max(len(sa), len(sb), 1)


# --------------------------------------------------------------------------- everything
@dataclass
class ModuleData:
    """Per-module tensors the report reads once (spectrum, scores, B) for every bundle."""

    spectra: list[np.ndarray]
    scores: list[np.ndarray]
    b_idx: list[np.ndarray]


def read_module(bundles: list[Bundle], name: str) -> ModuleData:
    """Read one module's spectrum, redundancy scores and B indices from every bundle."""
    return ModuleData(
        spectra=[b.spectrum(name).double().numpy() for b in bundles],
        scores=[b.redundancy(name).double().numpy() for b in bundles],
        b_idx=[b.b_idx(name).numpy() for b in bundles],
    )


@dataclass
class ReportData:
    """Everything the report shows, before it becomes figures and HTML."""

    labels: list[str]
    summaries: list[BundleSummary]
    modules: list[str]
    left_out: list[list[str]]  # per bundle: its modules not in the comparison
    heatmaps: list[dict[str, Heatmap]]  # per bundle, metric -> heatmap (shared axes)
    ktau: list[list[KTauCurve]]
    params_tau: list[tuple[list[float], list[int]]]
    taus: list[float]
    spectra: dict[str, list[SpectrumView]]  # module -> one view per bundle
    histograms: dict[str, list[ScoreHistogram]]
    table: list[dict[str, Any]]
    max_points: int


def report_data(
    bundles: list[Bundle],
    labels: list[str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    bins: int = DEFAULT_BINS,
    progress: Any = None,
) -> ReportData:
    """Check the bundles and compute the data of every view. ``progress(done, total, name)`` is called per module."""
    modules = check_bundles(bundles)
    labels = bundle_labels(bundles, labels)
    summaries = [bundle_summary(b, lab) for b, lab in zip(bundles, labels, strict=True)]
    per_bundle_records = [[b.record(n) for n in modules] for b in bundles]
    axes = grid_axes(per_bundle_records[0])
    heatmaps = [{m: heatmap(recs, m, axes) for m in HEATMAP_METRICS} for recs in per_bundle_records]
    spectra: dict[str, list[SpectrumView]] = {}
    histograms: dict[str, list[ScoreHistogram]] = {}
    table = []
    for i, name in enumerate(modules):
        md = read_module(bundles, name)
        spectra[name] = [spectrum_view(b, name, max_points, s) for b, s in zip(bundles, md.spectra, strict=True)]
        edges = score_edges(md.scores, bins)
        histograms[name] = [score_histogram(name, s, bi, edges) for s, bi in zip(md.scores, md.b_idx, strict=True)]
        row = table_row(bundles[0].record(name))
        if len(bundles) > 1:
            row["per_bundle"] = [
                {
                    "r": b.record(name).r,
                    "k": b.record(name).k,
                    "energy": b.record(name).captured_energy,
                    "score": b.record(name).mean_redundancy,
                    "b_overlap": b_overlap(md.b_idx[0], md.b_idx[j]),
                }
                for j, b in enumerate(bundles)
            ]
        table.append(row)
        if progress is not None:
            progress(i + 1, len(modules), name)
    shown = set(modules)
    return ReportData(
        labels=labels,
        summaries=summaries,
        modules=modules,
        left_out=[[n for n in b.modules if n not in shown] for b in bundles],
        heatmaps=heatmaps,
        ktau=[k_tau_curves(recs) for recs in per_bundle_records],
        params_tau=[params_by_tau(recs) for recs in per_bundle_records],
        taus=[b.settings.tau for b in bundles],
        spectra=spectra,
        histograms=histograms,
        table=table,
        max_points=max_points,
    )


def overlap_heatmap(base: Heatmap, overlaps: dict[str, float], title: str) -> Heatmap:
    """A per-module value (e.g. B overlap between two bundles) on the axes and cells of an existing heatmap."""
    z = [[None if n is None else overlaps.get(n) for n in row] for row in base.names]
    hover = [
        ["" if n is None else f"<b>{n}</b><br>{title} = {overlaps.get(n, float('nan')):.4f}" for n in row]
        for row in base.names
    ]
    return Heatmap("b_overlap", title, base.rows, base.cols, z, base.names, hover)
