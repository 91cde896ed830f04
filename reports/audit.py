"""The audit section of the HTML report: a fine-tune's per-module scores as plotly figures and a ranked table.

:func:`audit_section` returns an HTML fragment (needs plotly.js on the page); :func:`write_audit_report` writes a
self-contained page (plotly.js inlined, data embedded, no network).
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from plate_inspect.auditing import (
    TABLE_COLUMNS,
    AuditRecord,
    audit_notes,
    rank_by_risk,
    rounding_kind,
    summarize,
    table_cells,
)
from plate_inspect.reports.figures import fit_tall_heatmap, slanted_labels_px
from plate_inspect.targets import LayerEntry, layer_rows, module_type_of

_MAX_BARS = 40


def audit_figures(records: list[AuditRecord], layers: Iterable[LayerEntry] | None = None) -> dict[str, dict[str, Any]]:
    """Plotly specs: risk bars (top modules), protected share vs chance, and a layer x type heatmap. ``layers``: the
    audit's layer selection; where it names the one stack the records lie in ('decoder:1'), the heatmap's rows carry
    that stack's name ('decoder 1'), as an audit of both stacks does (``layer_rows``)."""
    heat = _share_heatmap(records, layers)
    return {"bars": _risk_bars(records), "scatter": _share_scatter(records), **({"heatmap": heat} if heat else {})}


def _risk_bars(records: list[AuditRecord]) -> dict[str, Any]:
    """The highest-risk modules as bars (modules the fine-tune left unchanged are left out: they have no risk)."""
    unchanged = sum(1 for r in records if r.delta_norm == 0)
    ranked = rank_by_risk([r for r in records if r.delta_norm > 0])[:_MAX_BARS]
    left_out = f" ({unchanged} unchanged modules left out)" if unchanged else ""
    return {
        "data": [
            {
                "type": "bar",
                "x": [r.module for r in ranked],
                "y": [r.risk for r in ranked],
                "marker": {"color": "#ef553b"},
                "hovertemplate": "%{x}<br>risk ||dW P||/||W|| = %{y:.3e}<extra></extra>",
            }
        ],
        "layout": {
            "title": {"text": f"Risk ||dW P||_F / ||W||_F, highest {len(ranked)} modules{left_out}"},
            "yaxis": {"title": {"text": "risk"}},
            "xaxis": {"automargin": True, "tickangle": -45},
            "height": 460,
        },
    }


def _share_scatter(records: list[AuditRecord]) -> dict[str, Any]:
    """Protected input share against a dense random update's (the diagonal), coloured by frozen-row share; modules
    the fine-tune left unchanged have no share and are left out (at 0 they would look like PLATE's form)."""
    unchanged = sum(1 for r in records if r.delta_norm == 0)
    records = [r for r in records if r.delta_norm > 0]
    xs = [r.chance_share for r in records]
    left_out = f" ({unchanged} unchanged modules left out)" if unchanged else ""
    return {
        "data": [
            {
                "type": "scatter",
                "mode": "markers",
                "x": xs,
                "y": [r.protected_input_share for r in records],
                "text": [r.module for r in records],
                "marker": {
                    "color": [r.frozen_row_share for r in records],
                    "colorscale": "Viridis",
                    "cmin": 0,
                    "cmax": 1,
                    "colorbar": {"title": {"text": "frozen-row share"}},
                    "size": 9,
                },
                "hovertemplate": "%{text}<br>chance m/d_in %{x:.3f}<br>protected share %{y:.4f}<extra></extra>",
                "name": "modules",
            },
            {
                "type": "scatter",
                "mode": "lines",
                "x": [0, 1],
                "y": [0, 1],
                "line": {"dash": "dash", "color": "#888"},
                "name": "dense random update",
                "hoverinfo": "skip",
            },
        ],
        "layout": {
            "title": {"text": f"Protected input share vs a random update's (m/d_in); PLATE's form sits at 0{left_out}"},
            "xaxis": {"title": {"text": "chance share m(tau)/d_in"}, "range": [0, 1]},
            "yaxis": {"title": {"text": "||dW P||^2 / ||dW||^2"}, "range": [-0.02, 1.02]},
            "legend": {"orientation": "h", "y": -0.2},  # beside the colour bar, the two overlapped
            "height": 460,
        },
    }


def _share_cell(members: list[AuditRecord]) -> tuple[float | None, str]:
    """One heatmap cell: the energy-weighted protected share of its modules (None: none changed) and its hover."""
    if not members:
        return None, ""
    s = summarize(members)
    what = members[0].module if len(members) == 1 else f"{len(members)} modules, {s.touched} changed"
    return (s.protected_input_share, what) if s.touched else (None, f"{what}: unchanged")


