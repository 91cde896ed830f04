"""Plotly figure specs (plain JSON-able dicts) built from :mod:`plate_inspect.reports.data` records.

The page draws them with ``Plotly.newPlot(div, fig.data, fig.layout)``. Per-module figures (spectrum, score
histogram) exist for every module; to keep the file small they carry only their own layout keys, and the
page merges them over :data:`SPECTRUM_BASE` / :data:`HISTOGRAM_BASE`.
"""

from __future__ import annotations

import math
from typing import Any

from plate_inspect.reports.data import (
    ExpertGroup,
    Heatmap,
    KTauCurve,
    ScoreHistogram,
    SpectrumView,
    _sig,
    distribution,
)

#: plotly's default qualitative palette: module types (k(tau)) and bundles (spectra, histograms).
PALETTE = ["#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880", "#ff97ff"]
DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
#: Captured energies below this are drawn at this value on the log10 colour scale.
ENERGY_FLOOR = 1e-16
FONT = {"family": "DejaVu Sans, Helvetica, Arial, sans-serif", "size": 12}

Figure = dict[str, Any]


def color(i: int) -> str:
    """The i-th series colour, cycling through the palette."""
    return PALETTE[i % len(PALETTE)]


def plot_text(text: str) -> str:
    """``text`` (a bundle label, a module name) as plotly shows it: plotly reads titles, legend names, annotations
    and hover text as pseudo-HTML, so a label such as ``<base>`` vanished as an unknown tag and ``a<b`` cut the rest
    off; its entities ``&lt;`` ``&gt;`` ``&amp;`` show the characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


#: The most characters of a bundle label in plot text: a heatmap is ~470 px wide, and its subtitle names two bundles
#: ("ft minus base"). Longer labels keep their start and end around "…" (the page header and table show them whole).
PLOT_LABEL_CHARS = 16


def _middle_cut(label: str, width: int) -> str:
    """``label`` cut to ``width`` characters around an ellipsis, keeping more of the end (a run's suffix, -v2)."""
    if len(label) <= width:
        return label
    head = (width - 1) * 2 // 5
    return label[:head] + "…" + label[len(label) - (width - 1 - head) :]


def plot_labels(labels: list[str]) -> list[str]:
    """The bundle labels as plot text: at most :data:`PLOT_LABEL_CHARS` characters where the cut ones stay distinct
    (a long hub id or path ran off the plot: titles and legends are clipped at the figure's edge), then escaped
    (:func:`plot_text`)."""
    longest = max((len(label) for label in labels), default=0)
    for width in range(PLOT_LABEL_CHARS, longest + 1):
        short = [_middle_cut(label, width) for label in labels]
        if len(set(short)) == len(short):
            return [plot_text(label) for label in short]
    return [plot_text(label) for label in labels]


def _base_layout(title: str, height: int = 380) -> dict[str, Any]:
    return {
        # the title hangs from the top of the figure, below plotly's mode bar; its lines flow downwards
        "title": {
            "text": title,
            "font": {"size": 14},
            "x": 0,
            "xref": "paper",
            "xanchor": "left",
            "y": 1,
            "yref": "container",
            "yanchor": "top",
            "pad": {"t": 36},
        },
        "height": height,
        "margin": {"l": 60, "r": 20, "t": 74, "b": 50},
        "font": FONT,
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "hoverlabel": {"align": "left"},
    }


def _line_label(
    x: float,
    y: float,
    text: str,
    font: dict[str, Any],
    yanchor: str = "top",
    span: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """A label at data x, paper y (the top or bottom of a marked line or band) on a white backing, ending at x; with
    the x axis' ``span``, on the side of x with more room (starting at x in the left half of the axis: a label
    ending at a line near the left edge ran out of the plot, as one starting at a line near the right edge)."""
    lo, hi = span if span is not None else (x, x)
    return {
        "x": x,
        "y": y,
        "xref": "x",
        "yref": "paper",
        "text": text,
        "showarrow": False,
        "xanchor": "left" if x < (lo + hi) / 2 else "right",
        "yanchor": yanchor,
        "bgcolor": "rgba(255,255,255,0.8)",
        "font": font,
    }


def _vline(x: float, color_: str, dash: str = "dash", yref: str = "paper") -> dict[str, Any]:
    return {
        "type": "line",
        "xref": "x",
        "yref": yref,
        "x0": x,
        "x1": x,
        "y0": 0,
        "y1": 1,
        "line": {"color": color_, "width": 2, "dash": dash},
    }


# --------------------------------------------------------------------------- heatmaps
def heatmap_figure(hm: Heatmap, subtitle: str = "", difference: bool = False) -> Figure:
    """Layer (rows) x module type (columns) heatmap; hover shows the module's exact numbers."""
    trace: dict[str, Any] = {
        "type": "heatmap",
        "z": hm.z,
        "x": hm.cols,
        "y": hm.rows,
        "text": hm.hover,
        "hovertemplate": "%{text}<extra></extra>",
        "xgap": 1,
        "ygap": 1,
        "colorbar": {"thickness": 12, "len": 0.9},
    }
    if difference:
        trace.update(colorscale="RdBu", reversescale=True)
    else:
        trace["colorscale"] = "Viridis"
    if hm.metric == "captured_energy" and not difference:
        # energies span many decades (Q in an exact null space captures ~1e-13): colour by log10
        trace["z"] = [[None if v is None else math.log10(max(v, ENERGY_FLOOR)) for v in row] for row in hm.z]
        trace["colorbar"]["title"] = {"text": "log10", "side": "right"}
    trace["zmin"], trace["zmax"] = color_range(hm, difference)
    title = hm.title + (f"<br><span style='font-size:11px;color:#666'>{subtitle}</span>" if subtitle else "")
    layout = _base_layout(title, height=max(300, 90 + 16 * len(hm.rows)))
    layout["margin"] = {"l": 60, "r": 10, "t": 92 if subtitle else 74, "b": 110}
    layout["xaxis"] = {"type": "category", "tickangle": -35, "automargin": True}
    layout["yaxis"] = {"type": "category", "autorange": "reversed", "title": {"text": "layer"}, "automargin": True}
    fit_tall_heatmap(trace, layout, len(hm.rows))
    return {"data": [trace], "layout": layout}


#: A layer x type heatmap with more rows than this is taller than a screen (16 px a row): see fit_tall_heatmap.
TALL_HEATMAP_ROWS = 40
#: The colour bar's length in pixels on a tall heatmap.
TALL_COLORBAR_PX = 300


def fit_tall_heatmap(trace: dict[str, Any], layout: dict[str, Any], rows: int) -> None:
    """Keep a tall heatmap (a model of more than :data:`TALL_HEATMAP_ROWS` layers, drawn several screens high)
    readable where the page shows it first: the module types labelled on top, and a colour bar of fixed length at
    the top, instead of labels only below the last layer and a bar 0.9 of the plot's height long, its ticks screens
    apart. Shorter heatmaps are left as they are."""
    if rows <= TALL_HEATMAP_ROWS:
        return
    xaxis = layout.setdefault("xaxis", {})
    xaxis.update(side="top", automargin=True)
    # the slanted labels go between the title and the plot
    margin = layout.setdefault("margin", {})
    margin["t"] = margin.get("t", 74) + slanted_labels_px(trace.get("x", []), xaxis.get("tickangle", -35))
    bar = trace.setdefault("colorbar", {})
    bar.update(lenmode="pixels", len=TALL_COLORBAR_PX, y=1, yanchor="top")


def slanted_labels_px(labels: list[Any], angle: float) -> int:
    """The height (px) that axis labels slanted by ``angle`` degrees take at 12 px (~7 px a character), plus a gap."""
    longest = max((len(str(x)) for x in labels), default=0)
    return 12 + math.ceil(7 * longest * math.sin(math.radians(abs(angle))))


def color_range(hm: Heatmap, difference: bool = False) -> tuple[float, float]:
    """The explicit colour range of a heatmap (plotly's autoscale colours a single cell, or equal cells, on
    value +- 0.5, so the colour says nothing).

    - k: [0, the most columns Q can have]; captured energy: log10 [1e-16, 1] (the share Q captures, absolute);
      B overlap: [0, 1]; mean redundancy: [0, the largest cell] (scores of real weights lie far below 1, so [0, 1]
      would paint every cell alike), or [0, 1] when the cells do not differ (one module).
    - changes: symmetric about 0, to the largest change; a single cell, or no change anywhere, on +- the metric's
      whole range (a lone change is not drawn as the largest there could be).
    """
    lo, hi = hm.scale
    values = [v for row in hm.z for v in row if v is not None]
    if difference:
        largest = max((abs(v) for v in values), default=0.0)
        half = largest if len(values) > 1 and largest > 0 else hi - lo
        return (-half, half)
    if hm.metric == "captured_energy":
        return (math.log10(max(lo, ENERGY_FLOOR)), math.log10(hi))
    if hm.metric == "mean_redundancy" and len(set(values)) > 1 and max(values) > lo:
        return (lo, max(values))
    return (lo, hi)


# --------------------------------------------------------------------------- k(tau)
def ktau_figure(curves: list[list[KTauCurve]], taus: list[float], labels: list[str]) -> Figure:
    """Mean k over each module type's modules vs tau (min..max on hover); each bundle's tau marked."""
    types: list[str] = []
    for per_bundle in curves:
        for c in per_bundle:
            if c.module_type not in types:
                types.append(c.module_type)
    multi = len(curves) > 1
    data: list[dict[str, Any]] = []
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    xs = [t for per_bundle in curves for c in per_bundle for t in c.taus] + list(taus)
    span = (min(xs), max(xs))  # the x axis (autoranged over the curves and the marked taus)
    for b, (per_bundle, tau, label) in enumerate(zip(curves, taus, labels, strict=True)):
        for c in per_bundle:
            col = color(types.index(c.module_type))
            name = f"{c.module_type} ({label})" if multi else c.module_type
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": name,
                    "legendgroup": c.module_type,
                    "x": c.taus,
                    "y": [_sig(v) for v in c.mean_k],
                    "customdata": [[lo, hi] for lo, hi in zip(c.min_k, c.max_k, strict=True)],
                    "hovertemplate": (
                        f"<b>{name}</b><br>tau = %{{x}}<br>mean k = %{{y:.1f}}"
                        f"<br>min..max k = %{{customdata[0]}}..%{{customdata[1]}}<br>{c.modules} modules<extra></extra>"
                    ),
                    "line": {"color": col, "dash": DASHES[b % len(DASHES)], "width": 2},
                    "marker": {"size": 5},
                }
            )
            at = [i for i, t in enumerate(c.taus) if abs(t - tau) < 1e-9]
            if at:
                data.append(
                    {
                        "type": "scatter",
                        "mode": "markers",
                        "showlegend": False,
                        "legendgroup": c.module_type,
                        "x": [tau],
                        "y": [_sig(c.mean_k[at[0]])],
                        "hovertemplate": f"<b>{name}</b><br>bundle tau = {tau}<br>mean k = %{{y:.1f}}<extra></extra>",
                        "marker": {"symbol": "star", "size": 13, "color": col, "line": {"color": "black", "width": 1}},
                    }
                )
        shapes.append(_vline(tau, "#444", DASHES[(b + 1) % len(DASHES)]))
        text = f"tau = {tau:g}" + (f" ({label})" if multi else " (this bundle)")
        annotations.append(_line_label(tau, 1.0 - 0.07 * b, text, {"size": 11}, span=span))
    layout = _base_layout("k(tau) per module type (mean over its modules)", height=420)
    layout.update(
        xaxis={"title": {"text": "tau (energy fraction of the top directions Q avoids)"}},
        yaxis={"title": {"text": "k = dim Q"}, "rangemode": "tozero"},
        shapes=shapes,
        annotations=annotations,
        legend={"font": {"size": 10}},
    )
    return {"data": data, "layout": layout}


