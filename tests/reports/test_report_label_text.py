"""Bundle labels with plotly's markup (``<b>``, ``<br>``, ``&lt;``) show as written on every plot.

plotly reads titles, legend names, annotations and hover text as pseudo-HTML: ``<b>base</b>`` showed as "base"
(bold), ``ft<br>2`` broke the line and ``&lt;`` showed as "<". The oracle is the text the browser shows."""

from __future__ import annotations

import pytest
from helpers_reports import MOE_DENSE, MOE_EXPERTS, SMALL_TYPES, write_fake_bundle

from plate_inspect.bundle import Bundle
from plate_inspect.reports import write_report
from plate_inspect.reports.browser import find_chromium, open_report

pytestmark = pytest.mark.browser

LABELS = ["<b>base</b>", "ft<br>2 &lt;v3>"]  # a tag plotly knows (bold), a line break, an entity

# Open the last expert group's expert 5 (the drill-down builds its titles and legend in the page script), then
# collect every title, legend entry and annotation the page shows.
SHOWN_TEXT = """
(async () => {
  const wait = ms => new Promise(r => setTimeout(r, ms));
  const gs = document.getElementById("group-select");
  gs.value = gs.options[gs.options.length - 1].value;
  gs.dispatchEvent(new Event("change"));
  await wait(400);
  document.getElementById("expert-bars-plot").emit("plotly_click", { points: [{ pointIndex: 5 }] });
  await wait(400);
  const text = sel => [...document.querySelectorAll(sel)].map(e => e.textContent);
  return { titles: text(".gtitle"), legend: text(".legendtext"), annotations: text(".annotation-text") };
})()
"""


def test_labels_with_markup_characters_show_as_written(tmp_path):
    chromium = find_chromium()
    assert chromium is not None, "chromium is required (scripts/ensure_chromium.sh installs it)"
    paths = [
        write_fake_bundle(tmp_path / name, 2, MOE_DENSE, r=8, tau=tau, max_rank=16, seed=seed, experts=MOE_EXPERTS,
                          n_experts=8)
        for name, tau, seed in (("a", 0.9, 0), ("b", 0.7, 5))
    ]  # fmt: skip
    html = write_report([Bundle.load(p) for p in paths], tmp_path / "cmp.html", labels=LABELS)
    check = open_report(html, script=SHOWN_TEXT, timeout=120)
    assert check.ready and check.console_errors == [] and check.exceptions == []
    assert check.title == f"PLATE redundancy comparison: {LABELS[0]} vs {LABELS[1]}"
    shown = check.details["script"]
    base, ft = LABELS
    titles, legend, notes = shown["titles"], shown["legend"], shown["annotations"]
    assert any(t.endswith(f"{ft} minus {base}") for t in titles), titles  # a difference heatmap's subtitle
    assert any(t.startswith(f"B overlap: {ft} vs {base}|B ∩ B'| / max(r, r')") for t in titles), titles
    assert any(f"k = {base} " in t and f", {ft} " in t for t in titles if t.startswith("Expert spectrum")), titles
    for series in ("eigenvalues", "cumulative energy", "scores"):  # the module explorer's legends
        assert {f"{series} ({base})", f"{series} ({ft})"} <= set(legend), legend
    assert {f"mlp.experts.gate_proj [{base}]", f"mlp.experts.gate_proj [{ft}]"} <= set(legend), legend  # boxes
    assert {base, ft} <= set(legend), legend  # the drill-down's bars and spectrum lines
    assert any(n.startswith(f"Q [{base}]: ") for n in notes), notes
    assert any(n.endswith(f"({ft})") for n in notes if n.startswith("tau")), notes
    assert not any("&amp;" in t or "&gt;" in t for t in titles + legend + notes)  # escaped once, not twice


# Every plot's titles and legend entries whose right edge lies past the plot's own width (clipped: unreadable).
CLIPPED = """
(() => ({
  clipped: [...document.querySelectorAll(".js-plotly-plot")].map(div => {
    const box = div.querySelector("svg.main-svg").getBoundingClientRect();
    return [div.id, [...div.querySelectorAll(".gtitle, .legendtext")]
      .filter(e => e.getBoundingClientRect().right > box.right + 1).map(e => e.textContent)];
  }),
  legend: [...document.querySelectorAll("#ktau-plot .legendtext")].map(e => e.textContent),
}))()
"""


