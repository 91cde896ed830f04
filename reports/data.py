"""Pure data preparation for the HTML reports: everything a plot shows, computed from bundles.

Nothing here draws; :mod:`plate_inspect.reports.figures` turns these records into plotly figures. Every
number comes from the bundle's manifest (``ModuleRecord``), its stored tensors (spectrum, redundancy scores,
B indices) and ``scan_stats.json``, so tests can check each plot's data against the bundle directly.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plate_inspect import __version__
from plate_inspect.arguments import describe
from plate_inspect.bundle import (
    Q_DTYPES,
    Bundle,
    ModuleRecord,
    read_problem,
    scores_digest,
    stored_b_problem,
    unfinished_note,
)
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.formatting import counted
from plate_inspect.geometry import energy_rank
from plate_inspect.progress import ProgressCallback, ProgressCounter, as_callback
from plate_inspect.targets import LayerEntry, expert_of, layer_rows

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
#: The most bins a histogram gets: every bin count is written into the page (per module and bundle), and finer bins
#: than this draw no more detail on a screen; numpy refuses far larger counts outright ("Maximum allowed size").
MAX_BINS = 1000
#: Eigenvalues kept per expert for the drill-down spectrum (evenly spaced; experts can number tens of thousands).
EXPERT_SPECTRUM_POINTS = 24
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
            raise BundleError(
                f"{counted(len(labels), 'label')} given for {counted(len(bundles), 'bundle')}; "
                "give one label per bundle"
            )
        repeated = sorted({str(x) for x in labels if [str(y) for y in labels].count(str(x)) > 1})
        if repeated:
            raise BundleError(f"labels must tell the bundles apart; {', '.join(map(repr, repeated))} is given twice")
        return [str(x) for x in labels]
    names = [Path(b.path).resolve().name or str(b.path) for b in bundles]
    out = []
    for i, name in enumerate(names):
        out.append(f"{name} #{i + 1}" if names.count(name) > 1 else name)
    return out


def bundles_argument(bundles: object) -> list[Bundle]:
    """``bundles`` as a list, refused with a ConfigError naming the argument when it is one Bundle (iterated, it gave
    its ModuleRecords: "expected a Bundle, got ModuleRecord"), a path, or holds something other than Bundles."""
    if isinstance(bundles, (Bundle, str, os.PathLike)) or not isinstance(bundles, Iterable):
        what = (
            "one Bundle"
            if isinstance(bundles, Bundle)
            else f"the path {os.fspath(bundles)!r:.80}"
            if isinstance(bundles, (str, os.PathLike))
            else describe(bundles)
        )
        raise ConfigError(
            f"bundles must be a list of plate_inspect.Bundle, got {what}; pass [Bundle.load(path)], one per bundle"
        )
    listed = list(bundles)
    for i, b in enumerate(listed):
        if not isinstance(b, Bundle):
            raise ConfigError(f"bundles[{i}] must be a plate_inspect.Bundle, got {describe(b)} (use Bundle.load(path))")
    return listed


def check_bundles(bundles: list[Bundle]) -> list[str]:
    """Refuse empty, incomplete or mutually incompatible bundles; return the module names to show.

    Comparison needs at least one module name in common, and each common module must have the same
    [d_out, d_in] in every bundle. Modules missing from some bundle are left out (the report says so).
    """
    bundles = bundles_argument(bundles)
    if not bundles:
        raise BundleError("no bundle given: name at least one bundle directory (plate-inspect report BUNDLE)")
    for b in bundles:
        m = b.manifest
        if not m.complete:
            raise BundleError(f"{b.path}: {unfinished_note(m)}")
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
    scan_stats: dict[str, Any] = field(default_factory=dict)  # the fields the header shows (see shown_stats)

    @property
    def plate_over_lora(self) -> float:
        """PLATE's trainable parameters as a multiple of LoRA's at the same modules (NaN without LoRA's)."""
        return self.plate_params / self.lora_params if self.lora_params else float("nan")


def q_bytes(record: ModuleRecord, q_dtype: str) -> int:
    """Memory of one module's Q (d_in x k) stored in ``q_dtype``."""
    itemsize = torch.empty((), dtype=Q_DTYPES[q_dtype]).element_size()
    return record.d_in * record.k * itemsize


#: The scan_stats.json fields the header shows, with the types a scan writes them in.
SHOWN_STATS: dict[str, tuple[type, ...]] = {
    "wall_seconds": (int, float),
    "device": (str,),
    "bytes_read": (int,),
    "peak_rss_bytes": (int,),
    "modules_resumed": (int,),
}


def shown_stats(stats: object) -> dict[str, Any]:
    """The header's fields of a bundle's scan statistics, each of the type a scan writes (non-negative numbers); a
    hand-edited or foreign scan_stats.json's other values read as not recorded, not as a traceback."""
    if not isinstance(stats, dict):
        return {}

    def ok(v: object, types: tuple[type, ...]) -> bool:
        if isinstance(v, bool) or not isinstance(v, types):
            return False
        return isinstance(v, str) or (isinstance(v, int | float) and math.isfinite(v) and v >= 0)

    return {k: v for k, v in stats.items() if k in SHOWN_STATS and ok(v, SHOWN_STATS[k])}


def bundle_summary(bundle: Bundle, label: str | None = None) -> BundleSummary:
    """Header numbers for one bundle: PLATE r*k vs LoRA r*(d_in+d_out) parameters, Q memory, scan time."""
    m = bundle.manifest
    s = m.settings
    records = list(bundle)
    stats = shown_stats(bundle.stats())
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
def row_labels(
    records: list[ModuleRecord], layers: Iterable[LayerEntry] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Heatmap rows (layers in numeric order, per layer stack where there are several, or where ``layers``, the
    bundle's layer selection, named the one stack it holds: ``layer_rows``; modules outside numbered layers last,
    as 'other') and each module's row."""
    rows, of = layer_rows((r.name for r in records), layers)
    labels = {n: OTHER_LAYER if label is None else label for n, label in of.items()}
    return rows + ([OTHER_LAYER] if OTHER_LAYER in labels.values() else []), labels


def grid_axes(records: list[ModuleRecord], layers: Iterable[LayerEntry] | None = None) -> tuple[list[str], list[str]]:
    """Heatmap axes: layer rows (see ``row_labels``) and module types."""
    rows = row_labels(records, layers)[0]
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
    #: the range the metric can take in these modules (see :func:`metric_scale`): the colour range of a map whose
    #: cells do not span one (a single module), so its colour says where the value lies, not nothing
    scale: tuple[float, float] = (0.0, 1.0)


def metric_scale(metric: str, records: list[ModuleRecord], max_rank: int | None = None) -> tuple[float, float]:
    """The range ``metric`` can take in ``records``: [0, 1] for the fractions (mean |cos| redundancy scores, the
    captured energy share, B overlap), [0, the most columns Q can have] for k (min(d_in, max_rank), or the largest
    k where an older bundle exceeds that)."""
    if metric != "k" or not records:
        return (0.0, 1.0)
    cap = max(max(min(r.d_in, max_rank or r.d_in), r.k) for r in records)
    return (0.0, float(cap))


def module_hover(rec: ModuleRecord) -> str:
    """The exact numbers of one module, as shown on hover (plotly understands <br>)."""
    return (
        f"<b>{rec.name}</b><br>[d_out, d_in] = [{rec.d_out}, {rec.d_in}]<br>r = {rec.r}, k = {rec.k}"
        f"<br>captured energy = {rec.captured_energy:.6e}<br>mean redundancy = {rec.mean_redundancy:.6f}"
        f"<br>PLATE r*k = {rec.trainable_params:,}, LoRA r*(d_in+d_out) = {rec.lora_params:,}"
    )


def group_id(row: str, module_type: str) -> str:
    """The id of a (layer row, module type) expert group, as heatmap cells and table rows refer to it."""
    return f"experts:{row}:{module_type}"


def heatmap(
    records: list[ModuleRecord],
    metric: str,
    axes: tuple[list[str], list[str]] | None = None,
    max_rank: int | None = None,
    layers: Iterable[LayerEntry] | None = None,
) -> Heatmap:
    """Layer x module-type grid of one record metric (mean_redundancy | k | captured_energy).

    A cell holding several modules (the experts of one layer) shows their mean, the hover their spread, and
    its name is the expert group's id (see :func:`group_id`). ``max_rank``: the bundle's cap on k (its scale).
    ``layers``: the layer selection that names the records' stack (see :func:`row_labels`; as for ``axes``).
    """
    if metric not in HEATMAP_METRICS:
        raise ValueError(f"unknown heatmap metric {metric!r}; one of {sorted(HEATMAP_METRICS)}")
    layers = None if layers is None else list(layers)
    rows, cols = axes or grid_axes(records, layers)
    row_of = row_labels(records, layers)[1]
    cells: dict[tuple[int, int], list[ModuleRecord]] = defaultdict(list)
    for rec in records:
        cells[rows.index(row_of[rec.name]), cols.index(rec.module_type)].append(rec)
    z: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    names: list[list[str | None]] = [[None] * len(cols) for _ in rows]
    hover = [[""] * len(cols) for _ in rows]
    for (i, j), recs in cells.items():
        values = [float(getattr(rec, metric)) for rec in recs]
        if len(recs) == 1:
            z[i][j] = int(values[0]) if metric == "k" else values[0]
            names[i][j], hover[i][j] = recs[0].name, module_hover(recs[0])
            continue
        z[i][j] = float(np.mean(values))
        experts = all(expert_of(rec.name) is not None for rec in recs)
        names[i][j] = group_id(rows[i], recs[0].module_type) if experts else recs[0].name
        hover[i][j] = group_hover(recs, metric, values, rows[i])
    scale = metric_scale(metric, records, max_rank)
    return Heatmap(metric, HEATMAP_METRICS[metric][0], rows, cols, z, names, hover, scale)


def group_hover(recs: list[ModuleRecord], metric: str, values: list[float], row: str) -> str:
    """Hover text of a cell (layer ``row``) holding several modules (experts): their number and the metric's
    spread."""
    fmt = HEATMAP_METRICS[metric][1]
    q = np.quantile(values, [0, 0.5, 1])
    what = "experts" if all(expert_of(rec.name) is not None for rec in recs) else "modules"
    head = f"<b>layer {row} · {recs[0].module_type}</b>: {len(recs)} {what}"
    return (
        f"{head}<br>[d_out, d_in] = [{recs[0].d_out}, {recs[0].d_in}]<br>{HEATMAP_METRICS[metric][0]}: "
        f"mean {np.mean(values):{fmt if fmt != 'd' else '.1f'}}, min {q[0]:{fmt if fmt != 'd' else '.0f'}}, "
        f"median {q[1]:{fmt if fmt != 'd' else '.0f'}}, max {q[2]:{fmt if fmt != 'd' else '.0f'}}"
        + ("<br>click: the experts of this layer" if what == "experts" else "")
    )


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
    scale = (min(a.scale[0], b.scale[0]), max(a.scale[1], b.scale[1]))
    return Heatmap(a.metric, f"change in {a.title}", a.rows, a.cols, z, a.names, hover, scale)


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
            ks = [k for rec in recs if (k := _k_at(rec, tau)) is not None]
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
    out_t: list[float] = []
    out_p: list[int] = []
    for tau in taus:
        ks = [k for rec in records if (k := _k_at(rec, tau)) is not None]
        if len(ks) == len(records):
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
    cum_energy: list[float | None]
    downsampled: bool
    zero_eigenvalues: int
    #: Where Q lies on this spectrum: "bottom" (PLATE: the bottom k directions), "top" (the high_energy_q ablation:
    #: the top k), "random" (random_q, random_bq: a random k-frame) or "base" (random_b, least_redundant_b: PLATE's Q
    #: kept, an eigenspace of the base bundle's frozen rows, not of these).
    q_directions: str = "bottom"
    variant: str | None = None

    @property
    def null_directions(self) -> int:
        """The d_in - n_stored exact null directions (eigenvalue 0), beyond the stored spectrum."""
        return self.d_in - self.n_stored

    @property
    def k_start(self) -> int:
        """First (1-based) direction spanned by Q."""
        return self.d_in - self.k + 1


#: Ablation kind (plate_inspect.train.variants) -> where its Q lies on the stored spectrum (see SpectrumView).
Q_DIRECTIONS = {
    "high_energy_q": "top",
    "random_q": "random",
    "random_bq": "random",
    "random_b": "base",
    "least_redundant_b": "base",
}


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
        q_directions=Q_DIRECTIONS.get(rec.variant or "", "bottom"),
        variant=rec.variant,
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
    variant: str | None = None

    @property
    def b_is_top(self) -> bool:
        """B holds the r highest scores (PLATE's choice); false for the random_b / least_redundant_b ablations."""
        return self.rest_max is None or self.b_min >= self.rest_max


def score_edges(score_arrays: list[np.ndarray], bins: int = DEFAULT_BINS) -> np.ndarray:
    """Common histogram edges spanning every given score array (so comparison histograms line up)."""
    lo = min(float(a.min()) for a in score_arrays)
    hi = max(float(a.max()) for a in score_arrays)
    if hi <= lo:
        hi = lo + 1e-6
    return np.linspace(lo, hi, bins + 1)


def score_histogram(
    name: str, scores: np.ndarray, b_idx: np.ndarray, edges: np.ndarray, variant: str | None = None
) -> ScoreHistogram:
    """Counts of scores per bin; cut-off = min score of B's rows (for PLATE, B = the top-r rows by score)."""
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
        variant=variant,
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
        # spectral health of W_frozen (plate_inspect.health), recorded by the scan; absent in older bundles
        "alpha": (rec.health or {}).get("alpha"),
        "stable_rank": (rec.health or {}).get("stable_rank"),
        "spikes": (rec.health or {}).get("num_spikes"),
    }


def b_overlap(a: np.ndarray, b: np.ndarray) -> float:
    """|B_a intersect B_b| / max(|B_a|, |B_b|): 1 when two bundles choose the same redundant rows."""
    sa, sb = set(np.asarray(a).tolist()), set(np.asarray(b).tolist())
    return len(sa & sb) / max(len(sa), len(sb), 1)


# --------------------------------------------------------------------------- experts
@dataclass
class ExpertGroup:
    """The experts of one layer and module type: one value per expert (in expert order) and compact spectra.

    Mixture-of-experts bundles hold tens of thousands of expert modules, so reports show experts per group:
    the distribution of k, captured energy and redundancy over the experts, and one expert at a time on
    drill-down (its spectrum from ``EXPERT_SPECTRUM_POINTS`` evenly spaced eigenvalues, as log10).
    """

    id: str
    layer: int | None
    module_type: str
    label: str  # the member names with the expert index as '*'
    shape: list[int]
    r: int
    names: list[str]
    experts: list[int]
    k: list[int]
    energy: list[float]
    score: list[float]
    spectrum_index: list[int] = field(default_factory=list)  # 1-based directions drawn (shared by the group)
    spectra: list[list[float | None]] = field(default_factory=list)  # log10 eigenvalues there (None: zero)
    #: Where Q lies on the experts' spectra (see SpectrumView.q_directions; an ablation bundle's kind is per bundle).
    q_directions: str = "bottom"
    variant: str | None = None

    @property
    def d_in(self) -> int:
        """The group's common input width (its shape's second entry)."""
        return self.shape[1]


def distribution(values: list[float]) -> dict[str, float]:
    """min, quartiles, max and mean of a list of numbers (a box plot's statistics)."""
    q = np.quantile(np.asarray(values, dtype=np.float64), [0, 0.25, 0.5, 0.75, 1])
    return {
        "min": float(q[0]),
        "q1": float(q[1]),
        "median": float(q[2]),
        "q3": float(q[3]),
        "max": float(q[4]),
        "mean": float(np.mean(values)),
    }


def group_label(name: str, expert: int) -> str:
    """'model.layers.3.mlp.experts.7.gate_proj' -> 'model.layers.3.mlp.experts.*.gate_proj' (also '<tensor>.7')."""
    if name.endswith(f".{expert}") and ".experts." in name[: -len(str(expert)) - 1]:
        return name[: -len(str(expert))] + "*"
    return name.replace(f".experts.{expert}.", ".experts.*.", 1)


def expert_groups(records: list[ModuleRecord]) -> list[ExpertGroup]:
    """Records with an expert index, grouped by (layer row, module type) in first-seen order, experts sorted."""
    row_of = row_labels(records)[1]
    groups: dict[tuple[str, str], list[tuple[int, ModuleRecord]]] = {}
    for rec in records:
        e = expert_of(rec.name)
        if e is not None:
            groups.setdefault((row_of[rec.name], rec.module_type), []).append((e, rec))
    out = []
    for (row, mtype), members in groups.items():
        members.sort(key=lambda m: m[0])
        first_e, first = members[0]
        out.append(
            ExpertGroup(
                id=group_id(row, mtype),
                layer=first.layer,
                module_type=mtype,
                label=group_label(first.name, first_e),
                shape=list(first.shape),
                r=first.r,
                names=[rec.name for _, rec in members],
                experts=[e for e, _ in members],
                k=[rec.k for _, rec in members],
                energy=[rec.captured_energy for _, rec in members],
                score=[rec.mean_redundancy for _, rec in members],
                q_directions=Q_DIRECTIONS.get(first.variant or "", "bottom"),
                variant=first.variant,
            )
        )
    return out


def add_expert_spectra(group: ExpertGroup, spectra: list[np.ndarray], points: int = EXPERT_SPECTRUM_POINTS) -> None:
    """Attach each expert's spectrum at ``points`` evenly spaced directions, as log10 with 3 digits."""
    n = max((len(s) for s in spectra), default=0)
    idx = display_indices(n, points)
    group.spectrum_index = (idx + 1).tolist()
    group.spectra = [
        [round(math.log10(v), 2) if v > 0 else None for v in np.asarray(s, dtype=np.float64)[idx[idx < len(s)]]]
        for s in spectra
    ]


def read_tensors(bundle: Bundle, names: list[str], kind: str) -> dict[str, np.ndarray]:
    """One stored tensor kind (spectrum | redundancy | plate_B_idx) of many modules, opening each part file once."""
    from safetensors import safe_open

    by_part: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_part[bundle.record(name).file].append(name)
    out: dict[str, np.ndarray] = {}
    for part, members in by_part.items():
        path = Path(bundle.path) / part
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in members:
                    tensor = f.get_tensor(f"{name}.{kind}")
                    if kind == "spectrum":  # drawn: checked with the scores against the scan's digest
                        check_scores(bundle, name, f.get_tensor(f"{name}.redundancy"), tensor)
                    elif kind == "plate_B_idx":
                        problem = stored_b_problem(bundle.record(name), tensor)
                        if problem:
                            raise bundle.damaged(name, problem)
                    out[name] = tensor.double().numpy()
        except BundleError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files / missing keys
            raise bundle.damaged(members[0], read_problem(e, f"{kind} tensors")) from None
    return out


def group_row(groups: list[ExpertGroup], b_overlaps: list[float] | None = None) -> dict[str, Any]:
    """One table row for an expert group (one group per bundle): means over experts, totals of parameters."""
    g = groups[0]
    n = len(g.names)
    row: dict[str, Any] = {
        "name": f"{g.label} [{n} experts]",
        "type": g.module_type,
        "layer": g.layer,
        "shape": f"{g.shape[0]}x{g.shape[1]}",
        "r": g.r,
        "k": round(float(np.mean(g.k)), 2),
        "energy": float(np.mean(g.energy)),
        "score": float(np.mean(g.score)),
        "plate": g.r * int(sum(g.k)),
        "lora": g.r * (g.shape[0] + g.shape[1]) * n,
        "group": g.id,
    }
    if len(groups) > 1:
        row["per_bundle"] = [
            {
                "r": x.r,
                "k": round(float(np.mean(x.k)), 2),
                "energy": float(np.mean(x.energy)),
                "score": float(np.mean(x.score)),
                "b_overlap": b_overlaps[j] if b_overlaps else 1.0,
            }
            for j, x in enumerate(groups)
        ]
    return row


# --------------------------------------------------------------------------- everything
@dataclass
class ModuleData:
    """Per-module tensors the report reads once (spectrum, scores, B) for every bundle."""

    spectra: list[np.ndarray]
    scores: list[np.ndarray]
    b_idx: list[np.ndarray]


def check_scores(bundle: Bundle, name: str, redundancy: torch.Tensor, spectrum: torch.Tensor) -> None:
    """BundleError when a module's stored redundancy scores or spectrum (as stored) differ from the digest its scan
    recorded: a damaged part file would otherwise be drawn as if it were the model's geometry."""
    rec = bundle.record(name)
    if rec.scores_digest and scores_digest(redundancy, spectrum) != rec.scores_digest:
        problem = "its stored redundancy scores or spectrum do not match the digest the scan recorded"
        raise bundle.damaged(name, problem)


def read_module(bundles: list[Bundle], name: str) -> ModuleData:
    """Read one module's spectrum, redundancy scores and B indices from every bundle (scores and spectrum checked
    against the scan's digest)."""
    spectra, scores = [], []
    for b in bundles:
        redundancy, spectrum = b.redundancy(name), b.spectrum(name)
        check_scores(b, name, redundancy, spectrum)
        spectra.append(spectrum.double().numpy())
        scores.append(redundancy.double().numpy())
    b_idx = [b.checked_b_idx(name).numpy() for b in bundles]  # drawn as the cut-off and B overlap
    return ModuleData(spectra=spectra, scores=scores, b_idx=b_idx)


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
    expert_groups: list[list[ExpertGroup]] = field(default_factory=list)  # per group: one per bundle

    def __repr__(self) -> str:
        """One line: the dataclass repr printed every plot's data (314 kB for MiniLM's 36 modules) in a notebook."""
        experts = sum(len(group[0].experts) for group in self.expert_groups)
        groups = f", expert_groups={len(self.expert_groups)} ({experts:,} experts)" if self.expert_groups else ""
        return (
            f"ReportData(labels={self.labels!r:.200}, modules={len(self.modules):,}, "
            f"spectra={len(self.spectra):,}{groups})"
        )


def report_data(
    bundles: list[Bundle],
    labels: list[str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    bins: int = DEFAULT_BINS,
    progress: ProgressCallback | None = None,
) -> ReportData:
    """Check the bundles and compute the data of every view; ``progress`` gets events counting modules.

    Modules outside expert groups get full spectra and score histograms; experts are aggregated per (layer,
    module type) group, with compact per-expert spectra for drill-down (see :class:`ExpertGroup`).
    """
    modules = check_bundles(bundles)
    labels = bundle_labels(bundles, labels)
    summaries = [bundle_summary(b, lab) for b, lab in zip(bundles, labels, strict=True)]
    per_bundle_records = [[b.record(n) for n in modules] for b in bundles]
    # a bundle of one stack of an encoder-decoder (--layers decoder:1) labels its rows by that stack, as a full one
    selections = [b.settings.layers for b in bundles if b.settings.layers is not None]
    layers = [entry for sel in selections for entry in sel] if selections else None
    axes = grid_axes(per_bundle_records[0], layers)
    heatmaps = [
        {m: heatmap(recs, m, axes, b.manifest.settings.max_rank, layers) for m in HEATMAP_METRICS}
        for b, recs in zip(bundles, per_bundle_records, strict=True)
    ]
    groups = list(zip(*(expert_groups(recs) for recs in per_bundle_records), strict=True))
    in_groups = {n for g in groups for n in g[0].names}
    dense = [n for n in modules if n not in in_groups]
    spectra: dict[str, list[SpectrumView]] = {}
    histograms: dict[str, list[ScoreHistogram]] = {}
    rows: dict[str, dict[str, Any]] = {}
    counter = ProgressCounter(as_callback(progress, "report_data"), len(modules), "modules")
    counter.start()
    for name in dense:
        md = read_module(bundles, name)
        spectra[name] = [spectrum_view(b, name, max_points, s) for b, s in zip(bundles, md.spectra, strict=True)]
        edges = score_edges(md.scores, bins)
        histograms[name] = [
            score_histogram(name, s, bi, edges, b.record(name).variant)
            for b, s, bi in zip(bundles, md.scores, md.b_idx, strict=True)
        ]
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
        rows[name] = row
        counter.step(name)
    for group in groups:
        ref = group[0]
        for b, g in zip(bundles, group, strict=True):  # every bundle's experts can be drilled into
            stored = read_tensors(b, g.names, "spectrum")
            add_expert_spectra(g, [stored[n] for n in g.names])
        overlaps = None
        if len(bundles) > 1:
            b_sets = [read_tensors(b, ref.names, "plate_B_idx") for b in bundles]
            overlaps = [float(np.mean([b_overlap(b_sets[0][n], bs[n]) for n in ref.names])) for bs in b_sets]
        rows[ref.names[0]] = group_row(list(group), overlaps)
        counter.step(ref.id, units=len(ref.names))
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
        table=[rows[n] for n in modules if n in rows],
        max_points=max_points,
        expert_groups=[list(g) for g in groups],
    )


def overlap_heatmap(base: Heatmap, overlaps: dict[str, float], title: str) -> Heatmap:
    """A per-module value (e.g. B overlap between two bundles) on the axes and cells of an existing heatmap."""
    z = [[None if n is None else overlaps.get(n) for n in row] for row in base.names]
    hover = [
        ["" if n is None else f"<b>{n}</b><br>{title} = {overlaps.get(n, float('nan')):.4f}" for n in row]
        for row in base.names
    ]
    return Heatmap("b_overlap", title, base.rows, base.cols, z, base.names, hover, (0.0, 1.0))
