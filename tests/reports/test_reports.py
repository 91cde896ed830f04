"""HTML reports: the data behind every plot against the bundle (read independently), errors, size, CLI."""

from __future__ import annotations

import json
import math
import re
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_reports import MOE_DENSE, MOE_EXPERTS, QWEN7B_TYPES, SMALL_TYPES, write_fake_bundle
from safetensors.torch import load_file

import plate_inspect
from plate_inspect.bundle import Bundle, ScanSettings
from plate_inspect.cli.main import cli
from plate_inspect.errors import BundleError
from plate_inspect.reports import data as D
from plate_inspect.reports import figures as F
from plate_inspect.reports import render_report, report_data, write_report
from plate_inspect.reports.html import page_model


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory) -> Bundle:
    """3 layers x 4 types + one module outside the layers; d_out - r < d_in for some (null directions)."""
    path = tmp_path_factory.mktemp("rep") / "small"
    write_fake_bundle(path, 3, SMALL_TYPES, r=8, tau=0.9, max_rank=32, extra={"lm_head": (24, 40)})
    return Bundle.load(path)


@pytest.fixture(scope="module")
def small_bundle_b(tmp_path_factory) -> Bundle:
    """Same architecture as small_bundle, other weights and tau (a 'fine-tuned' comparison partner)."""
    path = tmp_path_factory.mktemp("rep") / "small-b"
    write_fake_bundle(path, 3, SMALL_TYPES, r=8, tau=0.8, max_rank=32, seed=1, extra={"lm_head": (24, 40)})
    return Bundle.load(path)


def manifest_json(bundle: Bundle) -> dict:
    """The manifest read straight from disk (independent of the report's code path)."""
    return json.loads((Path(bundle.path) / "manifest.json").read_text())


def raw_tensors(bundle: Bundle) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in Path(bundle.path).glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def extract_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S)
    assert m, "report data block missing"
    return json.loads(m.group(1))


# --------------------------------------------------------------------------- header
def test_summary_totals_match_bundle(small_bundle):
    man = manifest_json(small_bundle)
    tensors = raw_tensors(small_bundle)
    s = D.bundle_summary(small_bundle)
    mods = man["modules"].values()
    assert s.modules == len(man["modules"]) == 13
    assert s.plate_params == sum(m["r"] * m["k"] for m in mods)
    assert s.lora_params == sum(m["r"] * (m["shape"][0] + m["shape"][1]) for m in mods)
    # Q memory in the bundle's dtype equals the bytes of the stored Q tensors
    assert s.q_bytes == sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith(".plate_Q"))
    assert s.scan_seconds == 12.5
    assert (s.config["r"], s.config["tau"], s.config["max_rank"], s.config["seed"]) == (8, 0.9, 32, 0)
    assert s.bundle_tool_version == man["tool_version"]
    assert s.model == "/models/fake-0" and s.model_type == "qwen2"


def test_header_counts_kept_modules_in_words(tmp_path):
    """A rescan that kept every module says "1 module kept from an earlier run" (was "1 modules resumed")."""
    path = write_fake_bundle(tmp_path / "b", 1, {"self_attn.q_proj": (48, 40)})
    stats = json.loads((path / "scan_stats.json").read_text())
    for n, words in ((1, "1 module kept from an earlier run"), (2, "2 modules kept from an earlier run")):
        (path / "scan_stats.json").write_text(json.dumps({**stats, "modules_resumed": n}))
        assert words in render_report([Bundle.load(path)])


def test_q_memory_in_bf16_is_half(tmp_path):
    a = Bundle.load(write_fake_bundle(tmp_path / "f32", 1, SMALL_TYPES, q_dtype="float32"))
    b = Bundle.load(write_fake_bundle(tmp_path / "bf16", 1, SMALL_TYPES, q_dtype="bfloat16", wall_seconds=None))
    sa, sb = D.bundle_summary(a), D.bundle_summary(b)
    assert sa.q_bytes == 2 * sb.q_bytes == 4 * sum(r.d_in * r.k for r in a)
    assert sb.scan_seconds is None
    html = render_report([b])
    assert "not recorded" in html and "bfloat16" in html


def test_header_html_shows_numbers(small_bundle):
    html = render_report([small_bundle])
    s = D.bundle_summary(small_bundle)
    for text in (
        f"{s.plate_params:,}",
        f"{s.lora_params:,}",
        f"{s.q_bytes:,} bytes",
        "12.5 s",
        "tau=0.9",
        "max_rank=32",
        "seed=0",
        plate_inspect.__version__,
        "/models/fake-0",
    ):
        assert text in html, text


# --------------------------------------------------------------------------- heatmaps
def test_layer_rows_split_layer_stacks_by_hand():
    from plate_inspect.targets import layer_rows

    attention = "layer.0.SelfAttention.q"
    names = [f"decoder.block.0.{attention}", f"decoder.block.1.{attention}", f"encoder.block.1.{attention}",
             f"encoder.block.0.{attention}", "lm_head"]  # fmt: skip
    rows, of = layer_rows(names)
    assert rows == ["encoder 0", "encoder 1", "decoder 0", "decoder 1"]
    assert of == dict(zip(names, ["decoder 0", "decoder 1", "encoder 1", "encoder 0", None], strict=True))
    bart = ["model.decoder.layers.2.fc1", "model.encoder.layers.10.fc1"]
    assert layer_rows(bart) == (["encoder 10", "decoder 2"], {bart[0]: "decoder 2", bart[1]: "encoder 10"})
    one = ["model.layers.10.mlp.up_proj", "model.layers.2.mlp.up_proj"]  # one stack: plain indices, numeric order
    assert layer_rows(one) == (["2", "10"], {one[0]: "10", one[1]: "2"})


