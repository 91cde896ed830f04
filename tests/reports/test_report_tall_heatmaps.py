"""Layer x module-type heatmaps of deep models stay readable where the page first shows them: a heatmap drawn 16 px a
layer is several screens high past ~40 layers, and plotly put its module-type labels only below the last layer and
stretched its colour bar over 0.9 of the plot (ticks screens apart). Checked on the figures embedded in the written
bundle report and in the audit page's figures; short heatmaps keep plotly's usual layout."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers_reports import SMALL_TYPES, write_fake_bundle

from plate_inspect import Bundle
from plate_inspect.auditing import AuditRecord
from plate_inspect.reports import write_report
from plate_inspect.reports.audit import audit_figures
from plate_inspect.reports.figures import TALL_COLORBAR_PX, TALL_HEATMAP_ROWS


def page_heatmaps(html: Path) -> list[dict]:
    """Every layer x type heatmap figure the page embeds."""
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html.read_text(), re.S)
    assert m, "report data block missing"
    return [h["figure"] for h in json.loads(m.group(1))["heatmaps"]]


def is_tall_layout(figure: dict) -> bool:
    """Module types labelled on top and a fixed-length colour bar hanging from the top."""
    bar = figure["data"][0].get("colorbar", {})
    top = figure["layout"]["xaxis"].get("side") == "top"
    fixed_bar = (bar.get("lenmode"), bar.get("len"), bar.get("y"), bar.get("yanchor")) == (
        "pixels",
        TALL_COLORBAR_PX,
        1,
        "top",
    )
    return top and fixed_bar


@pytest.mark.parametrize("layers", [TALL_HEATMAP_ROWS + 20, pytest.param(120, marks=pytest.mark.slow)])
def test_a_deep_bundles_heatmaps_label_the_types_on_top(tmp_path, layers):
    bundle = write_fake_bundle(tmp_path / "deep", layers, SMALL_TYPES)
    figures = page_heatmaps(write_report([Bundle.load(bundle)], tmp_path / "r.html"))
    assert len(figures) == 3  # mean redundancy, k, captured energy
    for fig in figures:
        trace = fig["data"][0]
        assert trace["y"] == [str(i) for i in range(layers)]  # every layer a row, layer 0 first (at the top)
        assert fig["layout"]["yaxis"]["autorange"] == "reversed"
        assert sorted(trace["x"]) == sorted(SMALL_TYPES)
        assert is_tall_layout(fig)
        # the slanted labels get room between the title and the plot: more top margin than a short heatmap's 74
        longest = max(len(t) for t in SMALL_TYPES)
        assert fig["layout"]["margin"]["t"] > 74 + 3 * longest


def test_a_deep_comparisons_change_heatmaps_are_tall_too(tmp_path):
    a = write_fake_bundle(tmp_path / "a", TALL_HEATMAP_ROWS + 5, SMALL_TYPES)
    b = write_fake_bundle(tmp_path / "b", TALL_HEATMAP_ROWS + 5, SMALL_TYPES, tau=0.7, seed=1)
    figures = page_heatmaps(write_report([Bundle.load(a), Bundle.load(b)], tmp_path / "c.html"))
    assert len(figures) == 7  # 3 metrics x (reference, change) + B overlap
    assert all(is_tall_layout(fig) for fig in figures)


def test_a_shallow_bundle_keeps_the_usual_layout(tmp_path):
    bundle = write_fake_bundle(tmp_path / "short", TALL_HEATMAP_ROWS, SMALL_TYPES)
    for fig in page_heatmaps(write_report([Bundle.load(bundle)], tmp_path / "r.html")):
        assert "side" not in fig["layout"]["xaxis"]  # labels below, as plotly draws them
        assert fig["data"][0]["colorbar"]["len"] == 0.9 and "lenmode" not in fig["data"][0]["colorbar"]


def audit_record(layer: int, share: float, module_type: str = "self_attn.q_proj") -> AuditRecord:
    return AuditRecord(
        module=f"model.layers.{layer}.{module_type}",
        protected_input_share=share,
        frozen_row_share=0.5,
        delta_norm=1.0,
        relative_delta=0.1,
        shape=(64, 64),
        m=8,
        r=8,
        weight_norm=10.0,
        protected_norm=share**0.5,
    )


@pytest.mark.parametrize("layers,tall", [(TALL_HEATMAP_ROWS + 1, True), (TALL_HEATMAP_ROWS, False)])
def test_the_audit_heatmap_of_a_deep_model(layers, tall):
    shares = [(i % 10) / 10 for i in range(layers)]
    heat = audit_figures([audit_record(i, s) for i, s in enumerate(shares)])["heatmap"]
    trace = heat["data"][0]
    assert trace["y"] == [str(i) for i in range(layers)]
    assert [row[0] for row in trace["z"]] == pytest.approx(shares)  # the cells are the records' shares
    assert heat["layout"]["yaxis"]["autorange"] == "reversed"  # layer 0 at the top, as in the bundle report
    assert is_tall_layout(heat) is tall


@pytest.mark.parametrize("layers", [1, 3, 12])
def test_the_audit_heatmap_leaves_each_layer_a_readable_row_below_long_type_names(layers):
    """plotly's default top margin (100 px: the title) and the slanted type names below the plot come out of the
    figure's height; what is left must give every layer at least 20 px (3 layers under DeepSeek's type names got
    ~10 px rows)."""
    types = ["mlp.shared_experts.down_proj", "self_attn.kv_a_proj_with_mqa", "mlp.experts.gate_proj"]
    records = [audit_record(i, 0.2, t) for i in range(layers) for t in types]
    heat = audit_figures(records)["heatmap"]
    layout = heat["layout"]
    angle = math.radians(abs(layout["xaxis"]["tickangle"]))
    labels_px = 7 * max(len(t) for t in types) * math.sin(angle)  # ~7 px a character at plotly's 12 px font
    plot_px = layout["height"] - layout.get("margin", {}).get("t", 100) - labels_px - 20
    assert plot_px >= 20 * layers
