"""The report page: HTML skeleton, CSS and the plain-JS page script (no external resources).

Placeholders ``%%NAME%%`` are filled by :func:`plate_inspect.reports.html.render_page`.
"""

CSS = """
:root { --fg:#1d2330; --dim:#6b7280; --line:#e5e7eb; --bg:#f7f8fa; --accent:#4f46e5; --warn:#b45309; }
* { box-sizing: border-box; }
body { margin:0; font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; color:var(--fg); background:var(--bg);
       font-size:14px; }
header.top { background:#1e1b4b; color:white; padding:14px 24px; }
header.top h1 { margin:0; font-size:20px; font-weight:600; }
header.top .gen { color:#c7d2fe; font-size:12px; margin-top:4px; }
nav { display:flex; gap:16px; padding:8px 24px; background:white; border-bottom:1px solid var(--line);
      position:sticky; top:0; z-index:10; }
nav a { color:var(--accent); text-decoration:none; font-size:13px; }
main { padding:12px 24px 40px; max-width:1800px; margin:0 auto; }
section { background:white; border:1px solid var(--line); border-radius:8px; padding:12px 16px; margin:14px 0; }
section h2 { font-size:16px; margin:4px 0 4px; }
p.note { color:var(--dim); font-size:12px; margin:2px 0 10px; }
.dim { color:var(--dim); }
.warn { color:var(--warn); }
table.summary { border-collapse:collapse; font-size:13px; }
table.summary th, table.summary td { text-align:left; padding:4px 12px 4px 0; border-bottom:1px solid var(--line);
      vertical-align:top; }
table.summary th[scope=row] { color:var(--dim); font-weight:normal; white-space:nowrap; }
.grid { display:grid; grid-template-columns:repeat(auto-fill, minmax(400px, 1fr)); gap:10px; }
.grid2 { display:grid; grid-template-columns:repeat(auto-fit, minmax(520px, 1fr)); gap:10px; }
.plot { min-height:300px; }
.controls { display:flex; flex-wrap:wrap; gap:8px; align-items:center; margin:6px 0 8px; }
.controls select { max-width:560px; font-size:13px; padding:3px; }
.controls input { font-size:13px; padding:4px 6px; width:420px; }
button { font-size:13px; padding:3px 10px; cursor:pointer; }
.tablewrap { max-height:560px; overflow:auto; border:1px solid var(--line); }
table.modules { border-collapse:collapse; font-size:12px; width:100%; }
table.modules th { position:sticky; top:0; background:#eef0f6; cursor:pointer; user-select:none; text-align:right;
      padding:5px 8px; white-space:nowrap; border-bottom:1px solid #d1d5db; }
table.modules th.str, table.modules td.str { text-align:left; }
table.modules td { padding:3px 8px; text-align:right; border-bottom:1px solid #f0f1f4; white-space:nowrap;
      font-variant-numeric:tabular-nums; }
table.modules tbody tr:hover { background:#eef2ff; cursor:pointer; }
table.modules tbody tr.current { background:#e0e7ff; }
th.sorted-asc::after { content:" \\25B2"; font-size:9px; }
th.sorted-desc::after { content:" \\25BC"; font-size:9px; }
#table-count { color:var(--dim); font-size:12px; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("report-data").textContent);
  var CONFIG = { responsive: true, displaylogo: false, displayModeBar: "hover",
                 modeBarButtonsToRemove: ["sendDataToCloud", "lasso2d", "select2d"] };
  var pending = [];

  function isObj(v) { return v !== null && typeof v === "object" && !Array.isArray(v); }
  function merge(base, patch) {
    var out = {}, k;
    for (k in base) { out[k] = base[k]; }
    for (k in patch) { out[k] = (isObj(patch[k]) && isObj(base[k])) ? merge(base[k], patch[k]) : patch[k]; }
    return out;
  }
  function draw(id, fig) {
    var el = document.getElementById(id);
    var p = Plotly.newPlot(el, fig.data, fig.layout, CONFIG);
    pending.push(p);
    return p.then(function () { return el; });
  }

  // ------------------------------------------------------------ module explorer
  var select = document.getElementById("module-select");
  var current = null;
  D.modules.forEach(function (name) {
    var o = document.createElement("option");
    o.value = name; o.textContent = name; select.appendChild(o);
  });
  function showModule(name) {
    var sf = D.spectra[name], hf = D.histograms[name];
    current = name;
    select.value = name;
    markTableRow();
    return Promise.all([
      Plotly.react("spectrum-plot", sf.data, merge(D.spectrumBase, sf.layout), CONFIG),
      Plotly.react("scores-plot", hf.data, merge(D.histogramBase, hf.layout), CONFIG)
    ]);
  }
  function selectModule(name, scroll) {
    if (!(name in D.spectra)) { return; }
    showModule(name);
    if (scroll) { document.getElementById("explorer").scrollIntoView({ behavior: "smooth" }); }
  }
  function step(delta) {
    var i = D.modules.indexOf(current) + delta;
    if (i >= 0 && i < D.modules.length) { selectModule(D.modules[i], false); }
  }
  select.addEventListener("change", function () { selectModule(select.value, false); });
  document.getElementById("module-prev").addEventListener("click", function () { step(-1); });
  document.getElementById("module-next").addEventListener("click", function () { step(1); });

  // ------------------------------------------------------------ experts: per-layer groups, drill-down
  var G = D.expertGroups, groupIndex = {}, currentGroup = null, barsBound = false;
  var groupSelect = document.getElementById("group-select");
  var expertSelect = document.getElementById("expert-select");
  G.forEach(function (g, i) {
    groupIndex[g.id] = i;
    var o = document.createElement("option");
    o.value = g.id; o.textContent = g.label + " (" + g.experts.length + " experts)"; groupSelect.appendChild(o);
  });
  D.expertBoxes.forEach(function (b) { draw(b.id, b.figure); });
  function sub(text) { return "<br><span style='font-size:11px;color:#666'>" + text + "</span>"; }
  var PACK = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", packCode = {};
  for (var pc = 0; pc < PACK.length; pc++) { packCode[PACK[pc]] = pc; }
  function unpackLogs(text) {  // reports/html.py pack_logs: 3 base64 chars per log10 value, code 0 = zero
    var out = [];
    for (var i = 0; i < text.length; i += 3) {
      var c = packCode[text[i]] * 4096 + packCode[text[i + 1]] * 64 + packCode[text[i + 2]];
      out.push(c === 0 ? null : (c - 1) / 100 - 100);
    }
    return out;
  }
  function showExpert(g, pos) {
    // one line per bundle: the same expert's compact spectrum; the Q band is the first bundle's: its bottom k
    // (PLATE), its top k (the high_energy_q ablation), or none where Q is no eigenspace of this spectrum
    var dIn = g.shape[1], many = g.bundles.length > 1, base = D.expertSpectrumBase;
    var traces = g.bundles.map(function (b, j) {
      var idx = b.specIndex, vals = unpackLogs(b.spectra[pos]), x = [], y = [];
      for (var i = 0; i < vals.length; i++) {
        if (vals[i] !== null) { x.push(idx[i]); y.push(Math.pow(10, vals[i])); }
      }
      var extra = many ? { name: D.labels[j], line: { color: D.bundleColors[j] },
                           marker: merge(base.data[0].marker, { color: D.bundleColors[j] }) } : {};
      return merge(base.data[0], merge(extra, { x: x, y: y,
        hovertemplate: (many ? D.labels[j] + ": " : "") + "direction %{x}<br>eigenvalue %{y:.3e}<extra></extra>" }));
    });
    var first = g.bundles[0], k = first.k[pos], idx0 = first.specIndex, where = first.qDirections;
    var start = where === "top" ? 1 : dIn - k + 1, stop = where === "top" ? k : dIn;
    var ablation = first.variant ? "; ablation " + first.variant : "";
    var qLabel = "Q" + (many ? " [" + D.labels[0] + "]" : "") + ": ";
    if (where === "random" || where === "base") {  // as figures._q_band words it
      qLabel += "k=" + k + ", no band drawn (ablation " + first.variant + ": " +
        (where === "random" ? "a random orthonormal k-frame" : "PLATE's Q of the base bundle's rows") + ")";
    } else {
      qLabel += where + " k=" + k + " directions (" + start + ".." + stop + ablation.replace(";", ",") + ")";
    }
    var band = where === "random" || where === "base" ? [] :
      [{ type: "rect", xref: "x", yref: "paper", x0: start - 0.5, x1: stop + 0.5, y0: 0, y1: 1,
         fillcolor: "#636efa", opacity: 0.12, line: { width: 0 } }];
    var drawn = first.spectra[pos].length / 3;
    var kText = many ? "k = " + g.bundles.map(function (b, j) { return D.labels[j] + " " + b.k[pos]; }).join(", ")
                     : "k = " + k + ", captured energy " + Number(first.energy[pos]).toExponential(2);
    var layout = merge(base.layout, {
      title: { text: "Expert spectrum: " + g.label.replace("*", String(g.experts[pos])) +
        sub(kText + "; " + traces[0].x.length + " evenly spaced eigenvalues drawn" +
            (drawn < dIn ? "; directions past " + idx0[idx0.length - 1] + " are null" : "")) },
      showlegend: many,
      xaxis: { range: [0.5, dIn + 0.5] },
      shapes: band,
      annotations: [{ x: dIn + 0.5, y: 0.02, xref: "x", yref: "paper", showarrow: false, xanchor: "right",
                      yanchor: "bottom", text: qLabel, font: { size: 10 } }]
    });
    expertSelect.value = String(pos);
    return Plotly.react("expert-spectrum-plot", traces, layout, CONFIG);
  }
  function showGroup(id) {
    var g = G[groupIndex[id]], bars = D.expertBarsBase, many = g.bundles.length > 1;
    currentGroup = g;
    groupSelect.value = id;
    var frag = document.createDocumentFragment();
    g.experts.forEach(function (e, i) {
      var o = document.createElement("option"); o.value = String(i); o.textContent = "expert " + e; frag.appendChild(o);
    });
    expertSelect.replaceChildren(frag);
    // one bar series per bundle (side by side); a single bundle's bars are coloured by mean redundancy
    var traces = g.bundles.map(function (b, j) {
      // colour range [0, the largest score] ([0, 1] when the experts' scores do not differ), as the heatmap's
      var top = Math.max.apply(null, b.score), differ = b.score.some(function (v) { return v !== b.score[0]; });
      var marker = many ? { color: D.bundleColors[j], showscale: false }
                        : { color: b.score, cmin: 0, cmax: differ && top > 0 ? top : 1 };
      return merge(bars.data[0], { x: g.experts, y: b.k, name: many ? D.labels[j] : "k", marker: marker,
        customdata: b.energy.map(function (v, i) { return [v, b.score[i]]; }) });
    });
    var rs = g.bundles.map(function (b) { return b.r; }).join("/");
    var layout = merge(bars.layout, { barmode: "group", showlegend: many, title: { text: "k per expert: " + g.label +
      sub("[d_out, d_in] = [" + g.shape.join(", ") + "], r = " + rs +
          (many ? "; one bar per bundle" : "; colour: mean redundancy")) } });
    var p = Plotly.react("expert-bars-plot", traces, layout, CONFIG).then(function (el) {
      if (!barsBound) {
        barsBound = true;
        el.on("plotly_click", function (ev) { showExpert(currentGroup, ev.points[0].pointIndex); });
      }
    });
    return Promise.all([p, showExpert(g, 0)]);
  }
  function selectGroup(id, scroll) {
    if (!(id in groupIndex)) { return; }
    showGroup(id);
    if (scroll) { document.getElementById("experts").scrollIntoView({ behavior: "smooth" }); }
  }
  if (groupSelect) {
    groupSelect.addEventListener("change", function () { showGroup(groupSelect.value); });
    expertSelect.addEventListener("change", function () { showExpert(currentGroup, Number(expertSelect.value)); });
  }

  // ------------------------------------------------------------ heatmaps, k(tau)
  D.heatmaps.forEach(function (h) {
    draw(h.id, h.figure).then(function (el) {
      el.on("plotly_click", function (ev) {
        var p = ev.points[0], tr = h.figure.data[0];
        var i = tr.y.indexOf(String(p.y)), j = tr.x.indexOf(String(p.x));
        var name = (i >= 0 && j >= 0 && h.names[i]) ? h.names[i][j] : null;
        if (name && name in groupIndex) { selectGroup(name, true); } else if (name) { selectModule(name, true); }
      });
    });
  });
  draw(D.ktau.id, D.ktau.figure);
  draw(D.params.id, D.params.figure);

  // ------------------------------------------------------------ table
  var T = D.table, sortCol = null, sortDir = 1;
  var thead = document.querySelector("#module-table thead");
  var tbody = document.querySelector("#module-table tbody");
  var filterBox = document.getElementById("table-filter");
  var countEl = document.getElementById("table-count");
  var keyIndex = {};
  T.columns.forEach(function (c, i) { keyIndex[c.key.toLowerCase()] = i; });

  function fmt(v, f) {
    if (v === null || v === undefined) { return "\u2013"; }
    switch (f) {
      case "int": return Number(v).toLocaleString("en-US");
      case "exp": return Number(v).toExponential(3);
      case "f4": return Number(v).toFixed(4);
      case "f3": return Number(v).toFixed(3);
      case "signed": return (v > 0 ? "+" : "") + Number(v).toLocaleString("en-US");
      default: return String(v);
    }
  }
  function cmp(a, b) {
    if (a === b) { return 0; }
    if (a === null || a === undefined) { return 1; }
    if (b === null || b === undefined) { return -1; }
    if (typeof a === "number" && typeof b === "number") { return a - b; }
    return String(a).localeCompare(String(b), "en", { numeric: true });
  }
  // filter terms: plain words match module name or type; "key<v", "key>=v", "key=v" compare a column
  function parseFilter(text) {
    return text.trim().split(/\s+/).filter(Boolean).map(function (t) {
      var m = /^([A-Za-z_]\w*)(<=|>=|<|>|=)(.+)$/.exec(t);
      if (m && (m[1].toLowerCase() in keyIndex)) {
        return { col: keyIndex[m[1].toLowerCase()], op: m[2], value: m[3] };
      }
      return { word: t.toLowerCase() };
    });
  }
  function passes(row, terms) {
    return terms.every(function (t) {
      if (t.word !== undefined) { return (row[0] + " " + row[1]).toLowerCase().indexOf(t.word) >= 0; }
      var v = row[t.col], num = Number(t.value);
      if (t.op === "=") { return isNaN(num) ? String(v) === t.value : v === num; }
      if (v === null || v === undefined || isNaN(num)) { return false; }
      if (t.op === "<") { return v < num; }
      if (t.op === "<=") { return v <= num; }
      if (t.op === ">") { return v > num; }
      return v >= num;
    });
  }
  function renderTable() {
    var terms = parseFilter(filterBox.value);
    var rows = T.rows.filter(function (r) { return passes(r, terms); });
    if (sortCol !== null) {
      rows = rows.map(function (r, i) { return [r, i]; }).sort(function (a, b) {
        return cmp(a[0][sortCol], b[0][sortCol]) * sortDir || a[1] - b[1];
      }).map(function (p) { return p[0]; });
    }
    var frag = document.createDocumentFragment();
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      tr.dataset.module = r[0];
      T.columns.forEach(function (c, i) {
        var td = document.createElement("td");
        td.textContent = fmt(r[i], c.fmt);
        if (c.fmt === "str") { td.className = "str"; }
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    });
    tbody.replaceChildren(frag);
    countEl.textContent = rows.length + " of " + T.rows.length + " modules";
    markTableRow();
  }
  function markTableRow() {
    if (!tbody) { return; }
    Array.prototype.forEach.call(tbody.rows, function (tr) {
      tr.classList.toggle("current", tr.dataset.module === current);
    });
  }
  var headRow = document.createElement("tr");
  T.columns.forEach(function (c, i) {
    var th = document.createElement("th");
    th.textContent = c.label;
    th.title = "sort by " + c.label + " (filter: " + c.key + "<value)";
    th.dataset.key = c.key;
    if (c.fmt === "str") { th.className = "str"; }
    th.addEventListener("click", function () {
      sortDir = (sortCol === i) ? -sortDir : 1;
      sortCol = i;
      Array.prototype.forEach.call(headRow.children, function (h) { h.classList.remove("sorted-asc", "sorted-desc"); });
      th.classList.add(sortDir > 0 ? "sorted-asc" : "sorted-desc");
      renderTable();
    });
    headRow.appendChild(th);
  });
  thead.appendChild(headRow);
  filterBox.addEventListener("input", renderTable);
  tbody.addEventListener("click", function (ev) {
    var tr = ev.target.closest("tr");
    if (!tr || !tr.dataset.module) { return; }
    if (T.groups && tr.dataset.module in T.groups) { selectGroup(T.groups[tr.dataset.module], true); }
    else { selectModule(tr.dataset.module, true); }
  });
  renderTable();

  if (D.modules.length) { pending.push(showModule(D.modules[0])); }
  else { document.getElementById("explorer").remove(); }
  if (G.length) { pending.push(showGroup(G[0].id)); }
  else { var link = document.querySelector("nav a[href='#experts']"); if (link) { link.remove(); } }
  Promise.all(pending).then(function () {
    window.__reportReady = true;
    document.body.setAttribute("data-ready", "1");
  }, function (err) {
    window.__reportError = String(err);
    console.error("report: a plot failed to render: " + err);
  });
})();
"""