def test_encoder_decoder_heatmaps_keep_the_stacks_apart(tmp_path):
    """T5's encoder and decoder both count layers from 0: each module gets its own cell (one was the mean of an
    encoder and a decoder module), in rows 'encoder i' / 'decoder i'; the audit's heatmap likewise."""
    import transformers

    from plate_inspect.reports.audit import audit_figures

    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                                   vocab_size=64)  # fmt: skip
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    bundle = plate_inspect.scan(tmp_path / "t5", tmp_path / "b", r=4, max_rank=16)
    hm = D.heatmap(list(bundle), "k")
    assert hm.rows == ["encoder 0", "encoder 1", "decoder 0", "decoder 1", "decoder 2"]
    cells = {hm.names[i][j] for i in range(len(hm.rows)) for j in range(len(hm.cols)) if hm.names[i][j]}
    assert cells == set(bundle.modules)  # one module a cell, none shared
    for rec in bundle:
        i = hm.rows.index(f"{rec.name.split('.')[0]} {rec.layer}")
        assert (
            hm.names[i][hm.cols.index(rec.module_type)] == rec.name and hm.z[i][hm.cols.index(rec.module_type)] == rec.k
        )
    records = plate_inspect.audit(tmp_path / "t5", tmp_path / "t5", bundle)
    assert audit_figures(records)["heatmap"]["data"][0]["y"] == hm.rows


@pytest.mark.parametrize("metric", ["mean_redundancy", "k", "captured_energy"])
def test_heatmap_cells_match_records(small_bundle, metric):
    man = manifest_json(small_bundle)
    hm = D.heatmap(list(small_bundle), metric)
    assert hm.rows == ["0", "1", "2", "other"]
    assert hm.cols == list(SMALL_TYPES) + ["lm_head"]
    seen = 0
    for name, m in man["modules"].items():
        i = hm.rows.index("other" if m["layer"] is None else str(m["layer"]))
        j = hm.cols.index(m["module_type"])
        assert hm.names[i][j] == name
        assert hm.z[i][j] == m[metric]
        assert name in hm.hover[i][j] and f"k = {m['k']}" in hm.hover[i][j]
        seen += 1
    assert seen == 13
    assert sum(v is not None for row in hm.z for v in row) == 13  # empty cells stay empty
    fig = F.heatmap_figure(hm)
    z = fig["data"][0]["z"]
    if metric == "captured_energy":  # drawn on a log10 colour scale
        assert all(
            z[i][j] is None or math.isclose(z[i][j], math.log10(max(hm.z[i][j], F.ENERGY_FLOOR)))
            for i in range(len(z))
            for j in range(len(z[0]))
        )
    else:
        assert z == hm.z


def test_heatmap_difference_and_overlap(small_bundle, small_bundle_b):
    rd = report_data([small_bundle, small_bundle_b])
    a, b = manifest_json(small_bundle)["modules"], manifest_json(small_bundle_b)["modules"]
    diff = D.heatmap_difference(rd.heatmaps[0]["k"], rd.heatmaps[1]["k"])
    ta, tb = raw_tensors(small_bundle), raw_tensors(small_bundle_b)
    for row_names, row_z in zip(diff.names, diff.z, strict=True):
        for name, z in zip(row_names, row_z, strict=True):
            if name is not None:
                assert z == b[name]["k"] - a[name]["k"]
    for row in rd.table:
        name = row["name"]
        ba, bb = set(ta[f"{name}.plate_B_idx"].tolist()), set(tb[f"{name}.plate_B_idx"].tolist())
        assert row["per_bundle"][1]["b_overlap"] == pytest.approx(len(ba & bb) / len(ba))
        assert row["per_bundle"][0]["b_overlap"] == 1.0
    # the page model has reference heatmaps, differences and B-overlap maps
    ids = [h["id"] for h in page_model(rd)["heatmaps"]]
    assert ids == [f"heatmap-{m}-{b}" for m in D.HEATMAP_METRICS for b in (0, 1)] + ["heatmap-overlap-1"]


def test_overlap_map_of_bundles_with_different_r_says_what_nested_rows_show(small_bundle, tmp_path):
    """QA: r = 32 vs 64 with B nested showed 0.5 under a title promising 1 for the same rows; the title now states
    the normalisation, max(r, r'), and the subtitle what nested choices show."""
    other = tmp_path / "r4"
    write_fake_bundle(other, 3, SMALL_TYPES, r=4, tau=0.9, max_rank=32, seed=2, extra={"lm_head": (24, 40)})
    rd = report_data([small_bundle, Bundle.load(other)])
    ta, tb = raw_tensors(small_bundle), raw_tensors(Bundle.load(other))
    for row in rd.table:
        ba, bb = set(ta[f"{row['name']}.plate_B_idx"].tolist()), set(tb[f"{row['name']}.plate_B_idx"].tolist())
        assert row["per_bundle"][1]["b_overlap"] == pytest.approx(len(ba & bb) / 8)
    overlap = next(h for h in page_model(rd)["heatmaps"] if h["id"] == "heatmap-overlap-1")
    text = json.dumps(overlap["figure"])
    assert "max(r, r')" in text and "r differs (4 vs 8)" in text and "shows 0.5" in text


# --------------------------------------------------------------------------- k(tau)
def test_k_tau_curves_match_manifest(small_bundle):
    man = manifest_json(small_bundle)
    curves = {c.module_type: c for c in D.k_tau_curves(list(small_bundle))}
    assert set(curves) == {m["module_type"] for m in man["modules"].values()}
    for mtype, c in curves.items():
        mods = [m for m in man["modules"].values() if m["module_type"] == mtype]
        assert c.taus == sorted(float(t) for t in mods[0]["k_by_tau"])
        assert 0.9 in c.taus  # the bundle's tau is on the curve
        for i, tau in enumerate(c.taus):
            ks = [m["k_by_tau"][f"{tau:g}"] for m in mods]
            assert c.mean_k[i] == pytest.approx(np.mean(ks))
            assert (c.min_k[i], c.max_k[i]) == (min(ks), max(ks))
        # at the bundle's tau, k(tau) is each module's k
        assert c.mean_k[c.taus.index(0.9)] == pytest.approx(np.mean([m["k"] for m in mods]))
        assert all(a >= b for a, b in zip(c.max_k, c.max_k[1:], strict=False))  # larger tau, smaller k
    fig = F.ktau_figure([list(curves.values())], [0.9], ["x"])
    stars = [t for t in fig["data"] if t.get("marker", {}).get("symbol") == "star"]
    assert len(stars) == len(curves) and all(t["x"] == [0.9] for t in stars)
    assert [s["x0"] for s in fig["layout"]["shapes"]] == [0.9]