def _share_heatmap(records: list[AuditRecord], layers: Iterable[LayerEntry] | None = None) -> dict[str, Any] | None:
    """Protected input share per layer and module type (None when no module sits in a numbered layer). A cell of
    several modules (the experts of a layer) holds their energy-weighted share, sum ||dW P||^2 / sum ||dW||^2, as
    the model line does; a cell whose modules the fine-tune left unchanged is empty (it has no share)."""
    rows, row_of = layer_rows((r.module for r in records), layers)  # per layer stack where there are several
    types = sorted({module_type_of(r.module) for r in records})
    if not rows:
        return None
    cells: dict[tuple[str | None, str], list[AuditRecord]] = {}
    for r in records:
        cells.setdefault((row_of[r.module], module_type_of(r.module)), []).append(r)
    shown = [[_share_cell(cells.get((lay, t), [])) for t in types] for lay in rows]
    figure: dict[str, Any] = {
        "data": [
            {
                "type": "heatmap",
                "x": types,
                "y": rows,
                "z": [[value for value, _ in row] for row in shown],
                "text": [[what for _, what in row] for row in shown],
                "zmin": 0,
                "zmax": 1,
                "colorscale": "Reds",
                "hovertemplate": "layer %{y} %{x}<br>%{text}<br>protected share %{z:.4f}<extra></extra>",
            }
        ],
        "layout": {
            "title": {"text": "Protected input share by layer and module type"},
            "xaxis": {"automargin": True, "tickangle": -35},
            "yaxis": {"title": {"text": "layer"}, "type": "category", "autorange": "reversed"},
            # 22 px a layer besides the title and the slanted type names (a 3-layer heatmap was squeezed to ~10 px
            # rows below long names such as mlp.shared_experts.down_proj)
            "height": 140 + 22 * len(rows) + slanted_labels_px(types, -35),
        },
    }
    fit_tall_heatmap(figure["data"][0], figure["layout"], len(rows))
    return figure


def _table(records: list[AuditRecord]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in TABLE_COLUMNS)
    rows = [
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in table_cells(r)) + "</tr>" for r in rank_by_risk(records)
    ]
    return f"<table class='audit'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def audit_section(records: list[AuditRecord], title: str = "Audit", layers: Iterable[LayerEntry] | None = None) -> str:
    """An HTML fragment: summary line, figures (drawn by an inline script with Plotly; ``layers``: see
    :func:`audit_figures`) and the ranked table."""
    s = summarize(records)
    figs = audit_figures(records, layers)
    divs = "".join(f"<div id='audit-{key}' class='plot audit-plot'></div>" for key in figs)
    data = json.dumps(figs).replace("</", "<\\/")
    # the plots' promises are kept for the page's readiness signal (render_audit_page), which reports.browser waits on
    script = (
        f"<script>(function(){{const figs={data};"
        "for (const [k, f] of Object.entries(figs)) {window.__auditPlots = (window.__auditPlots || []).concat("
        "[Plotly.newPlot('audit-' + k, f.data, f.layout, {responsive: true, displaylogo: false})]);}})();</script>"
    )
    model = (
        f"Energy-weighted protected input share <b>{s.protected_input_share:.4f}</b>, frozen-row share "
        f"<b>{s.frozen_row_share:.4f}</b>; ||dW||/||W|| = {s.relative_delta:.3e}; model risk "
        f"sqrt(Σ||dW P||²/Σ||W||²) = <b>{s.risk:.3e}</b>."
        if s.touched
        else "The tuned weights equal the base's in every audited module: there is no update to score."
    )
    rounding = rounding_kind(records)
    if not s.touched and rounding:
        model = f"No update beyond {rounding}: the tuned weights equal the base's rounded to their storage."
    notes = audit_notes(records)
    summary = (
        f"<p>{s.touched} of {s.modules} modules changed. {model}</p>"
        + "".join(f"<p>Note: {html.escape(note)}</p>" for note in notes)
        + "<p>protected input share = ||dW P||²/||dW||², P = projector onto the top-m(tau) eigenvectors of "
        "W_frozenᵀW_frozen; a PLATE update scores 0, a dense random update m/d_in (the 'chance' column).</p>"
    )
    return f"<section class='audit'><h2>{html.escape(title)}</h2>{summary}{divs}{_table(records)}{script}</section>"


def render_audit_page(
    records: list[AuditRecord], title: str = "Audit", layers: Iterable[LayerEntry] | None = None
) -> str:
    """A full self-contained HTML page (plotly.js inlined)."""
    from plate_inspect.reports import plotly_js

    style = (
        "body{font-family:DejaVu Sans,Helvetica,Arial,sans-serif;margin:24px;}"
        "table.audit{border-collapse:collapse;font-size:12px;}"
        "table.audit td,table.audit th{border:1px solid #ddd;padding:3px 6px;text-align:right;}"
        "table.audit td:first-child{text-align:left;}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{style}</style>"
        f"<script>{plotly_js()}</script></head>"
        f"<body>{audit_section(records, title, layers)}{READY_SCRIPT}</body></html>"
    )


#: Sets the flags :func:`plate_inspect.reports.browser.open_report` waits on (as the redundancy report's script
#: does), once every plot is drawn: without them the audit page could not be checked in a browser.
READY_SCRIPT = (
    "<script>Promise.all(window.__auditPlots || []).then(function () { window.__reportReady = true; },"
    " function (err) { window.__reportError = String(err); });</script>"
)


def write_audit_report(
    records: list[AuditRecord],
    path: str | os.PathLike,
    title: str = "Audit",
    layers: Iterable[LayerEntry] | None = None,
) -> Path:
    """Write the self-contained audit page (``layers``: the audit's layer selection, see :func:`audit_figures`);
    returns its path."""
    from plate_inspect.reports import check_report_path, write_report_text

    out = check_report_path(path, "--report", "audit.html")
    write_report_text(out, render_audit_page(records, title, layers), "--report")
    return out