def test_long_labels_are_cut_in_the_plots_and_shown_whole_in_the_header(tmp_path):
    """Hub ids or paths as labels ran off the plots (a heatmap's subtitle "ft minus base" reached 1,457 px of a
    466 px plot); cut around '…' they fit, stay distinct (they differ only at the end here), and the page title and
    header keep them whole."""
    chromium = find_chromium()
    assert chromium is not None, "chromium is required (scripts/ensure_chromium.sh installs it)"
    long = "meta-llama/Llama-3.1-405B-Instruct-finetuned-on-support-tickets-lr1e-5-checkpoint-120000"
    labels = [long, long + "-v2"]
    paths = [write_fake_bundle(tmp_path / n, 3, SMALL_TYPES, seed=seed) for n, seed in (("a", 0), ("b", 1))]
    html = write_report([Bundle.load(p) for p in paths], tmp_path / "long.html", labels=labels)
    check = open_report(html, script=CLIPPED, timeout=120)
    assert check.ready and check.console_errors == [] and check.exceptions == []
    assert check.title == f"PLATE redundancy comparison: {long} vs {long}-v2"
    assert html.read_text().count(f"<th>{long}-v2</th>") == 1  # the header's column, whole
    got = check.details["script"]
    clipped = {plot: texts for plot, texts in got["clipped"] if texts}
    assert clipped == {}, clipped
    cut = ["meta-l…nt-120000", "meta-l…120000-v2"]  # 16 characters: 6 of the start, '…', 9 of the end
    assert {f"self_attn.q_proj ({c})" for c in cut} <= set(got["legend"]), got["legend"]


# Every title, legend entry and annotation past either side of its plot, on the first view and after opening each
# module in the explorer (the spectrum and scores plots change with the module).
CLIPPED_PER_MODULE = """
(async () => {
  const wait = ms => new Promise(r => setTimeout(r, ms));
  const out = [];
  const check = where => [...document.querySelectorAll(".js-plotly-plot")].forEach(div => {
    const box = div.querySelector("svg.main-svg").getBoundingClientRect();
    [...div.querySelectorAll(".gtitle, .legendtext, .annotation")].forEach(e => {
      const r = e.getBoundingClientRect();
      if (r.width && (r.right > box.right + 1 || r.left < box.left - 1)) { out.push([where, div.id, e.textContent]); }
    });
  });
  check("first view");
  const select = document.getElementById("module-select");
  for (const option of [...select.options]) {
    select.value = option.value;
    select.dispatchEvent(new Event("change"));
    await wait(150);
    check(option.value);
  }
  return { clipped: out, modules: select.options.length };
})()
"""


def test_line_labels_stay_inside_their_plots_wherever_the_line_is(tmp_path):
    """The spectrum's tau-cut label started at the cut when it lay in the left half and ended there in the right
    half; one line of ~380 px with a bundle label ran past the right edge (a cut just left of the middle) or the left
    one (just right of it) of a 704 px plot. It is two lines now, on the side of the line with more room, as are the
    k(tau) and score histogram labels."""
    chromium = find_chromium()
    assert chromium is not None, "chromium is required (scripts/ensure_chromium.sh installs it)"
    long = "meta-llama/Llama-3.1-405B-Instruct-finetuned-on-support-tickets-lr1e-5-checkpoint-120000"
    paths = [
        write_fake_bundle(tmp_path / n, 3, SMALL_TYPES, seed=seed, tau=tau)
        for n, seed, tau in (("a", 0, 0.9), ("b", 1, 0.99))
    ]
    html = write_report([Bundle.load(p) for p in paths], tmp_path / "cuts.html", labels=[long, long + "-v2"])
    check = open_report(html, script=CLIPPED_PER_MODULE, timeout=180)
    assert check.ready and check.console_errors == [] and check.exceptions == []
    got = check.details["script"]
    assert got["modules"] == len(Bundle.load(paths[0])) and got["clipped"] == [], got["clipped"]