def test_params_by_tau(small_bundle):
    man = manifest_json(small_bundle)
    taus, params = D.params_by_tau(list(small_bundle))
    for tau, p in zip(taus, params, strict=True):
        assert p == sum(m["r"] * m["k_by_tau"][f"{tau:g}"] for m in man["modules"].values())
    assert params[taus.index(0.9)] == D.bundle_summary(small_bundle).plate_params


# --------------------------------------------------------------------------- spectra
def test_spectrum_view_matches_stored_spectrum(small_bundle):
    tensors = raw_tensors(small_bundle)
    for rec in small_bundle:
        s = tensors[f"{rec.name}.spectrum"].double().numpy()
        v = D.spectrum_view(small_bundle, rec.name, max_points=1000)
        assert not v.downsampled and v.index == list(range(1, len(s) + 1))
        assert v.n_stored == len(s) == min(rec.d_out - rec.r, rec.d_in)
        assert v.null_directions == rec.d_in - len(s)
        np.testing.assert_allclose(v.values, s, rtol=1e-3)
        np.testing.assert_allclose(v.cum_energy, np.cumsum(s) / s.sum(), rtol=1e-3, atol=1e-4)
        # tau cut: the fewest leading eigenvalues holding >= tau of the energy, counted with a plain loop
        m, acc = 0, 0.0
        while acc < 0.9 * s.sum():
            acc += s[m]
            m += 1
        assert v.m_tau == m
        assert v.k == rec.k == max(1, min(rec.d_in - m, 32))
        assert v.k_start == rec.d_in - rec.k + 1


def test_spectrum_hand_computed():
    class Rec:  # minimal stand-in for a bundle with one module
        d_in, k, variant = 6, 3, None

    class B:
        settings = ScanSettings(tau=0.7)

        def record(self, name):
            return Rec()

    # energy 4+3+2+1 = 10; the top 2 hold 7 >= 0.7*10 -> m = 2; 2 null directions (d_in 6, 4 stored)
    v = D.spectrum_view(B(), "m", spectrum=np.array([4.0, 3.0, 2.0, 1.0]))
    assert (v.m_tau, v.null_directions, v.k_start) == (2, 2, 4)
    assert v.cum_energy == [0.4, 0.7, 0.9, 1.0]
    fig = F.spectrum_figure([v], ["m"])
    lines = [s for s in fig["layout"]["shapes"] if s["type"] == "line" and s["xref"] == "x"]
    rects = [s for s in fig["layout"]["shapes"] if s["type"] == "rect"]
    assert lines[0]["x0"] == 2.5  # between direction 2 and 3
    assert {(r["x0"], r["x1"]) for r in rects} == {(3.5, 6.5)}  # Q = directions 4..6
    assert "2 null directions" in fig["layout"]["title"]["text"]


def test_spectrum_downsampled_and_says_so(small_bundle):
    rec = max(small_bundle, key=lambda r: r.d_in)
    s = raw_tensors(small_bundle)[f"{rec.name}.spectrum"].double().numpy()
    v = D.spectrum_view(small_bundle, rec.name, max_points=16)
    assert v.downsampled and 16 <= len(v.index) <= 20
    assert v.index[0] == 1 and v.index[-1] == len(s)
    assert v.m_tau in v.index  # the tau cut is always drawn
    # Q's first direction lies past the stored spectrum here (a null direction): nothing to keep from it
    assert v.k_start > len(s) and rec.d_in - len(s) == v.null_directions > 0
    np.testing.assert_allclose(v.values, s[np.array(v.index) - 1], rtol=1e-3)
    title = F.spectrum_figure([v], ["x"])["layout"]["title"]["text"]
    assert f"{len(v.index)} of {len(s)} eigenvalues" in title


def test_downsampled_spectrum_keeps_tau_cut_and_q_start():
    """A long stored spectrum where Q starts inside it: both the tau cut and Q's first direction are drawn."""

    class Rec:
        d_in, k, variant = 1000, 300, None

    class B:
        settings = ScanSettings(tau=0.9)

        def record(self, name):
            return Rec()

    s = np.exp(-np.linspace(0, 12, 1000))  # all 1000 directions stored; top m hold 90% of the energy
    v = D.spectrum_view(B(), "m", max_points=20, spectrum=s)
    m = int(np.argmax(np.cumsum(s) >= 0.9 * s.sum())) + 1
    assert v.downsampled and v.m_tau == m and v.k_start == 701
    assert m in v.index and m + 1 in v.index  # both sides of the cut
    assert 700 in v.index and 701 in v.index  # both sides of Q's first direction
    assert len(v.index) <= 20 + 4


# --------------------------------------------------------------------------- score histograms
def test_score_histogram_matches_scores(small_bundle):
    tensors = raw_tensors(small_bundle)
    for rec in small_bundle:
        scores = tensors[f"{rec.name}.redundancy"].double().numpy()
        b_idx = tensors[f"{rec.name}.plate_B_idx"].numpy()
        edges = D.score_edges([scores], 10)
        h = D.score_histogram(rec.name, scores, b_idx, edges)
        assert sum(h.counts) == rec.d_out
        assert h.counts == np.histogram(scores, bins=np.linspace(scores.min(), scores.max(), 11))[0].tolist()
        assert h.cutoff == np.sort(scores)[::-1][rec.r - 1]  # B = top r: cut-off is the r-th largest score
        assert int((scores >= h.cutoff).sum()) == rec.r
        fig = F.histogram_figure([h], ["x"])
        assert fig["layout"]["shapes"][0]["x0"] == h.cutoff
        assert f"top r={rec.r} of {rec.d_out}" in fig["layout"]["annotations"][0]["text"]