def params_tau_figure(
    params_tau: list[tuple[list[float], list[int]]], taus: list[float], lora: list[int], labels: list[str]
) -> Figure:
    """Total PLATE trainable parameters sum(r*k(tau)) vs tau, with LoRA's r*(d_in+d_out) at the same r."""
    multi = len(labels) > 1
    data, shapes = [], []
    for b, ((ts, ps), tau, lo, label) in enumerate(zip(params_tau, taus, lora, labels, strict=True)):
        col = color(b)
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": f"PLATE r*k ({label})" if multi else "PLATE r*k",
                "x": ts,
                "y": ps,
                "line": {"color": col, "dash": DASHES[b % len(DASHES)]},
                "hovertemplate": "tau = %{x}<br>PLATE params = %{y:,}<extra></extra>",
            }
        )
        if ts:
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "name": f"LoRA r*(d_in+d_out) ({label})" if multi else "LoRA r*(d_in+d_out), same r",
                    "x": [min(ts), max(ts)],
                    "y": [lo, lo],
                    "line": {"color": col, "dash": "dot", "width": 1},
                    "hovertemplate": f"LoRA at the same r = {lo:,}<extra></extra>",
                }
            )
        shapes.append(_vline(tau, col, DASHES[(b + 1) % len(DASHES)]))
    layout = _base_layout("Trainable parameters vs tau, all modules", height=420)
    layout.update(
        xaxis={"title": {"text": "tau"}},
        yaxis={"title": {"text": "parameters"}, "rangemode": "tozero"},
        shapes=shapes,
        legend={"font": {"size": 10}},
    )
    return {"data": data, "layout": layout}