#: The experts section, filled in by :func:`plate_inspect.reports.html.expert_section` when a bundle has experts.
EXPERT_SECTION = """<section id="experts"><h2>Experts</h2>
<p class="note">%%EXPERT_NOTE%% Per layer, the distribution over experts (box: quartiles; whiskers: min and max;
dashed: mean) of k, the captured energy and the mean redundancy. Pick a group (or click a heatmap cell or table
row of experts) to see each expert's k (one bundle: coloured by its mean redundancy; several: one bar per bundle);
click an expert for its spectrum (one line per bundle), drawn from a few evenly spaced eigenvalues.</p>
<div class="grid">%%EXPERT_BOXES%%</div>
<div class="controls"><label for="group-select">expert group</label> <select id="group-select"></select>
<label for="expert-select">expert</label> <select id="expert-select"></select></div>
<div class="grid2"><div class="plot" id="expert-bars-plot"></div>
<div class="plot" id="expert-spectrum-plot"></div></div>
</section>"""

PAGE = (
    """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="plate-inspect">
<title>%%TITLE%%</title>
<style>"""
    + CSS
    + """</style>
<script>%%PLOTLY_JS%%</script>
</head>
<body>
<header class="top"><h1>%%TITLE%%</h1><div class="gen">%%GENERATED%%</div></header>
<nav><a href="#summary">summary</a><a href="#heatmaps">layer x type</a><a href="#ktau">k(tau)</a>
<a href="#experts">experts</a><a href="#explorer">module explorer</a><a href="#modules">module table</a></nav>
<main>
<section id="summary"><h2>Bundle</h2>
%%HEADER%%
<p class="note">PLATE trains r&middot;k parameters per module (A is r x k); LoRA at the same r trains
r&middot;(d_in+d_out). Q memory counts d_in&middot;k values per module in the bundle's Q dtype.</p>
</section>
<section id="heatmaps"><h2>Layer x module type</h2>
<p class="note">Mean redundancy score (mean |cos| of each output row to the anchor rows), k = dim Q, and the
fraction of the frozen rows' energy that Q captures (tr(Q<sup>T</sup>GQ)/tr(G): small means Q sits in the
low-energy subspace). Hover a cell for the module's exact numbers. %%HEATMAP_INTRO%%</p>
<div class="grid">%%HEATMAPS%%</div>
</section>
<section id="ktau"><h2>k(tau): the plasticity knob</h2>
<p class="note">k = max(1, min(d_in &minus; m(tau), max_rank)) where the top m(tau) eigen-directions of the frozen
rows hold a tau fraction of their energy: larger tau, smaller k. Curves come from the manifest's tau grid;
stars mark the bundle's tau.</p>
<div class="grid2"><div class="plot" id="ktau-plot"></div><div class="plot" id="params-plot"></div></div>
</section>
%%EXPERTS%%
<section id="explorer"><h2>Module explorer</h2>
<p class="note">Energy spectrum of W<sub>frozen</sub><sup>T</sup>W<sub>frozen</sub> (log scale; dotted: cumulative
energy, right axis) with the tau cut and Q's bottom-k directions shaded; and the distribution of redundancy scores
with the B cut-off (the r highest-scoring rows form B). %%DOWNSAMPLE_NOTE%%</p>
<div class="controls"><label for="module-select">module</label> <select id="module-select"></select>
<button id="module-prev" type="button">&larr; previous</button>
<button id="module-next" type="button">next &rarr;</button>
<span class="dim">(or click a heatmap cell / table row)</span></div>
<div class="grid2"><div class="plot" id="spectrum-plot"></div><div class="plot" id="scores-plot"></div></div>
</section>
<section id="modules"><h2>Modules</h2>
<div class="controls"><input id="table-filter" type="search"
placeholder="filter: words match name/type; or k<200, energy>1e-3, layer=3" aria-label="filter modules">
<span id="table-count"></span><span class="dim">click a column header to sort, a row to explore it</span></div>
<div class="tablewrap"><table class="modules" id="module-table"><thead></thead><tbody></tbody></table></div>
</section>
</main>
<script type="application/json" id="report-data">%%DATA%%</script>
<script>"""
    + SCRIPT
    + """</script>
</body>
</html>
"""
)
