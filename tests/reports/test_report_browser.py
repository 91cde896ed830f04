"""Reports in a real headless Chromium (Debian's chromium, installed by scripts/ensure_chromium.sh when missing):
no console errors, no network, every plot rendered (plotly's SVG), the page script works; screenshots saved."""

from __future__ import annotations

import math
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from helpers_reports import MOE_DENSE, MOE_EXPERTS, QWEN7B_TYPES, write_fake_bundle

import plate_inspect
from plate_inspect.bundle import Bundle
from plate_inspect.reports import write_report
from plate_inspect.reports.browser import find_chromium, open_report

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium; installs it with apt (as root, e.g. in CI) when /usr/bin/chromium is missing."""
    if not Path("/usr/bin/chromium").exists() and find_chromium() is None:
        res = subprocess.run(["bash", str(ROOT / "scripts" / "ensure_chromium.sh")], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.fail(f"chromium is required for the browser tests and could not be installed:\n{res.stderr}")
    path = find_chromium()
    assert path is not None
    return path


@pytest.fixture
def artifacts(tmp_path) -> Path:
    """Where screenshots go: $PLATE_ARTIFACTS (kept by CI) or the test's tmp dir."""
    d = Path(os.environ.get("PLATE_ARTIFACTS") or tmp_path / "artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def assert_clean(check, expected_plots: set[str]) -> None:
    assert check.ready, f"page never signalled ready (error: {check.report_error})"
    assert check.report_error is None
    assert check.console_errors == [], check.console_errors
    assert check.exceptions == [], check.exceptions
    assert check.network_requests == [], f"the report reached for the network: {check.network_requests}"
    assert set(check.plots) == expected_plots
    assert check.every_plot_rendered, {k: v for k, v in check.plots.items() if v == 0}


STATIC_PLOTS = {"ktau-plot", "params-plot", "spectrum-plot", "scores-plot"}
METRICS = ("mean_redundancy", "k", "captured_energy")


@pytest.fixture(scope="module")
def scanned(qwen_ckpt, tmp_path_factory) -> tuple[Bundle, Bundle]:
    """Two real scans of the generated Qwen2-layout checkpoint, at tau 0.8 and 0.95."""
    base = tmp_path_factory.mktemp("scans")
    a = plate_inspect.scan(qwen_ckpt.path, out=base / "tau0.8", r=8, tau=0.8, max_rank=48)
    b = plate_inspect.scan(qwen_ckpt.path, out=base / "tau0.95", r=8, tau=0.95, max_rank=48)
    return a, b


def test_single_report_renders(chromium, scanned, tmp_path, artifacts):
    bundle = scanned[0]
    html = write_report([bundle], tmp_path / "single.html")
    check = open_report(html, screenshot=artifacts / "report-single.png")
    assert_clean(check, STATIC_PLOTS | {f"heatmap-{m}-0" for m in METRICS})
    assert check.title == "PLATE redundancy report: tau0.8"
    width, height = png_size(check.screenshot)
    assert width == 1500 and height > 2000  # full page, not just the first screen


def test_comparison_report_renders(chromium, scanned, tmp_path, artifacts):
    html = write_report(list(scanned), tmp_path / "compare.html")
    traces = "document.querySelectorAll('#spectrum-plot .scatterlayer .trace').length"
    check = open_report(html, screenshot=artifacts / "report-compare.png", script=traces)
    heat = {f"heatmap-{m}-{b}" for m in METRICS for b in (0, 1)} | {"heatmap-overlap-1"}
    assert_clean(check, STATIC_PLOTS | heat)
    assert check.title == "PLATE redundancy comparison: tau0.8 vs tau0.95"
    assert check.details["script"] == 4  # eigenvalues + cumulative energy, for each bundle
    png_size(check.screenshot)


# Drives the page like a user: pick a module, sort the table, filter it, click a row.
INTERACT = """
(async () => {
  const wait = ms => new Promise(r => setTimeout(r, ms));
  const out = {};
  const sel = document.getElementById("module-select");
  sel.value = sel.options[50].value;
  sel.dispatchEvent(new Event("change"));
  await wait(400);
  out.selected = sel.value;
  out.spectrumTitle = document.querySelector("#spectrum-plot .gtitle").textContent;
  out.scoresTitle = document.querySelector("#scores-plot .gtitle").textContent;
  const th = [...document.querySelectorAll("#module-table thead th")];
  const col = th.findIndex(h => h.dataset.key === "score");
  th[col].click(); th[col].click();  // descending
  const rows = () => [...document.querySelectorAll("#module-table tbody tr")];
  out.sortedScores = rows().map(r => parseFloat(r.children[col].textContent));
  out.firstSorted = rows()[0].dataset.module;
  const box = document.getElementById("table-filter");
  box.value = "mlp.up_proj score>0.12";
  box.dispatchEvent(new Event("input"));
  out.filtered = rows().map(r => r.dataset.module);
  out.count = document.getElementById("table-count").textContent;
  rows()[0].click();
  await wait(400);
  out.afterClick = sel.value;
  out.svgs = document.querySelectorAll("#spectrum-plot svg.main-svg").length;
  document.getElementById("heatmap-k-0").emit("plotly_click", { points: [{ x: "mlp.down_proj", y: "27" }] });
  await wait(400);
  out.afterHeatmapClick = sel.value;
  return out;
})()
"""


def test_7b_shaped_report_is_interactive(chromium, tmp_path, artifacts):
    """196 modules (28 layers x 7 Qwen2.5-7B types): renders; explorer, sort, filter, row and cell clicks work."""
    bundle = Bundle.load(write_fake_bundle(tmp_path / "q7b", 28, QWEN7B_TYPES, r=64, max_rank=16))
    html = write_report([bundle], tmp_path / "q7b.html")
    check = open_report(html, screenshot=artifacts / "report-7b-shaped.png", script=INTERACT)
    assert_clean(check, STATIC_PLOTS | {f"heatmap-{m}-0" for m in METRICS})
    got = check.details["script"]
    name = bundle.modules[50]
    assert got["selected"] == name
    assert got["spectrumTitle"].startswith(f"Energy spectrum: {name}") and "downsampled" in got["spectrumTitle"]
    assert got["scoresTitle"] == f"Redundancy scores: {name}"
    scores = {r.name: r.mean_redundancy for r in bundle}
    assert got["sortedScores"] == sorted(got["sortedScores"], reverse=True) and len(got["sortedScores"]) == 196
    assert got["firstSorted"] == max(scores, key=scores.get)
    expected = {n for n, s in scores.items() if n.endswith("mlp.up_proj") and s > 0.12}
    assert set(got["filtered"]) == expected and got["count"] == f"{len(expected)} of 196 modules"
    assert expected  # scores are uniform around 0.12: some pass
    assert got["afterClick"] == got["filtered"][0] and got["svgs"] > 0
    assert got["afterHeatmapClick"] == "model.layers.27.mlp.down_proj"  # heatmap cell -> that module


EXPERT_PLOTS = {f"experts-box-{m}" for m in METRICS[::-1]} | {"expert-bars-plot", "expert-spectrum-plot"}

# Drives the expert views: pick a group, click an expert bar, click a heatmap group cell and a group table row.
EXPERT_INTERACT = """
(async () => {
  const wait = ms => new Promise(r => setTimeout(r, ms));
  const out = {};
  const gs = document.getElementById("group-select"), es = document.getElementById("expert-select");
  out.groups = gs.options.length;
  gs.value = gs.options[gs.options.length - 1].value;
  gs.dispatchEvent(new Event("change"));
  await wait(400);
  out.group = gs.value;
  out.bars = document.querySelectorAll("#expert-bars-plot .point").length;
  const marker = document.getElementById("expert-bars-plot").data[0].marker;
  out.barColors = [marker.cmin, marker.cmax, marker.color];
  document.getElementById("expert-bars-plot").emit("plotly_click", { points: [{ pointIndex: 5 }] });
  await wait(400);
  out.expert = es.value;
  out.spectrumTitle = document.querySelector("#expert-spectrum-plot .gtitle").textContent;
  const layer = document.getElementById("heatmap-k-0").data[0].y[1];
  document.getElementById("heatmap-k-0").emit("plotly_click", { points: [{ x: "mlp.experts.down_proj", y: layer }] });
  await wait(400);
  out.afterHeatmapClick = gs.value;
  const row = [...document.querySelectorAll("#module-table tbody tr")].find(r => r.dataset.module.includes("*"));
  row.click();
  await wait(400);
  out.rowClicked = row.dataset.module;
  out.afterRowClick = gs.value;
  return out;
})()
"""


def test_moe_report_drill_down(chromium, tmp_path, artifacts):
    """A DeepSeek-style MoE bundle: the expert views render, and group / expert / cell / row clicks work."""
    bundle = Bundle.load(
        write_fake_bundle(tmp_path / "moe", 3, MOE_DENSE, r=8, max_rank=16, experts=MOE_EXPERTS, n_experts=8)
    )
    html = write_report([bundle], tmp_path / "moe.html")
    check = open_report(html, screenshot=artifacts / "report-moe.png", script=EXPERT_INTERACT)
    assert_clean(check, STATIC_PLOTS | EXPERT_PLOTS | {f"heatmap-{m}-0" for m in METRICS})
    got = check.details["script"]
    assert got["groups"] == 6 and got["group"] == "experts:2:mlp.experts.down_proj" and got["bars"] == 8
    # bars coloured by mean redundancy on [0, the group's largest score] (was plotly's autoscale)
    scores = [bundle.record(f"model.layers.2.mlp.experts.{e}.down_proj").mean_redundancy for e in range(8)]
    assert got["barColors"][2] == pytest.approx(scores, rel=5e-3)  # the page keeps 3 significant digits
    assert got["barColors"][:2] == [0, max(got["barColors"][2])] and max(scores) > 0
    assert got["expert"] == "5"
    assert got["spectrumTitle"].startswith("Expert spectrum: model.layers.2.mlp.experts.5.down_proj")
    assert f"k = {bundle.record('model.layers.2.mlp.experts.5.down_proj').k}," in got["spectrumTitle"]
    assert got["afterHeatmapClick"] == "experts:1:mlp.experts.down_proj"
    assert got["rowClicked"] == "model.layers.0.mlp.experts.*.gate_proj [8 experts]"
    assert got["afterRowClick"] == "experts:0:mlp.experts.gate_proj"


# In comparison mode the drill-down draws one bar series and one spectrum line per bundle.
COMPARE_EXPERTS = EXPERT_INTERACT.replace(
    '  out.spectrumTitle = document.querySelector("#expert-spectrum-plot .gtitle").textContent;',
    """  out.spectrumTitle = document.querySelector("#expert-spectrum-plot .gtitle").textContent;
  out.barSeries = document.getElementById("expert-bars-plot").data.map(t => [t.name, t.y]);
  out.spectrumLines = document.getElementById("expert-spectrum-plot").data.map(t => t.name);
  out.spectrumXY = document.getElementById("expert-spectrum-plot").data.map(t => [t.x, t.y]);
  out.boxTraces = document.getElementById("experts-box-k").data.map(t => t.name);""",
)


@pytest.mark.slow
def test_moe_comparison_report_drill_down_shows_every_bundle(chromium, tmp_path, artifacts):
    """Two MoE bundles compared: the expert boxes, bars and spectra show both bundles; clicks still work."""
    paths = [
        write_fake_bundle(tmp_path / name, 3, MOE_DENSE, r=8, tau=tau, max_rank=16, seed=seed, experts=MOE_EXPERTS,
                          n_experts=8)
        for name, tau, seed in (("a", 0.9, 0), ("b", 0.7, 5))
    ]  # fmt: skip
    bundles = [Bundle.load(p) for p in paths]
    html = write_report(bundles, tmp_path / "cmp.html", labels=["a", "b"])
    check = open_report(html, screenshot=artifacts / "report-moe-compare.png", script=COMPARE_EXPERTS)
    heatmaps = {f"heatmap-{m}-{b}" for m in METRICS for b in (0, 1)} | {"heatmap-overlap-1"}
    assert_clean(check, STATIC_PLOTS | EXPERT_PLOTS | heatmaps)
    got = check.details["script"]
    assert got["groups"] == 6 and got["group"] == "experts:2:mlp.experts.down_proj" and got["bars"] == 16
    names = [f"model.layers.2.mlp.experts.{e}.down_proj" for e in range(8)]
    assert got["barSeries"] == [[label, [b.record(n).k for n in names]] for label, b in zip("ab", bundles, strict=True)]
    assert got["spectrumLines"] == ["a", "b"] and got["expert"] == "5"
    for bundle, (xs, ys) in zip(bundles, got["spectrumXY"], strict=True):  # the page unpacked the stored values
        stored = bundle.spectrum(names[5]).double()
        assert len(xs) == 24 and ys == pytest.approx([float(stored[x - 1]) for x in xs], rel=0.012)
    ks = [b.record(names[5]).k for b in bundles]
    assert f"k = a {ks[0]}, b {ks[1]}" in got["spectrumTitle"]
    assert got["boxTraces"] == [f"mlp.experts.{p} [{x}]" for p in ("gate_proj", "down_proj") for x in "ab"]
    assert got["afterHeatmapClick"] == "experts:1:mlp.experts.down_proj"


@pytest.mark.slow
def test_60_layer_256_expert_report_renders(chromium, tmp_path, artifacts):
    """DeepSeek-V3-shaped bundle (60 layers x 256 experts x 3 + 8 dense per layer): renders, no console errors."""
    attn = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    dense = {f"self_attn.{p}": (96, 128) for p in attn}
    dense |= {f"mlp.shared_experts.{p}": (64, 128) for p in ("gate_proj", "up_proj", "down_proj")}
    experts = {"gate_proj": (48, 64), "up_proj": (48, 64), "down_proj": (64, 48)}
    bundle = Bundle.load(
        write_fake_bundle(tmp_path / "ds", 60, dense, r=8, max_rank=16, experts=experts, n_experts=256)
    )
    html = write_report([bundle], tmp_path / "ds.html")
    assert html.stat().st_size < 25_000_000
    check = open_report(html, screenshot=artifacts / "report-60x256.png", script=EXPERT_INTERACT, timeout=180)
    assert_clean(check, STATIC_PLOTS | EXPERT_PLOTS | {f"heatmap-{m}-0" for m in METRICS})
    got = check.details["script"]
    assert got["groups"] == 180 and got["bars"] == 256 and got["expert"] == "5"


def test_checker_sees_errors_network_and_missing_plots(chromium, tmp_path):
    """The checks above can fail: a broken page is caught on every count."""
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><head><title>broken</title></head><body><div class='plot' id='p1'></div>"
        "<img src='http://plate-inspect.invalid/x.png'><script>console.error('boom');"
        "null.field;</script></body></html>"
    )
    check = open_report(page, timeout=3)
    assert not check.ready
    assert any("boom" in e for e in check.console_errors)
    assert any("null" in e for e in check.exceptions)
    assert check.network_requests == ["http://plate-inspect.invalid/x.png"]
    assert check.plots == {"p1": 0} and not check.every_plot_rendered