# --------------------------------------------------------------------------- per-module: spectrum
#: Layout keys shared by every spectrum figure (the page merges each module's own keys over it).
SPECTRUM_BASE: dict[str, Any] = {
    **_base_layout("", height=430),
    "yaxis": {
        "type": "log",
        "title": {"text": "eigenvalue (log scale)"},
        "exponentformat": "power",
        "minorloglabels": "none",
    },
    "yaxis2": {
        "overlaying": "y",
        "side": "right",
        "range": [0, 1.02],
        "tickmode": "linear",
        "tick0": 0,
        "dtick": 0.2,
        "title": {"text": "cumulative energy"},
        "showgrid": False,
    },
    "legend": {"orientation": "h", "y": -0.24, "font": {"size": 10}},
    "margin": {"l": 70, "r": 60, "t": 80, "b": 90},
}


def _spectrum_traces(v: SpectrumView, col: str, label: str, multi: bool) -> list[dict[str, Any]]:
    """Eigenvalues (log axis) and cumulative energy (right axis) of one bundle's view."""
    suffix = f" ({label})" if multi else ""
    return [
        {
            "type": "scatter",
            "mode": "lines",
            "name": "eigenvalues" + suffix,
            "x": v.index,
            "y": v.values,
            "line": {"color": col, "width": 2},
            "hovertemplate": "direction %{x}<br>eigenvalue %{y:.4e}<extra>" + (label if multi else "") + "</extra>",
        },
        {
            "type": "scatter",
            "mode": "lines",
            "name": "cumulative energy" + suffix,
            "x": v.index,
            "y": v.cum_energy,
            "yaxis": "y2",
            "line": {"color": col, "width": 1, "dash": "dot"},
            "hovertemplate": "directions 1..%{x} hold %{y:.4f} of the energy<extra></extra>",
        },
    ]


