"""Assemble one self-contained HTML page (plotly.js inlined, data as JSON, plain JS) from :class:`ReportData`."""

from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from typing import Any

from plate_inspect import __version__
from plate_inspect.formatting import counted, human_bytes
from plate_inspect.reports import figures as F
from plate_inspect.reports.data import HEATMAP_METRICS, ReportData, _sig, heatmap_difference, overlap_heatmap
from plate_inspect.reports.template import EXPERT_SECTION, PAGE


def _clean(x: Any) -> Any:
    """Replace NaN/inf by None so the JSON is valid for JSON.parse."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def to_json_script(data: Any) -> str:
    """JSON safe to embed inside <script type="application/json"> (no '</' sequence can end the element)."""
    text = json.dumps(_clean(data), separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


#: The RFC 4648 url-safe base64 alphabet: three characters carry one packed log10 eigenvalue (18 bits).
PACK_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_PACK_OFFSET = 100.0  # log10 values from -100 upwards; 2**18 codes at 0.01 reach past float64's largest


def pack_logs(values: list[float | None]) -> str:
    """log10 eigenvalues (to 0.01; None for an exact zero) as 3 base64 characters each: code 0 is None, code c is
    (c - 1) / 100 - 100. A DeepSeek-sized bundle has ~46,000 expert spectra, so this is ~2.5x smaller than JSON."""
    out = []
    for v in values:
        code = 0 if v is None else min(max(round((v + _PACK_OFFSET) * 100) + 1, 1), 2**18 - 1)
        out.append(PACK_ALPHABET[code >> 12] + PACK_ALPHABET[(code >> 6) & 63] + PACK_ALPHABET[code & 63])
    return "".join(out)


# --------------------------------------------------------------------------- page model
def page_model(rd: ReportData) -> dict[str, Any]:
    """The JSON the page script draws: figure specs per plot div, module list, table."""
    multi = len(rd.labels) > 1
    labels = F.plot_labels(rd.labels)  # every plotly string names bundles by these: escaped, long ones cut
    ref = labels[0]
    heatmaps = []
    for metric in HEATMAP_METRICS:
        base = rd.heatmaps[0][metric]
        heatmaps.append(
            {
                "id": f"heatmap-{metric}-0",
                "figure": F.heatmap_figure(base, subtitle=ref if multi else ""),
                "names": base.names,
            }
        )
        for b in range(1, len(rd.labels)):
            diff = heatmap_difference(base, rd.heatmaps[b][metric])
            heatmaps.append(
                {
                    "id": f"heatmap-{metric}-{b}",
                    "figure": F.heatmap_figure(diff, subtitle=f"{labels[b]} minus {ref}", difference=True),
                    "names": diff.names,
                }
            )
    if multi:
        for b in range(1, len(rd.labels)):
            overlaps = {row["name"]: row["per_bundle"][b]["b_overlap"] for row in rd.table}
            base = rd.heatmaps[0]["k"]
            hm = overlap_heatmap(base, overlaps, f"B overlap: {labels[b]} vs {ref}")
            r0, rb = rd.summaries[0].config.get("r"), rd.summaries[b].config.get("r")
            note = "|B ∩ B'| / max(r, r'); 1 = the same rows chosen"
            if r0 != rb and r0 and rb:  # nested choices then show min/max, not 1
                note += f"; r differs ({rb} vs {r0}): B nested in B' shows {min(r0, rb) / max(r0, rb):.2g}"
            fig = F.heatmap_figure(hm, subtitle=note)  # coloured on [0, 1], the overlap's scale
            heatmaps.append({"id": f"heatmap-overlap-{b}", "figure": fig, "names": hm.names})
    return {
        "title": page_title(rd),
        "labels": labels,  # the page script uses them in plotly strings only
        "heatmaps": heatmaps,
        "ktau": {"id": "ktau-plot", "figure": F.ktau_figure(rd.ktau, rd.taus, labels)},
        "params": {
            "id": "params-plot",
            "figure": F.params_tau_figure(rd.params_tau, rd.taus, [s.lora_params for s in rd.summaries], labels),
        },
        "modules": [n for n in rd.modules if n in rd.spectra],  # the explorer's (experts have their own drill-down)
        "spectrumBase": F.SPECTRUM_BASE,
        "histogramBase": F.HISTOGRAM_BASE,
        "spectra": {n: F.spectrum_figure(v, labels) for n, v in rd.spectra.items()},
        "histograms": {n: F.histogram_figure(h, labels) for n, h in rd.histograms.items()},
        "table": table_model(rd),
        **expert_model(rd, labels),
    }


def expert_model(rd: ReportData, labels: list[str]) -> dict[str, Any]:
    """The page's expert views, for every bundle (``labels``: theirs, as plotly text): per-layer distributions, and
    per group and bundle the per-expert values and compact spectra the drill-down draws. Member names are the group
    label with '*' replaced by the expert (the same experts in every bundle: check_bundles saw to that)."""
    if not rd.expert_groups:
        return {"expertGroups": [], "expertBoxes": []}
    groups = [
        {
            "id": group[0].id,
            "layer": group[0].layer,
            "type": group[0].module_type,
            "label": group[0].label,
            "shape": group[0].shape,
            "experts": group[0].experts,
            "bundles": [
                {
                    "r": g.r,
                    "k": g.k,
                    "energy": [_sig(v, 3) for v in g.energy],
                    "score": [_sig(v, 3) for v in g.score],
                    "specIndex": g.spectrum_index,
                    "qDirections": g.q_directions,
                    "variant": g.variant,
                    "spectra": [pack_logs(s) for s in g.spectra],  # the page unpacks one expert at a time
                }
                for g in group
            ],
        }
        for group in rd.expert_groups
    ]
    per_bundle = [list(gs) for gs in zip(*rd.expert_groups, strict=True)]
    boxes = [{"id": f"experts-box-{m}", "figure": F.expert_box_figure(per_bundle, m, labels)} for m in F.EXPERT_METRICS]
    return {
        "expertGroups": groups,
        "expertBoxes": boxes,
        "expertBarsBase": F.EXPERT_BARS_BASE,
        "expertSpectrumBase": F.EXPERT_SPECTRUM_BASE,
        "bundleColors": [F.color(b) for b in range(len(rd.labels))],
    }


def table_model(rd: ReportData) -> dict[str, Any]:
    """Columns (key, label, format) and rows (lists) of the per-module table."""
    cols = [
        {"key": "name", "label": "module", "fmt": "str"},
        {"key": "type", "label": "type", "fmt": "str"},
        {"key": "layer", "label": "layer", "fmt": "int"},
        {"key": "shape", "label": "d_out x d_in", "fmt": "str"},
    ]
    multi = len(rd.labels) > 1
    if not multi:
        cols += [
            {"key": "r", "label": "r", "fmt": "int"},
            {"key": "k", "label": "k", "fmt": "int"},
            {"key": "energy", "label": "captured energy", "fmt": "exp"},
            {"key": "score", "label": "mean score", "fmt": "f4"},
            {"key": "plate", "label": "PLATE r*k", "fmt": "int"},
            {"key": "lora", "label": "LoRA r*(d_in+d_out)", "fmt": "int"},
            {"key": "alpha", "label": "power-law alpha (W_f)", "fmt": "f3"},
            {"key": "stable_rank", "label": "stable rank (W_f)", "fmt": "f3"},
            {"key": "spikes", "label": "MP spikes (W_f)", "fmt": "int"},
        ]
        rows = [[row.get(c["key"]) for c in cols] for row in rd.table]  # expert groups have no health columns
        return {"columns": cols, "rows": rows, "groups": _row_groups(rd)}
    for b, label in enumerate(rd.labels):
        cols += [
            {"key": f"r{b}", "label": f"r [{label}]", "fmt": "int"},
            {"key": f"k{b}", "label": f"k [{label}]", "fmt": "int"},
            {"key": f"energy{b}", "label": f"energy [{label}]", "fmt": "exp"},
            {"key": f"score{b}", "label": f"mean score [{label}]", "fmt": "f4"},
        ]
    for b in range(1, len(rd.labels)):
        cols += [
            {"key": f"dk{b}", "label": f"Δk [{rd.labels[b]} − {rd.labels[0]}]", "fmt": "signed"},
            {"key": f"overlap{b}", "label": f"B overlap [{rd.labels[b]}]", "fmt": "f3"},
        ]
    rows = []
    for row in rd.table:
        vals = [row["name"], row["type"], row["layer"], row["shape"]]
        for pb in row["per_bundle"]:
            vals += [pb["r"], pb["k"], pb["energy"], pb["score"]]
        for b in range(1, len(rd.labels)):
            vals += [row["per_bundle"][b]["k"] - row["per_bundle"][0]["k"], row["per_bundle"][b]["b_overlap"]]
        rows.append(vals)
    return {"columns": cols, "rows": rows, "groups": _row_groups(rd)}


def _row_groups(rd: ReportData) -> dict[str, str]:
    """Table row name -> expert group id, for rows that stand for a group of experts."""
    return {row["name"]: row["group"] for row in rd.table if "group" in row}


def page_title(rd: ReportData) -> str:
    """The page's title: one bundle's label, or the compared labels."""
    if len(rd.labels) == 1:
        return f"PLATE redundancy report: {rd.labels[0]}"
    return "PLATE redundancy comparison: " + " vs ".join(rd.labels)


# --------------------------------------------------------------------------- header
def _fmt_int(n: int) -> str:
    return f"{n:,}"


def header_html(rd: ReportData) -> str:
    """The provenance/settings/totals table: one column per bundle."""
    e = html.escape
    rows: list[tuple[str, list[str]]] = []

    def add(key: str, values: list[str]) -> None:
        rows.append((key, values))

    S = rd.summaries
    add("model", [e(s.model) + (f" <span class='dim'>({e(s.model_type)})</span>" if s.model_type else "") for s in S])
    add(
        "source",
        [
            e(f"{s.source.get('kind', '?')}: {s.source.get('id', '?')}")
            + (e(f" revision {s.source['revision']}") if s.source.get("revision") else "")
            + (e(f" commit {s.source['commit'][:12]}") if s.source.get("commit") else "")
            for s in S
        ],
    )
    add("bundle", [e(s.path) for s in S])
    add(
        "config",
        [
            e(
                f"r={c['r']}  tau={c['tau']:g}  max_rank={c['max_rank']}  seed={c['seed']}  anchors={c['anchors']}"
                f"  sketch_dim={c['sketch_dim']}  precision={c['precision']}  q_dtype={c['q_dtype']}"
            )
            for c in (s.config for s in S)
        ],
    )
    add("tau grid", [e(", ".join(f"{t:g}" for t in s.config.get("tau_grid") or [])) for s in S])
    add("targets", [e(s.selection or "–") for s in S])
    add(
        "tool version",
        [
            e(f"bundle: plate-inspect {s.bundle_tool_version or '?'}; report: plate-inspect {s.report_tool_version}")
            for s in S
        ],
    )
    n_groups = len(rd.expert_groups)
    n_experts = sum(len(g[0].names) for g in rd.expert_groups)
    experts = f" <span class='dim'>({n_experts:,} experts in {n_groups} layer groups)</span>" if n_groups else ""
    add(
        "modules",
        [
            _fmt_int(s.modules)
            + experts
            + (f" <span class='warn'>({len(lo)} not in the comparison)</span>" if lo else "")
            for s, lo in zip(S, rd.left_out, strict=True)
        ],
    )
    add(
        "trainable parameters",
        [
            f"PLATE Σ r·k = <b>{_fmt_int(s.plate_params)}</b> "
            f"<span class='dim'>({100 * s.plate_over_lora:.1f}% of LoRA)</span>"
            for s in S
        ],
    )
    add("LoRA at the same r", [f"Σ r·(d_in+d_out) = {_fmt_int(s.lora_params)}" for s in S])
    add("Q memory", [f"<b>{human_bytes(s.q_bytes)}</b> ({e(s.q_dtype)}, {_fmt_int(s.q_bytes)} bytes)" for s in S])
    add("scan time", [_scan_time(s.scan_seconds, s.scan_stats) for s in S])
    head = "".join(f"<th>{e(label)}</th>" for label in rd.labels) if len(rd.labels) > 1 else "<th></th>"
    body = "".join(
        f"<tr><th scope='row'>{e(k)}</th>" + "".join(f"<td>{v}</td>" for v in vals) + "</tr>" for k, vals in rows
    )
    return f"<table class='summary'><thead><tr><th></th>{head}</tr></thead><tbody>{body}</tbody></table>"


def _scan_time(seconds: float | None, stats: dict[str, Any]) -> str:
    if seconds is None:
        return "<span class='dim'>not recorded</span>"
    extra = []
    if stats.get("device"):
        extra.append(f"on {stats['device']}")
    if stats.get("bytes_read"):
        extra.append(f"read {human_bytes(stats['bytes_read'])}")
    if stats.get("peak_rss_bytes"):
        extra.append(f"peak RSS {human_bytes(stats['peak_rss_bytes'])}")
    if stats.get("modules_resumed"):
        extra.append(f"{counted(stats['modules_resumed'], 'module')} kept from an earlier run")
    return f"<b>{seconds:.1f} s</b>" + (f" <span class='dim'>({html.escape(', '.join(extra))})</span>" if extra else "")


# --------------------------------------------------------------------------- page
def heatmap_divs(model: dict[str, Any]) -> str:
    """One plot div per heatmap figure of the page model."""
    return "".join(f"<div class='plot heat' id='{h['id']}'></div>" for h in model["heatmaps"])


def expert_section(model: dict[str, Any], rd: ReportData) -> str:
    """The experts section (empty without expert groups)."""
    if not model["expertGroups"]:
        return ""
    boxes = "".join(f"<div class='plot' id='{b['id']}'></div>" for b in model["expertBoxes"])
    n = sum(len(g["experts"]) for g in model["expertGroups"])
    note = f"{n:,} expert modules in {len(model['expertGroups'])} groups (layer x module type)"
    if len(rd.labels) > 1:
        note += f"; every view shows each of {', '.join(rd.labels)}"
    note += "."
    return EXPERT_SECTION.replace("%%EXPERT_BOXES%%", boxes).replace("%%EXPERT_NOTE%%", html.escape(note))


def render_page(rd: ReportData, plotly_js: str) -> str:
    """The full HTML document."""
    model = page_model(rd)
    multi = len(rd.labels) > 1
    ds_notes = sorted({len(v.index) for views in rd.spectra.values() for v in views if v.downsampled})
    intro = (
        "Heatmaps: the reference bundle, then each other bundle's change against it, and B overlap."
        if multi
        else "Click a cell to open that module in the explorer below."
    )
    replacements = {
        "%%TITLE%%": html.escape(model["title"]),
        "%%GENERATED%%": html.escape(
            f"generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by plate-inspect {__version__}"
        ),
        "%%HEADER%%": header_html(rd),
        "%%HEATMAPS%%": heatmap_divs(model),
        "%%EXPERTS%%": expert_section(model, rd),
        "%%HEATMAP_INTRO%%": html.escape(intro),
        "%%DOWNSAMPLE_NOTE%%": html.escape(
            f"Spectra longer than {rd.max_points} eigenvalues are drawn from {rd.max_points} evenly spaced "
            "eigenvalues (plus the tau cut and Q's first direction); the plot title says when."
            if ds_notes
            else "Every spectrum is drawn in full."
        ),
        "%%PLOTLY_JS%%": plotly_js,
        "%%DATA%%": to_json_script(model),
    }
    out = PAGE
    for key, value in replacements.items():
        if key not in ("%%PLOTLY_JS%%", "%%DATA%%"):
            out = out.replace(key, value)
    # plotly.js and the data go in last, by splitting, so no text inside them is ever taken for a placeholder
    before, _, rest = out.partition("%%PLOTLY_JS%%")
    middle, _, after = rest.partition("%%DATA%%")
    return before + plotly_js + middle + replacements["%%DATA%%"] + after