# Picks the first expert group, its first expert, and returns what the drill-down spectrum draws for Q.
EXPERT_Q_BAND = """
(async () => {
  const wait = ms => new Promise(r => setTimeout(r, ms));
  const gs = document.getElementById("group-select");
  gs.value = gs.options[0].value;
  gs.dispatchEvent(new Event("change"));
  await wait(400);
  document.getElementById("expert-bars-plot").emit("plotly_click", { points: [{ pointIndex: 0 }] });
  await wait(400);
  const layout = document.getElementById("expert-spectrum-plot").layout;
  return { group: gs.value, bands: (layout.shapes || []).map(s => [s.x0, s.x1]),
           label: layout.annotations[0].text };
})()
"""


HEATMAPS_OF_ONE = {f"heatmap-{m}-0" for m in METRICS}


def test_moe_ablation_drill_down_draws_q_where_it_lies(chromium, tmp_path):
    """The expert drill-down of an ablation bundle must not claim PLATE's bottom-k Q: checked against float64
    eigenvalues of the expert's frozen rows. high_energy_q: band over the top k; random_q: no band; PLATE: bottom k
    (the page drew "bottom k" for every bundle). A bundle of experts only renders cleanly (its page script crashed
    opening a dense module that is not there)."""
    from safetensors.torch import load_file as load_weights

    from plate_inspect.testing.synthetic import write_family
    from plate_inspect.train.variants import make_variant

    ckpt = write_family(tmp_path / "m", "mixtral", layers=1, dtype=torch.float32, seed=2)
    base = plate_inspect.scan(str(ckpt.path), tmp_path / "plate", r=4, tau=0.8, max_rank=16, target_modules=["w1"])
    weights = {}
    for f in Path(ckpt.path).glob("*.safetensors"):
        weights.update(load_weights(str(f)))
    bundles = {"plate": base}
    for v in ("high_energy_q", "random_q"):
        bundles[v] = make_variant(base, ckpt.path, v, tmp_path / v, seed=1)
    for v, b in bundles.items():
        check = open_report(write_report([b], tmp_path / f"{v}.html"), script=EXPERT_Q_BAND)
        assert_clean(check, (STATIC_PLOTS - {"spectrum-plot", "scores-plot"}) | EXPERT_PLOTS | HEATMAPS_OF_ONE)
        got = check.details["script"]
        name = "model.layers.0.block_sparse_moe.experts.0.w1"
        assert got["group"].startswith("experts:0:") and b.record(name) is not None
        w = weights[name + ".weight"].double()
        keep = torch.ones(w.shape[0], dtype=torch.bool)
        keep[b.b_idx(name)] = False
        gram = w[keep].T @ w[keep]
        evals = torch.linalg.eigvalsh(gram).flip(0)
        q = b.q(name).double()
        k, d_in = q.shape[1], w.shape[1]
        energy = float(torch.trace(q.T @ gram @ q))
        if math.isclose(energy, float(evals[:k].sum()), rel_tol=1e-4):  # Q spans the top-k directions
            assert v == "high_energy_q" and got["bands"] == [[0.5, k + 0.5]] and "top k=" in got["label"]
        elif math.isclose(energy, float(evals[-k:].sum()), rel_tol=1e-4, abs_tol=1e-9 * float(evals.sum())):
            assert v == "plate" and got["bands"] == [[d_in - k + 0.5, d_in + 0.5]] and "bottom k=" in got["label"]
        else:
            assert v == "random_q" and got["bands"] == [] and "no band drawn" in got["label"]
