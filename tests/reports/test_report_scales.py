"""Heatmap colour ranges are explicit and come from each metric's meaningful scale, so a one-module (one-layer,
one-type) bundle's colours say where its values lie. Plotly's autoscale coloured a single cell on value +- 0.5:
the colour said nothing. Checked on the figures embedded in the written page, against the manifest JSON and the
weights' shapes read with safetensors' own loader."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from oracles import load_all

import plate_inspect
from plate_inspect.reports import write_report

ENERGY_LOG_RANGE = (-16.0, 0.0)  # log10 of [1e-16, 1]: the captured share on its own scale


def page_heatmaps(html: Path) -> dict[str, dict]:
    """Heatmap id -> its plotly trace, from the JSON the page embeds."""
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html.read_text(), re.S)
    assert m, "report data block missing"
    return {h["id"]: h["figure"]["data"][0] for h in json.loads(m.group(1))["heatmaps"]}


def modules_of(bundle_dir: Path) -> dict[str, dict]:
    return json.loads((bundle_dir / "manifest.json").read_text())["modules"]


def cells(trace: dict) -> list[float]:
    return [v for row in trace["z"] for v in row if v is not None]


@pytest.fixture(scope="module")
def weights(qwen_ckpt):
    return {n: t.shape for n, t in load_all(qwen_ckpt.path).items()}


def test_one_module_bundle_is_coloured_on_each_metrics_scale(qwen_ckpt, weights, tmp_path):
    out = tmp_path / "one"
    plate_inspect.scan(qwen_ckpt.path, out, r=8, layers=[0], target_modules=["q_proj"])
    (name, rec), *rest = modules_of(out).items()
    assert not rest
    d_in = weights[f"{name}.weight"][1]
    heat = page_heatmaps(write_report([plate_inspect.Bundle.load(out)], tmp_path / "r.html"))
    k, energy, score = heat["heatmap-k-0"], heat["heatmap-captured_energy-0"], heat["heatmap-mean_redundancy-0"]
    assert (k["zmin"], k["zmax"]) == (0, min(d_in, 512))  # k against the most columns Q can have
    assert cells(k) == [rec["k"]] and 0 < rec["k"] < d_in
    assert (energy["zmin"], energy["zmax"]) == ENERGY_LOG_RANGE
    assert (score["zmin"], score["zmax"]) == (0, 1)  # a mean |cos|: [0, 1]
    assert cells(score) == [rec["mean_redundancy"]]


def test_one_module_comparison_changes_are_drawn_on_the_metrics_whole_range(qwen_ckpt, weights, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, a, r=8, layers=[0], target_modules=["q_proj"])
    plate_inspect.scan(qwen_ckpt.path, b, r=8, tau=0.5, max_rank=16, layers=[0], target_modules=["q_proj"])
    (name, ra), (rb,) = next(iter(modules_of(a).items())), modules_of(b).values()
    d_in = weights[f"{name}.weight"][1]
    assert ra["k"] != rb["k"]
    bundles = [plate_inspect.Bundle.load(p) for p in (a, b)]
    heat = page_heatmaps(write_report(bundles, tmp_path / "cmp.html"))
    dk = heat["heatmap-k-1"]
    assert cells(dk) == [rb["k"] - ra["k"]]
    assert (dk["zmin"], dk["zmax"]) == (-min(d_in, 512), min(d_in, 512))  # a lone change is not saturated
    for metric in ("captured_energy", "mean_redundancy"):
        assert (heat[f"heatmap-{metric}-1"]["zmin"], heat[f"heatmap-{metric}-1"]["zmax"]) == (-1, 1)
    overlap = heat["heatmap-overlap-1"]
    assert (overlap["zmin"], overlap["zmax"]) == (0, 1)
    same = page_heatmaps(write_report([bundles[0], bundles[0]], tmp_path / "same.html"))
    assert cells(same["heatmap-k-1"]) == [0]
    assert (same["heatmap-k-1"]["zmin"], same["heatmap-k-1"]["zmax"]) == (-min(d_in, 512), min(d_in, 512))


def test_several_modules_keep_the_contrast_of_their_data(qwen_ckpt, weights, tmp_path):
    """One layer, every type, and the whole model: k on [0, min(d_in, max_rank)], redundancy on [0, the largest
    cell], changes symmetric to the largest change."""
    for layers in ([0], None):
        a, b = tmp_path / f"a{layers}", tmp_path / f"b{layers}"
        plate_inspect.scan(qwen_ckpt.path, a, r=8, layers=layers)
        plate_inspect.scan(qwen_ckpt.path, b, r=8, tau=0.5, layers=layers)
        ma, mb = modules_of(a), modules_of(b)
        cap = max(min(weights[f"{n}.weight"][1], 512) for n in ma)
        bundles = [plate_inspect.Bundle.load(p) for p in (a, b)]
        heat = page_heatmaps(write_report(bundles, tmp_path / "r.html"))
        assert (heat["heatmap-k-0"]["zmin"], heat["heatmap-k-0"]["zmax"]) == (0, cap)
        score = heat["heatmap-mean_redundancy-0"]
        assert (score["zmin"], score["zmax"]) == (0, max(m["mean_redundancy"] for m in ma.values()))
        assert (heat["heatmap-captured_energy-0"]["zmin"], heat["heatmap-captured_energy-0"]["zmax"]) == (
            ENERGY_LOG_RANGE
        )
        largest = max(abs(mb[n]["k"] - ma[n]["k"]) for n in ma)
        assert largest > 0
        assert (heat["heatmap-k-1"]["zmin"], heat["heatmap-k-1"]["zmax"]) == (-largest, largest)