def test_comparison_histograms_share_bins(small_bundle, small_bundle_b):
    rd = report_data([small_bundle, small_bundle_b], bins=12)
    for name, hs in rd.histograms.items():
        assert hs[0].edges == hs[1].edges and len(hs[0].edges) == 13
        both = np.concatenate([small_bundle.redundancy(name).numpy(), small_bundle_b.redundancy(name).numpy()])
        assert hs[0].edges[0] == pytest.approx(both.min()) and hs[0].edges[-1] == pytest.approx(both.max())


# --------------------------------------------------------------------------- table, page
def test_table_rows_match_records(small_bundle):
    man = manifest_json(small_bundle)["modules"]
    rd = report_data([small_bundle])
    tm = page_model(rd)["table"]
    keys = [c["key"] for c in tm["columns"]]
    assert keys == [
        *("name", "type", "layer", "shape", "r", "k", "energy", "score", "plate", "lora"),
        *("alpha", "stable_rank", "spikes"),
    ]
    assert [r[0] for r in tm["rows"]] == list(man)
    for row in tm["rows"]:
        m = man[row[0]]
        assert row[keys.index("shape")] == f"{m['shape'][0]}x{m['shape'][1]}"
        assert row[keys.index("k")] == m["k"] and row[keys.index("r")] == m["r"]
        assert row[keys.index("energy")] == m["captured_energy"]
        assert row[keys.index("score")] == m["mean_redundancy"]
        assert row[keys.index("plate")] == m["r"] * m["k"]


def test_table_shows_the_scanned_spectral_health(tmp_path):
    """A scanned bundle's health (W_frozen's alpha, stable rank, MP spikes) reaches the table as recorded."""
    from plate_inspect.testing.synthetic import write_bert

    bundle = plate_inspect.scan(write_bert(tmp_path / "bert", layers=1).path, tmp_path / "b", r=4)
    man = manifest_json(bundle)["modules"]
    tm = page_model(report_data([bundle]))["table"]
    keys = [c["key"] for c in tm["columns"]]
    for row in tm["rows"]:
        health = man[row[0]]["health"]
        assert health["spectrum_of"] == "W_frozen"
        assert row[keys.index("alpha")] == health["alpha"]
        assert row[keys.index("stable_rank")] == health["stable_rank"]
        assert row[keys.index("spikes")] == health["num_spikes"]
        # an independent check of one metric: stable rank = sum(lambda) / max(lambda) of the stored spectrum
        spectrum = bundle.spectrum(row[0]).double()
        assert health["stable_rank"] == pytest.approx(float(spectrum.sum() / spectrum.max()), rel=1e-5)


def test_page_is_self_contained(small_bundle, tmp_path):
    out = write_report([small_bundle], tmp_path / "sub" / "r.html")
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]+src=", html) and not re.search(r"<link[^>]+href=", html)
    import plotly

    assert plotly.offline.get_plotlyjs()[:2000] in html  # plotly.js inlined
    data = extract_data(html)
    assert data["modules"] == small_bundle.modules
    assert set(data["spectra"]) == set(data["histograms"]) == set(small_bundle.modules)
    # every plot div the page script draws into exists
    for pid in [h["id"] for h in data["heatmaps"]] + ["ktau-plot", "params-plot", "spectrum-plot", "scores-plot"]:
        assert f"id='{pid}'" in html or f'id="{pid}"' in html


def test_json_embedding_cannot_close_script():
    from plate_inspect.reports.html import to_json_script

    text = to_json_script({"a": "</script><script>alert(1)</script>", "b": float("nan")})
    assert "</" not in text and json.loads(text) == {"a": "</script><script>alert(1)</script>", "b": None}


def test_7b_shaped_bundle_stays_small(tmp_path):
    """28 layers x 7 Qwen2.5-7B module types = 196 modules; long spectra are downsampled for display."""
    b = Bundle.load(write_fake_bundle(tmp_path / "q7b", 28, QWEN7B_TYPES, r=64, max_rank=16, q_dtype="bfloat16"))
    out = write_report([b], tmp_path / "q7b.html")
    html = out.read_text()
    data = extract_data(html)
    assert len(data["modules"]) == 196
    size, data_size = out.stat().st_size, len(json.dumps(data))
    assert data_size < 2_500_000, data_size  # the bundle's spectra+scores alone are ~8 MB of float32
    assert size < len(plate_inspect.reports.plotly_js()) + 2_800_000, size
    fig = data["spectra"]["model.layers.0.mlp.gate_proj"]
    assert len(fig["data"][0]["x"]) <= D.DEFAULT_MAX_POINTS + 4
    assert "of 3,584 eigenvalues" in fig["layout"]["title"]["text"]