#: Paper height between two bundles' tau-cut labels (two lines of 10 px text in the spectrum plot's ~260 px).
TAU_LABEL_STEP = 0.13


def _tau_cut(v: SpectrumView, b: int, col: str, suffix: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The tau cut (the top m_tau directions hold >= tau of the energy): a vertical line after direction m_tau,
    a horizontal one at tau on the cumulative axis, and its label."""
    shapes = [
        _vline(v.m_tau + 0.5, col, "dash"),
        {
            "type": "line",
            "xref": "paper",
            "yref": "y2",
            "x0": 0,
            "x1": 1,
            "y0": v.tau,
            "y1": v.tau,
            "line": {"color": col, "width": 1, "dash": "dot"},
        },
    ]
    # two lines, each at most ~45 characters (the label cut to 16): a cut near the middle of a 700 px plot leaves
    # ~290 px either side, which the one-line label (~380 px with a bundle label) ran past
    text = f"tau={v.tau:g} cut: top {v.m_tau} directions<br>hold {v.tau:g} of the energy{suffix}"
    span = (0.5, v.d_in + 0.5)
    return shapes, _line_label(v.m_tau + 0.5, 1.0 - TAU_LABEL_STEP * b, text, {"size": 10, "color": col}, span=span)


def _q_band(v: SpectrumView, b: int, col: str, suffix: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Q's directions d_in-k+1 .. d_in (PLATE; 1..k for the high_energy_q ablation): a solid strip at the bottom
    (one row per bundle), a faint full-height shade, and its label. An ablation whose Q is no eigenspace of this
    spectrum (random_q, random_bq; random_b and least_redundant_b keep PLATE's Q) gets the label only."""
    first, last = (1, v.k) if v.q_directions == "top" else (v.k_start, v.d_in)
    y_label = 0.04 * (b + 1) + 0.06 * b
    if v.q_directions in ("random", "base"):
        # ~85 characters with a cut label: it ends at the plot's right edge and must fit in its ~570 px
        what = "a random orthonormal k-frame" if v.q_directions == "random" else "PLATE's Q of the base bundle's rows"
        text = f"Q: k={v.k}, no band drawn (ablation {v.variant}: {what})" + suffix
        return [], _line_label(v.d_in + 0.5, y_label, text, {"size": 10, "color": col}, yanchor="bottom")

    def rect(y0: float, y1: float, opacity: float) -> dict[str, Any]:
        return {
            "type": "rect",
            "xref": "x",
            "yref": "paper",
            "x0": first - 0.5,
            "x1": last + 0.5,
            "y0": y0,
            "y1": y1,
            "fillcolor": col,
            "opacity": opacity,
            "line": {"width": 0},
        }

    where = "top" if v.q_directions == "top" else "bottom"
    ablation = f", ablation {v.variant}" if v.variant else ""
    text = f"Q: {where} k={v.k} directions ({first}..{last}{ablation})" + suffix
    label = _line_label(v.d_in + 0.5, y_label, text, {"size": 10, "color": col}, yanchor="bottom")
    return [rect(0.04 * b, 0.04 * (b + 1), 0.35), rect(0, 1, 0.06)], label


def _spectrum_note(v: SpectrumView) -> str:
    """What the plot leaves out: downsampling, null directions, zero eigenvalues (log axis)."""
    parts = []
    if v.downsampled:
        parts.append(f"display downsampled: {len(v.index)} of {v.n_stored:,} eigenvalues (evenly spaced)")
    if v.null_directions:
        parts.append(f"{v.null_directions} null directions (eigenvalue 0) at {v.n_stored + 1}..{v.d_in} not drawn")
    if v.zero_eigenvalues:
        parts.append(f"{v.zero_eigenvalues} stored zero eigenvalues not drawn (log axis)")
    return "<br>".join(parts)


def spectrum_figure(views: list[SpectrumView], labels: list[str]) -> Figure:
    """Log-scale spectrum (+ cumulative energy) of one module, tau cut and Q's bottom-k directions marked.

    Returns only the module-specific layout keys; merge over :data:`SPECTRUM_BASE` to draw.
    """
    multi = len(views) > 1
    data, shapes, annotations, notes = [], [], [], []
    for b, (v, label) in enumerate(zip(views, labels, strict=True)):
        col, suffix = color(b), (f" ({label})" if multi else "")
        data += _spectrum_traces(v, col, label, multi)
        for marks, text in (_tau_cut(v, b, col, suffix), _q_band(v, b, col, suffix)):
            shapes += marks
            annotations.append(text)
        note = _spectrum_note(v)
        if note:
            notes.append((f"{label}: " if multi else "") + note)
    sub = "<br>".join(notes)
    title = f"Energy spectrum: {plot_text(views[0].name)}"
    if sub:
        title += f"<br><span style='font-size:11px;color:#666'>{sub}</span>"
    layout = {
        "title": {"text": title},
        "margin": {"t": 78 + 15 * (sub.count("<br>") + 1 if sub else 0)},
        "xaxis": {
            "title": {"text": "eigen-direction (descending eigenvalue)"},
            "range": [0.5, max(v.d_in for v in views) + 0.5],
        },
        "shapes": shapes,
        "annotations": annotations,
    }
    return {"data": data, "layout": layout}


# --------------------------------------------------------------------------- per-module: scores
HISTOGRAM_BASE: dict[str, Any] = {
    **_base_layout("", height=430),
    "barmode": "overlay",
    "bargap": 0.02,
    "xaxis": {"title": {"text": "redundancy score (mean |cos| to anchor rows)"}},
    "yaxis": {"title": {"text": "output rows"}},
    "legend": {"orientation": "h", "y": -0.24, "font": {"size": 10}},
    "margin": {"l": 60, "r": 20, "t": 78, "b": 90},
}


def histogram_figure(hists: list[ScoreHistogram], labels: list[str]) -> Figure:
    """Histogram of one module's redundancy scores; the top-r cut-off (B's lowest score) marked."""
    multi = len(hists) > 1
    data, shapes, annotations = [], [], []
    for b, (h, label) in enumerate(zip(hists, labels, strict=True)):
        col = color(b)
        centers = [_sig((lo + hi) / 2, 5) for lo, hi in zip(h.edges[:-1], h.edges[1:], strict=True)]
        width = h.edges[1] - h.edges[0]
        data.append(
            {
                "type": "bar",
                "name": f"scores ({label})" if multi else "scores",
                "x": centers,
                "y": h.counts,
                "width": width,
                "marker": {"color": col},
                "opacity": 0.55 if multi else 0.85,
                "hovertemplate": f"scores %{{x:.4f}} ± {width / 2:.2g}<br>%{{y}} rows<extra></extra>",
            }
        )
        if h.b_is_top:
            shapes.append(_vline(h.cutoff, col, "dash"))
            text = f"B: top r={h.r} of {h.d_out} rows, score >= {h.cutoff:.4g}"
        else:  # an ablation's B (random or least redundant rows): no cut-off to draw
            how = f" (ablation {h.variant})" if h.variant else ""
            text = f"B: r={h.r} of {h.d_out} rows, not the r highest scores{how}; B's lowest score {h.b_min:.4g}"
        text += f" ({label})" if multi else ""
        span = (h.edges[0], h.edges[-1])
        annotations.append(_line_label(h.cutoff, 1.0 - 0.08 * b, text, {"size": 10, "color": col}, span=span))
    layout = {
        "title": {"text": f"Redundancy scores: {plot_text(hists[0].name)}"},
        "shapes": shapes,
        "annotations": annotations,
    }
    return {"data": data, "layout": layout}


# --------------------------------------------------------------------------- experts
#: Record attribute -> ExpertGroup field, for the per-layer distributions over experts.
EXPERT_METRICS = {"k": "k", "captured_energy": "energy", "mean_redundancy": "score"}


def expert_box_figure(groups: list[list[ExpertGroup]], metric: str, labels: list[str] | None = None) -> Figure:
    """Per layer, the distribution over experts (min, quartiles, max, mean) of one metric; one box per module
    type and bundle (``groups[b]``: bundle b's groups; several bundles: boxes side by side, named
    'type [label]'). Statistics are computed here, so the page carries 6 numbers per box, not one per expert."""
    types: list[str] = []
    for g in groups[0]:
        if g.module_type not in types:
            types.append(g.module_type)
    labels = labels or [str(b) for b in range(len(groups))]
    floor = ENERGY_FLOOR if metric == "captured_energy" else -math.inf  # log axis: exact zeros at the floor
    data = []
    for t, mtype in enumerate(types):
        for b, bundle_groups in enumerate(groups):
            members = [g for g in bundle_groups if g.module_type == mtype]
            stats = [distribution([max(v, floor) for v in getattr(g, EXPERT_METRICS[metric])]) for g in members]
            data.append(
                {
                    "type": "box",
                    "name": mtype if len(groups) == 1 else f"{mtype} [{labels[b]}]",
                    "x": [str(g.layer) for g in members],
                    "lowerfence": [_sig(s["min"]) for s in stats],
                    "q1": [_sig(s["q1"]) for s in stats],
                    "median": [_sig(s["median"]) for s in stats],
                    "q3": [_sig(s["q3"]) for s in stats],
                    "upperfence": [_sig(s["max"]) for s in stats],
                    "mean": [_sig(s["mean"]) for s in stats],
                    "boxpoints": False,
                    "marker": {"color": color(t * len(groups) + b)},
                    "line": {"width": 1},
                }
            )
    title = {"k": "k over experts", "captured_energy": "captured energy over experts (log)"}.get(
        metric, "mean redundancy over experts"
    )
    layout = _base_layout(title, height=400)
    layout.update(
        boxmode="group",
        xaxis={"type": "category", "title": {"text": "layer"}},
        yaxis={"title": {"text": metric}, **({"type": "log"} if metric == "captured_energy" else {})},
        legend={"orientation": "h", "y": -0.2, "font": {"size": 10}},
    )
    return {"data": data, "layout": layout}


#: Drill-down into one expert group: the page fills x (expert index), y (k) and customdata per group.
EXPERT_BARS_BASE: Figure = {
    "data": [
        {
            "type": "bar",
            "name": "k",
            "marker": {"colorscale": "Viridis", "colorbar": {"title": {"text": "mean score"}, "thickness": 12}},
            "hovertemplate": (
                "expert %{x}<br>k = %{y}<br>captured energy = %{customdata[0]:.3e}"
                "<br>mean redundancy = %{customdata[1]:.4f}<extra></extra>"
            ),
        }
    ],
    "layout": {
        **_base_layout("", height=400),
        "xaxis": {"title": {"text": "expert (click one for its spectrum)"}},
        "yaxis": {"title": {"text": "k = dim Q"}, "rangemode": "tozero"},
        "bargap": 0.05,
    },
}
#: One expert's spectrum from its group's compact log10 values; the page fills x, y, the Q band and the title.
EXPERT_SPECTRUM_BASE: Figure = {
    "data": [{"type": "scatter", "mode": "lines+markers", "name": "eigenvalues", "marker": {"size": 4}}],
    "layout": {
        **SPECTRUM_BASE,
        "showlegend": False,
        "xaxis": {"title": {"text": "eigen-direction (descending eigenvalue)"}},
    },
}