# --------------------------------------------------------------------------- errors
def test_incomplete_bundle_refused(tmp_path):
    path = write_fake_bundle(tmp_path / "half", 2, SMALL_TYPES, finalize=False)
    b = Bundle.load(path, require_complete=False)
    # every module is written, only the manifest's complete flag is missing: says so, not "incomplete (2/2)"
    with pytest.raises(BundleError, match="not finalised: all 8 modules are written"):
        write_report([b], tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()
    res = CliRunner().invoke(cli, ["report", str(path), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and "rerun the same scan command" in res.output and "Traceback" not in res.output


def test_incompatible_bundles_refused(tmp_path, small_bundle):
    other_shapes = {t: (d_out * 2, d_in) for t, (d_out, d_in) in SMALL_TYPES.items()}
    b = Bundle.load(write_fake_bundle(tmp_path / "wide", 3, other_shapes))
    with pytest.raises(BundleError, match=r"incompatible bundles: module '.*' is \[48, 40\]"):
        write_report([small_bundle, b], tmp_path / "r.html")
    c = Bundle.load(write_fake_bundle(tmp_path / "none", 0, {}, extra={"encoder.x": (16, 16)}))
    with pytest.raises(BundleError, match="no module in common"):
        write_report([small_bundle, c], tmp_path / "r.html")
    with pytest.raises(BundleError, match="no bundle given"):
        write_report([], tmp_path / "r.html")
    with pytest.raises(BundleError, match="^2 labels given for 1 bundle; give one label per bundle$"):
        write_report([small_bundle], tmp_path / "r.html", labels=["a", "b"])
    with pytest.raises(BundleError, match="^1 label given for 2 bundles; "):
        write_report([small_bundle, small_bundle], tmp_path / "r.html", labels=["a"])


def test_report_path_is_checked_before_rendering(tmp_path, small_bundle, monkeypatch):
    """A report path under a file (or a directory) is refused before the page is rendered, naming the file in the
    way and the flag to change; nothing is left behind."""
    import plate_inspect.reports as reports

    def must_not_render(*args, **kwargs):
        raise AssertionError("the report was rendered before its path was checked")

    monkeypatch.setattr(reports, "render_report", must_not_render)
    (tmp_path / "a-file").write_text("x")
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "a-file" / "r.html", "a-file is a file")):
        res = CliRunner().invoke(cli, ["report", str(small_bundle.path), "-o", str(bad)])
        assert res.exit_code == 2 and why in res.output and "-o" in res.output, res.output
        assert "Traceback" not in res.output
    assert (tmp_path / "a-file").read_text() == "x"


def test_report_never_replaces_a_device_fifo_or_a_bundle_file(tmp_path):
    """``-o /dev/null`` used to rename the page over the device (as root: /dev/null became a plain file), and
    ``-o BUNDLE/manifest.json`` over the bundle's manifest. Both are refused (exit 2, one line); the FIFO (standing
    in for /dev/null) stays a FIFO and the bundle's files keep their bytes. An .html inside the bundle is fine."""
    import os
    import stat

    from plate_inspect.atomic import atomic_write

    path = write_fake_bundle(tmp_path / "b", 1, {"self_attn.q_proj": (48, 40)})
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for bad, why in (
        (fifo, "is not a regular file"),
        (path / "manifest.json", "is inside the bundle"),
        (path / "layer-00000.safetensors", "is inside the bundle"),
        (path / "notes.txt", "is inside the bundle"),
    ):
        res = CliRunner().invoke(cli, ["report", str(path), "-o", str(bad), "-q"])
        assert res.exit_code == 2 and why in res.output and "Traceback" not in res.output, res.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    # the one atomic writer refuses to rename over a non-regular file too (plan -o, experiments, audit --report)
    with pytest.raises(OSError, match="not a regular file"):
        atomic_write(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    res = CliRunner().invoke(cli, ["report", str(path), "-o", str(path / "report.html"), "-q"])
    assert res.exit_code == 0 and (path / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_partial_overlap_compares_common_modules(tmp_path, small_bundle):
    b = Bundle.load(write_fake_bundle(tmp_path / "two", 2, SMALL_TYPES, seed=3))  # layers 0-1, no lm_head
    rd = report_data([small_bundle, b])
    assert rd.modules == b.modules and len(rd.left_out[0]) == 5 and rd.left_out[1] == []
    assert "(5 not in the comparison)" in render_report([small_bundle, b])


# --------------------------------------------------------------------------- CLI
def test_cli_report_single_and_compare(tmp_path, small_bundle, small_bundle_b):
    runner = CliRunner()
    res = runner.invoke(cli, ["report", "--help"])
    assert res.exit_code == 0 and "Examples:" in res.output and "compare.html" in res.output
    out = tmp_path / "one.html"
    res = runner.invoke(cli, ["report", str(small_bundle.path), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    assert extract_data(out.read_text())["labels"] == ["small"]
    out2 = tmp_path / "cmp.html"
    res = runner.invoke(
        cli, ["report", str(small_bundle.path), str(small_bundle_b.path), "-o", str(out2), "--labels", "base,ft"]
    )
    assert res.exit_code == 0, res.output
    data = extract_data(out2.read_text())
    assert data["labels"] == ["base", "ft"] and "base vs ft" in data["title"]
    keys = [c["key"] for c in data["table"]["columns"]]
    assert {"k0", "k1", "dk1", "overlap1"} <= set(keys)
    row = data["table"]["rows"][0]
    assert row[keys.index("dk1")] == row[keys.index("k1")] - row[keys.index("k0")]
    res = runner.invoke(cli, ["report", str(tmp_path / "missing"), "-o", str(tmp_path / "x.html")])
    assert res.exit_code == 2 and "missing: does not exist" in res.output


def test_scan_with_report_flag(tmp_path, gpt2_ckpt):
    out = tmp_path / "b"
    res = CliRunner().invoke(
        cli, ["scan", str(gpt2_ckpt.path), "--out", str(out), "--r", "4", "--max-rank", "24", "--report", "-q"]
    )
    assert res.exit_code == 0, res.output
    data = extract_data((out / "report.html").read_text())
    assert data["modules"] == Bundle.load(out).modules


# --------------------------------------------------------------------------- experts (MoE bundles)


@pytest.fixture(scope="module")
def moe_bundle(tmp_path_factory) -> Bundle:
    """3 layers: 2 dense modules and 6 experts x 2 projections each (DeepSeek-style names)."""
    path = tmp_path_factory.mktemp("rep") / "moe"
    write_fake_bundle(path, 3, MOE_DENSE, r=8, max_rank=16, experts=MOE_EXPERTS, n_experts=6)
    return Bundle.load(path)


def test_expert_groups_match_manifest(moe_bundle):
    man = manifest_json(moe_bundle)["modules"]
    rd = report_data([moe_bundle])
    groups = [g[0] for g in rd.expert_groups]
    assert [(g.layer, g.module_type) for g in groups] == [
        (i, f"mlp.experts.{p}") for i in range(3) for p in ("gate_proj", "down_proj")
    ]
    tensors = raw_tensors(moe_bundle)
    for g in groups:
        names = [f"model.layers.{g.layer}.{g.module_type.replace('experts.', f'experts.{e}.')}" for e in range(6)]
        assert g.names == names and g.experts == list(range(6))
        assert g.label == f"model.layers.{g.layer}.{g.module_type.replace('experts.', 'experts.*.')}"
        assert g.k == [man[n]["k"] for n in names]
        assert g.energy == [man[n]["captured_energy"] for n in names]
        assert g.score == [man[n]["mean_redundancy"] for n in names]
        for n, logs in zip(names, g.spectra, strict=True):  # compact spectra: log10 at the shared directions
            s = tensors[f"{n}.spectrum"].double().numpy()
            np.testing.assert_allclose(logs, np.log10(s[np.array(g.spectrum_index) - 1]), atol=0.006)
        assert len(g.spectrum_index) == D.EXPERT_SPECTRUM_POINTS and g.spectrum_index[0] == 1
    # experts leave the per-module views; dense modules keep theirs
    assert set(rd.spectra) == {f"model.layers.{i}.{t}" for i in range(3) for t in MOE_DENSE}
    # heatmap: a group's cell is the mean over its experts, named by the group id
    hm = rd.heatmaps[0]["k"]
    for g in groups:
        i, j = hm.rows.index(str(g.layer)), hm.cols.index(g.module_type)
        assert hm.z[i][j] == pytest.approx(np.mean([man[n]["k"] for n in g.names]))
        assert hm.names[i][j] == g.id and "6 experts" in hm.hover[i][j]
    # table: one row per group, means and totals over its experts
    rows = {row["name"]: row for row in rd.table}
    for g in groups:
        row = rows[f"{g.label} [6 experts]"]
        assert row["group"] == g.id
        assert row["k"] == pytest.approx(np.mean(g.k), abs=0.01)
        assert row["plate"] == sum(man[n]["r"] * man[n]["k"] for n in g.names)
        assert row["lora"] == sum(man[n]["r"] * sum(man[n]["shape"]) for n in g.names)
    assert len(rd.table) == 6 + 6


def test_expert_box_statistics(moe_bundle):
    man = manifest_json(moe_bundle)["modules"]
    groups = [g[0] for g in report_data([moe_bundle]).expert_groups]
    fig = F.expert_box_figure([groups], "mean_redundancy")
    assert [t["name"] for t in fig["data"]] == ["mlp.experts.gate_proj", "mlp.experts.down_proj"]
    for trace in fig["data"]:
        for layer, lo, med, hi, mean in zip(
            trace["x"], trace["lowerfence"], trace["median"], trace["upperfence"], trace["mean"], strict=True
        ):
            vals = [
                m["mean_redundancy"]
                for n, m in man.items()
                if m["layer"] == int(layer) and m["module_type"] == trace["name"]
            ]
            assert len(vals) == 6
            assert (lo, med, hi) == pytest.approx((min(vals), float(np.median(vals)), max(vals)), rel=1e-3)
            assert mean == pytest.approx(sum(vals) / 6, rel=1e-3)


def test_expert_page_model_and_info(moe_bundle, tmp_path):
    data = extract_data(write_report([moe_bundle], tmp_path / "moe.html").read_text())
    assert len(data["expertGroups"]) == 6 and [b["id"] for b in data["expertBoxes"]] == [
        "experts-box-k",
        "experts-box-captured_energy",
        "experts-box-mean_redundancy",
    ]
    g = data["expertGroups"][0]
    names = [g["label"].replace("*", str(e)) for e in g["experts"]]  # how the page names experts
    assert names == [f"model.layers.0.mlp.experts.{e}.gate_proj" for e in range(6)]
    assert all(n in moe_bundle for n in names)
    assert data["table"]["groups"] == {f"{x['label']} [6 experts]": x["id"] for x in data["expertGroups"]}
    res = CliRunner().invoke(cli, ["info", str(moe_bundle.path)])
    assert res.exit_code == 0, res.output
    man = manifest_json(moe_bundle)["modules"]
    ks = [m["k"] for m in man.values() if m["module_type"] == "mlp.experts.down_proj"]
    assert "expert groups" in res.output and "mlp.experts.down_proj" in res.output
    line = next(x for x in res.output.splitlines() if "mlp.experts.down_proj" in x and "3 x 6" in x)
    assert f"{min(ks)}/{np.median(ks):.0f}/{max(ks)}" in line
    per_layer = CliRunner().invoke(cli, ["info", str(moe_bundle.path), "--expert-groups"])
    assert "expert groups, per layer" in per_layer.output and "no expert modules" not in per_layer.output


def test_info_expert_groups_on_a_dense_bundle_says_there_are_none(small_bundle):
    res = CliRunner().invoke(cli, ["info", str(small_bundle.path), "--expert-groups"])
    assert res.exit_code == 0, res.output
    assert "no expert modules in this bundle" in res.output and "expert groups, per" not in res.output


def unpack_logs(text: str) -> list[float | None]:
    """Decode the page's packed spectra from the format's definition: 3 url-safe base64 digits (RFC 4648) per
    value, code 0 = an exact zero, code c = log10 value (c - 1) / 100 - 100."""
    alphabet = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
    digits = [alphabet.index(ch) for ch in text]
    codes = [digits[i] * 4096 + digits[i + 1] * 64 + digits[i + 2] for i in range(0, len(digits), 3)]
    return [None if c == 0 else (c - 1) / 100 - 100 for c in codes]


def test_packed_spectra_round_trip_to_a_hundredth_of_a_decade():
    from plate_inspect.reports.html import pack_logs

    values = [3.14159, 0.0, -0.004, -45.678, 38.2, None, 12.345]
    got = unpack_logs(pack_logs(values))
    assert got[5] is None and len(got) == len(values)
    for v, g in zip(values, got, strict=True):
        if v is not None:
            assert abs(g - v) <= 0.005 + 1e-9


def test_comparison_shows_every_bundles_experts(moe_bundle, tmp_path):
    """Comparison mode: each bundle's per-expert values, compact spectra and box statistics are on the page,
    checked against that bundle's own manifest and stored spectra."""
    other = Bundle.load(
        write_fake_bundle(tmp_path / "moe2", 3, MOE_DENSE, r=8, tau=0.7, max_rank=16, seed=5, experts=MOE_EXPERTS,
                          n_experts=6)
    )  # fmt: skip
    bundles, labels = [moe_bundle, other], ["a", "b"]
    html = write_report(bundles, tmp_path / "cmp.html", labels=labels).read_text()
    data = extract_data(html)
    assert len(data["expertGroups"]) == 6
    mans = [manifest_json(b)["modules"] for b in bundles]
    stored = [raw_tensors(b) for b in bundles]
    assert [g[0].k for g in report_data([other]).expert_groups] != [
        g[0].k for g in report_data([moe_bundle]).expert_groups
    ]
    for g in data["expertGroups"]:
        names = [g["label"].replace("*", str(e)) for e in g["experts"]]
        assert len(g["bundles"]) == 2
        for man, tensors, per in zip(mans, stored, g["bundles"], strict=True):
            assert per["k"] == [man[n]["k"] for n in names]
            assert per["r"] == man[names[0]]["r"]
            assert per["score"] == pytest.approx([man[n]["mean_redundancy"] for n in names], rel=5e-3)  # 3 digits
            for n, packed in zip(names, per["spectra"], strict=True):
                logs = unpack_logs(packed)
                s = tensors[f"{n}.spectrum"].double().numpy()
                np.testing.assert_allclose(logs, np.log10(s[np.array(per["specIndex"]) - 1]), atol=0.006)
    box = next(b["figure"] for b in data["expertBoxes"] if b["id"] == "experts-box-k")
    names = [t["name"] for t in box["data"]]
    assert names == [f"mlp.experts.{p} [{lab}]" for p in ("gate_proj", "down_proj") for lab in labels]
    for trace in box["data"]:
        mtype, lab = trace["name"][:-4], trace["name"][-2]
        man = mans[labels.index(lab)]
        for layer, med in zip(trace["x"], trace["median"], strict=True):
            ks = [m["k"] for m in man.values() if m["layer"] == int(layer) and m["module_type"] == mtype]
            assert len(ks) == 6 and med == pytest.approx(float(np.median(ks)), rel=1e-3)
    assert "every view shows each of a, b" in html


def test_dense_bundle_has_no_expert_section(small_bundle):
    html = render_report([small_bundle])
    assert 'id="experts"' not in html and extract_data(html)["expertGroups"] == []


@pytest.mark.slow
def test_60_layer_256_expert_report_stays_small(tmp_path):
    """DeepSeek-V3-shaped bundle: 60 layers x (8 dense + 256 experts x 3) = 46,560 modules; report < 25 MB."""
    dense = {
        **{f"self_attn.{p}": (96, 128) for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")},
        **{f"mlp.shared_experts.{p}": (64, 128) for p in ("gate_proj", "up_proj", "down_proj")},
    }
    experts = {"gate_proj": (48, 64), "up_proj": (48, 64), "down_proj": (64, 48)}
    bundle = Bundle.load(
        write_fake_bundle(tmp_path / "ds", 60, dense, r=8, max_rank=16, experts=experts, n_experts=256)
    )
    assert len(bundle) == 60 * (8 + 256 * 3)
    out = write_report([bundle], tmp_path / "ds.html")
    size = out.stat().st_size
    print(f"60x256-expert report: {size / 1e6:.1f} MB")
    assert size < 25_000_000, size
    data = extract_data(out.read_text())
    assert len(data["expertGroups"]) == 180 and len(data["spectra"]) == 480
    assert len(data["table"]["rows"]) == 480 + 180


# --------------------------------------------------------------------------- ablation bundles
def test_ablation_reports_place_q_and_b_where_they_are(tmp_path):
    """An ablation bundle's report must not claim PLATE's geometry: checked against float64 eigenvalues of the
    frozen rows and the stored scores. high_energy_q's Q holds the top-k energy (band at 1..k), random_q's holds
    neither end (no band), random_b's B is not the top-r scores (no cut-off line, no "top r" claim); PLATE's own
    bundle keeps the bottom-k band and the cut-off."""
    from safetensors.torch import load_file as load_weights

    from plate_inspect.testing.synthetic import write_llama_like
    from plate_inspect.train.variants import make_variant

    ckpt = write_llama_like(tmp_path / "m", layers=1, dtype=torch.float32, seed=5)
    base = plate_inspect.scan(str(ckpt.path), tmp_path / "plate", r=8, tau=0.8, target_modules=["q_proj"])
    name = "model.layers.0.self_attn.q_proj"
    weights = {}
    for f in Path(ckpt.path).glob("*.safetensors"):
        weights.update(load_weights(str(f)))
    w = weights[name + ".weight"].double()
    bundles = {"plate": base}
    for v in ("high_energy_q", "random_q", "random_b"):
        bundles[v] = make_variant(base, ckpt.path, v, tmp_path / v, seed=1)
    for v, b in bundles.items():
        keep = torch.ones(w.shape[0], dtype=torch.bool)
        keep[b.b_idx(name)] = False
        evals = torch.linalg.eigvalsh(w[keep].T @ w[keep]).flip(0)  # descending
        q = b.q(name).double()
        k = q.shape[1]
        energy = float(torch.trace(q.T @ (w[keep].T @ w[keep]) @ q))
        top, bottom = float(evals[:k].sum()), float(evals[-k:].sum())
        scores = b.redundancy(name).double()
        top_r = set(torch.topk(scores, len(b.b_idx(name))).indices.tolist())
        d = extract_data(render_report([b]))
        bands = [(s["x0"], s["x1"]) for s in d["spectra"][name]["layout"]["shapes"] if s["type"] == "rect"]
        q_text = d["spectra"][name]["layout"]["annotations"][1]["text"]
        hist = d["histograms"][name]["layout"]
        d_in = w.shape[1]
        if math.isclose(energy, top, rel_tol=1e-4):  # Q spans the top-k eigen-directions
            assert v == "high_energy_q" and set(bands) == {(0.5, k + 0.5)} and "top k=" in q_text
        elif math.isclose(energy, bottom, rel_tol=1e-4, abs_tol=1e-9 * float(evals.sum())):
            assert v in ("plate",) and set(bands) == {(d_in - k + 0.5, d_in + 0.5)} and "bottom k=" in q_text
        else:  # random_q's frame; random_b keeps PLATE's Q, bottom for the base rows but not for its own
            assert v in ("random_q", "random_b") and bands == [] and "no band" in q_text
        if set(b.b_idx(name).tolist()) == top_r:
            assert len(hist["shapes"]) == 1 and "B: top r=" in hist["annotations"][0]["text"]
        else:
            assert v == "random_b" and hist["shapes"] == [] and "not the r highest" in hist["annotations"][0]["text"]


def test_report_numbers_equal_a_float64_recomputation_from_the_weights(tmp_path):
    """Every number of a real scan's report against float64 computed here from the checkpoint's weights (not from
    the bundle): B = the top-r rows of |cos| to the anchors, k and k(tau) from the frozen rows' eigenvalues, the
    captured energy of the stored Q, each drawn eigenvalue, the tau cut, the Q band, the B cut-off, the table and
    the k(tau) and parameter curves."""
    from safetensors.torch import load_file as load_weights

    from plate_inspect.testing.synthetic import write_llama_like

    ckpt = write_llama_like(tmp_path / "m", layers=2, dtype=torch.float32, seed=11, planted_fraction=0.2)
    b = plate_inspect.scan(str(ckpt.path), tmp_path / "b", r=8, tau=0.85, max_rank=40)
    d = extract_data(render_report([b], max_points=30))
    weights = {}
    for f in Path(ckpt.path).glob("*.safetensors"):
        weights.update(load_weights(str(f)))
    rows = {
        row[0]: dict(zip([c["key"] for c in d["table"]["columns"]], row, strict=True)) for row in d["table"]["rows"]
    }
    k_of: dict[str, dict[float, int]] = {}
    for name in b.modules:
        w = weights[name + ".weight"].double()
        d_out, d_in = w.shape
        anchors = (torch.arange(min(256, d_out)) * d_out) // min(256, d_out)
        unit = w / w.norm(dim=1, keepdim=True)
        cos = (unit @ unit[anchors].T).abs()
        cos[anchors, torch.arange(len(anchors))] = 0
        scores = cos.sum(1) / (len(anchors) - torch.isin(torch.arange(d_out), anchors).double())
        r = min(8, math.floor(0.9 * d_out))
        b_idx = sorted(torch.sort(scores, descending=True, stable=True).indices[:r].tolist())
        assert b.b_idx(name).tolist() == b_idx, name
        keep = torch.ones(d_out, dtype=torch.bool)
        keep[b_idx] = False
        gram = w[keep].T @ w[keep]
        evals = torch.linalg.eigvalsh(gram).flip(0)[: min(d_out - r, d_in)].clamp_min(0)
        cum = torch.cumsum(evals, 0) / evals.sum()

        def m_tau(tau: float, cum=cum) -> int:
            return int((cum < tau - 1e-12).sum()) + 1

        k_of[name] = {float(t): max(1, min(d_in - m_tau(float(t)), 40)) for t in b.record(name).k_by_tau}
        m, k = m_tau(0.85), k_of[name][0.85]
        q = b.q(name).double()
        energy = float(torch.trace(q.T @ gram @ q) / torch.trace(gram))
        spec = d["spectra"][name]
        x, y = spec["data"][0]["x"], spec["data"][0]["y"]
        # 4 digits drawn; the scan's float32 eigensolve is accurate to ~1e-7 of the largest eigenvalue
        np.testing.assert_allclose(y, evals[torch.tensor(x) - 1].numpy(), rtol=1e-3, atol=1e-6 * float(evals[0]))
        shapes = spec["layout"]["shapes"]
        assert shapes[0]["x0"] == m + 0.5 and (shapes[2]["x0"], shapes[2]["x1"]) == (d_in - k + 0.5, d_in + 0.5)
        cutoff = d["histograms"][name]["layout"]["shapes"][0]["x0"]
        assert math.isclose(cutoff, float(torch.sort(scores, descending=True).values[r - 1]), rel_tol=1e-5)
        row = rows[name]
        assert (row["r"], row["k"], row["plate"], row["lora"]) == (r, k, r * k, r * (d_in + d_out)), name
        assert math.isclose(row["energy"], energy, rel_tol=1e-3, abs_tol=1e-9) and math.isclose(
            row["score"], float(scores.mean()), rel_tol=1e-5
        )
    types: dict[str, list[str]] = {}
    for name in b.modules:
        types.setdefault(b.record(name).module_type, []).append(name)
    curves = [t for t in d["ktau"]["figure"]["data"] if t.get("mode") == "lines+markers"]
    assert {t["name"] for t in curves} == set(types)
    for t in curves:
        for tau, mean_k, (lo, hi) in zip(t["x"], t["y"], t["customdata"], strict=True):
            ks = [k_of[n][tau] for n in types[t["name"]]]
            assert math.isclose(mean_k, float(np.mean(ks)), abs_tol=0.051) and (lo, hi) == (min(ks), max(ks))
    params = d["params"]["figure"]["data"][0]
    assert params["y"] == [sum(8 * k_of[n][tau] for n in b.modules) for tau in params["x"]]
