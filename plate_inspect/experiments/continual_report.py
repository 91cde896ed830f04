"""Tables and the self-contained HTML page of the continual benchmark (from :func:`continual.summarize` rows).

The page holds: the plasticity-retention frontier (task-2 accuracy vs task-1 forgetting, one curve per method over
its budgets, 95% CI bars on both axes), the ablation table (PLATE and its matched-capacity controls per budget,
KL ratio to PLATE), and, when several stage-2 step counts were run, forgetting and the Rand-Q/PLATE KL ratio vs steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from plate_inspect.arguments import iterable_argument
from plate_inspect.atomic import atomic_write, path_argument
from plate_inspect.errors import ConfigError
from plate_inspect.experiments.methods import METHODS

if TYPE_CHECKING:
    import plotly.graph_objects as go
    from rich.table import Table

COLORS = {
    "full_ft": "#d62728",
    "l2_init": "#ff9896",
    "lora": "#1f77b4",
    "o_lora": "#aec7e8",
    "pissa": "#9467bd",
    "mica": "#c5b0d5",
    "osf": "#8c564b",
    "corda": "#7f7f7f",
    "plate": "#2ca02c",
    "plate_random_b": "#17becf",
    "plate_least_redundant_b": "#98df8a",
    "plate_random_q": "#ff7f0e",
    "plate_high_energy_q": "#bcbd22",
    "plate_random_bq": "#e377c2",
}
ABLATIONS = tuple(m for m in METHODS if m.startswith("plate"))


#: The keys of a :func:`continual.summarize` row that the tables and figures read.
ROW_KEYS = ("data", "steps", "method", "budget", "seeds", "trainable_params", "data_using", "trainable_pct",
            "task1_acc_before", "forgetting", "task2_acc", "kl_task1")  # fmt: skip


def summary_rows(rows: object, function: str) -> list[dict[str, Any]]:
    """``rows`` as a list when it is a non-empty list of :func:`continual.summarize` rows, else a ConfigError naming
    ``function`` (None was a TypeError, [] "max() arg is an empty sequence", a row of other keys a KeyError)."""
    items = list(iterable_argument(rows, f"{function}: rows", "summary rows (continual.summarize gives them)"))
    if not items:
        raise ConfigError(f"{function}: rows is empty; give the rows continual.summarize makes of at least one run")
    for row in items:
        missing = [key for key in ROW_KEYS if key not in row] if isinstance(row, dict) else list(ROW_KEYS)
        if missing:
            raise ConfigError(
                f"{function}: rows must be continual.summarize rows; {row!r:.80} lacks {', '.join(missing[:3])}"
            )
    return items


def _pm(row: dict[str, Any], key: str, fmt: str) -> str:
    """The mean and its 95% half-width; one seed has no interval ("± n/a", not a misleading "± 0.00")."""
    half = "n/a" if row.get("seeds", 2) < 2 else f"{row[key + '_ci']:{fmt}}"
    return f"{row[key]:{fmt}} ± {half}"


def trainable_text(row: dict[str, Any]) -> str:
    """The trainable count of a summary row: one number, or the range over seeds where it differs (PLATE's k comes
    from each seed's weights), so that it agrees with the % column (the mean over seeds)."""
    lo, hi = row.get("trainable_min", row["trainable_params"]), row.get("trainable_max", row["trainable_params"])
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


def _error_bars(sel: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Plotly error bars of the 95% half-widths, per point: none (null) where that point has one seed (no interval,
    not a 0-width bar), so a one-seed budget does not hide the bars of the method's other budgets."""
    half = [r[key + "_ci"] if r["seeds"] >= 2 else None for r in sel]
    return {"type": "data", "array": half, "visible": any(h is not None for h in half)}


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rank = {m: i for i, m in enumerate(METHODS)}
    return sorted(rows, key=lambda r: (r["data"], r["steps"], rank[r["method"]], r["trainable_params"], r["budget"]))


def _label(row: dict[str, Any]) -> str:
    return row["method"] + (" (data-using)" if row["data_using"] else "")


def main_steps(rows: list[dict[str, Any]]) -> int:
    """The step count the frontier and ablation table show: the largest one run."""
    rows = summary_rows(rows, "main_steps")
    return max(r["steps"] for r in rows)


def kl_ratios(rows: list[dict[str, Any]], steps: int) -> dict[tuple[str, str], float]:
    """(method, budget) -> mean KL / PLATE's mean KL at the same budget and steps."""
    plate = {r["budget"]: r["kl_task1"] for r in rows if r["method"] == "plate" and r["steps"] == steps}
    return {
        (r["method"], r["budget"]): r["kl_task1"] / plate[r["budget"]]
        for r in rows
        if r["steps"] == steps and r["budget"] in plate and plate[r["budget"]] > 0
    }


def rich_table(rows: list[dict[str, Any]], title: str) -> Table:
    """Every (steps, method, budget) row as a rich Table (mean ± 95% CI; accuracies and forgetting in %)."""
    rows = summary_rows(rows, "rich_table")
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
    headers = ("steps", "method", "budget", "trainable", "%", "seeds", "forgetting", "task-2", "sym. KL")
    cells = [
        [
            str(r["steps"]),
            _label(r),
            r["budget"],
            trainable_text(r),
            f"{r['trainable_pct']:.2f}",
            str(r["seeds"]),
            _pm(r, "forgetting", ".2f"),
            _pm(r, "task2_acc", ".2f"),
            _pm(r, "kl_task1", ".4f"),
        ]
        for r in _ordered(rows)
    ]
    for i, col in enumerate(headers):
        width = max([len(col)] + [len(c[i]) for c in cells])
        table.add_column(col, justify="left" if 0 < i < 3 else "right", no_wrap=True, min_width=width)
    for c in cells:
        table.add_row(*c)
    return table


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """All rows as a Markdown table (mean ± 95% CI over seeds)."""
    rows = summary_rows(rows, "markdown_table")
    lines = [
        "| steps | method | budget | trainable | % backbone | seeds | task-1 before (%) | forgetting (pts) "
        "| task-2 (%) | sym. KL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _ordered(rows):
        lines.append(
            f"| {r['steps']} | {_label(r)} | {r['budget']} | {trainable_text(r)} | {r['trainable_pct']:.2f} | "
            f"{r['seeds']} | {r['task1_acc_before']:.2f} | {_pm(r, 'forgetting', '.2f')} | "
            f"{_pm(r, 'task2_acc', '.2f')} | {_pm(r, 'kl_task1', '.4f')} |"
        )
    return "\n".join(lines)


def ablation_rows(rows: list[dict[str, Any]], steps: int) -> list[list[str]]:
    """PLATE and its controls at each budget: cells of the ablation table."""
    ratios = kl_ratios(rows, steps)
    sel = [r for r in _ordered(rows) if r["method"] in ABLATIONS and r["steps"] == steps]
    sel.sort(key=lambda r: (r["trainable_params"], r["budget"], ABLATIONS.index(r["method"])))
    return [
        [
            r["budget"],
            r["method"],
            trainable_text(r),
            _pm(r, "forgetting", ".2f"),
            _pm(r, "task2_acc", ".2f"),
            _pm(r, "kl_task1", ".4f"),
            f"{ratios[(r['method'], r['budget'])]:.2f}" if (r["method"], r["budget"]) in ratios else "-",
        ]
        for r in sel
    ]


ABLATION_HEADERS = ("budget", "method", "trainable", "forgetting (pts)", "task-2 (%)", "sym. KL", "KL / PLATE")


def sensitivity_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Per step count: forgetting of every (method, budget) and the Rand-Q/PLATE KL ratio per budget."""
    out = []
    for steps in sorted({r["steps"] for r in rows}):
        ratios = kl_ratios(rows, steps)
        for r in _ordered([r for r in rows if r["steps"] == steps]):
            ratio = ratios.get(("plate_random_q", r["budget"])) if r["method"] == "plate" else None
            out.append(
                [
                    str(steps),
                    r["method"],
                    r["budget"],
                    _pm(r, "forgetting", ".2f"),
                    _pm(r, "task2_acc", ".2f"),
                    _pm(r, "kl_task1", ".4f"),
                    f"{ratio:.2f}" if ratio is not None else "",
                ]
            )
    return out


SENSITIVITY_HEADERS = ("steps", "method", "budget", "forgetting (pts)", "task-2 (%)", "sym. KL", "Rand-Q/PLATE KL")


def _md(headers: tuple[str, ...], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in body])


def markdown_report(rows: list[dict[str, Any]]) -> str:
    """summary.md: all rows, the ablation table at the main step count, and the step sensitivity if several."""
    rows = summary_rows(rows, "markdown_report")
    steps = main_steps(rows)
    parts = ["## All runs (mean ± 95% CI over seeds)", "", markdown_table(rows)]
    abl = ablation_rows(rows, steps)
    if abl:
        parts += ["", f"## Ablations at {steps} steps", "", _md(ABLATION_HEADERS, abl)]
    if len({r["steps"] for r in rows}) > 1:
        parts += ["", "## Stage-2 step sensitivity", "", _md(SENSITIVITY_HEADERS, sensitivity_rows(rows))]
    return "\n".join(parts)


def frontier_figure(rows: list[dict[str, Any]], steps: int, title: str) -> go.Figure:
    """Task-2 accuracy vs task-1 forgetting, one curve per method over budgets (ordered by size), 95% CI bars."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for method in METHODS:
        sel = sorted(
            (r for r in rows if r["method"] == method and r["steps"] == steps), key=lambda r: r["trainable_params"]
        )
        if not sel:
            continue
        fig.add_trace(
            go.Scatter(
                x=[r["forgetting"] for r in sel],
                y=[r["task2_acc"] for r in sel],
                error_x=_error_bars(sel, "forgetting"),
                error_y=_error_bars(sel, "task2_acc"),
                mode="lines+markers+text",
                text=[r["budget"] for r in sel],
                textposition="top center",
                name=_label(sel[0]),
                marker={"color": COLORS[method], "size": 9},
                line={"dash": "dot" if method.startswith("plate_") else "solid"},
                customdata=[[trainable_text(r), r["trainable_pct"], r["kl_task1"], r["seeds"]] for r in sel],
                hovertemplate=(
                    "%{text}<br>forgetting %{x:.2f} pts<br>task-2 %{y:.2f}%<br>trainable %{customdata[0]}"
                    " (%{customdata[1]:.2f}%)<br>KL %{customdata[2]:.4f}<br>seeds %{customdata[3]}<extra></extra>"
                ),
            )
        )
    fig.update_xaxes(title_text="task-1 forgetting (accuracy points lost; lower is better)")
    fig.update_yaxes(title_text="task-2 test accuracy (%)")
    fig.update_layout(
        title=f"{title}: plasticity-retention frontier, {steps} stage-2 steps (mean ± 95% CI)", height=640
    )
    return fig


#: Heights of table_figure's parts (px): header, each row, the margins above (title) and below, and some slack.
TABLE_HEADER_PX = 28
TABLE_ROW_PX = 22
TABLE_MARGIN_TOP_PX = 60
TABLE_MARGIN_BOTTOM_PX = 10
TABLE_SLACK_PX = 10


def table_figure(headers: tuple[str, ...], body: list[list[str]], title: str) -> go.Figure:
    """A plotly table of already formatted cells (the HTML report's copy of a rich table)."""
    import plotly.graph_objects as go

    columns = [list(col) for col in zip(*body, strict=True)] if body else [[] for _ in headers]
    fig = go.Figure(
        go.Table(
            header={"values": list(headers), "height": TABLE_HEADER_PX},
            cells={"values": columns, "align": "left", "height": TABLE_ROW_PX},
        )
    )
    # tall enough for every row: with plotly's default margins (100 + 80 px) the old 120 + 24 px a row left a
    # 6-row ablation table 84 px, and it showed 3 rows (the rest behind a scroll bar)
    margin = {"t": TABLE_MARGIN_TOP_PX, "b": TABLE_MARGIN_BOTTOM_PX}
    height = margin["t"] + margin["b"] + TABLE_HEADER_PX + TABLE_ROW_PX * len(body) + TABLE_SLACK_PX
    fig.update_layout(title=title, height=height, margin=margin)
    return fig


def sensitivity_figure(rows: list[dict[str, Any]], title: str) -> go.Figure:
    """Forgetting vs stage-2 steps per (method, budget), and the Rand-Q/PLATE KL ratio vs steps per budget."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("forgetting vs steps", "Rand-Q / PLATE KL vs steps"))
    all_steps = sorted({r["steps"] for r in rows})
    for method, budget in sorted({(r["method"], r["budget"]) for r in rows}, key=lambda mb: METHODS.index(mb[0])):
        sel = sorted((r for r in rows if r["method"] == method and r["budget"] == budget), key=lambda r: r["steps"])
        fig.add_trace(
            go.Scatter(
                x=[r["steps"] for r in sel],
                y=[r["forgetting"] for r in sel],
                error_y=_error_bars(sel, "forgetting"),
                mode="lines+markers",
                name=f"{method} {budget}",
                marker={"color": COLORS[method]},
            ),
            row=1,
            col=1,
        )
    budgets = sorted({r["budget"] for r in rows if r["method"] == "plate"})
    for budget in budgets:
        xs, ys = [], []
        for steps in all_steps:
            ratio = kl_ratios(rows, steps).get(("plate_random_q", budget))
            if ratio is not None:
                xs.append(steps)
                ys.append(ratio)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=f"Rand-Q/PLATE {budget}"), row=1, col=2)
    fig.update_xaxes(type="log", title_text="stage-2 Adam steps")
    fig.update_yaxes(title_text="forgetting (pts)", row=1, col=1)
    fig.update_yaxes(title_text="KL ratio", row=1, col=2)
    fig.update_layout(title=f"{title}: sensitivity to the stage-2 step count", height=560)
    return fig


def write_html(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """One self-contained HTML page (plotly.js inlined once) with the frontier, ablation and sensitivity figures."""
    path = path_argument(path, "path")
    rows = summary_rows(rows, "write_html")
    steps = main_steps(rows)
    figures = [frontier_figure(rows, steps, title)]
    abl = ablation_rows(rows, steps)
    if abl:
        figures.append(table_figure(ABLATION_HEADERS, abl, f"Matched-capacity ablations ({steps} steps)"))
    if len({r["steps"] for r in rows}) > 1:
        figures.append(sensitivity_figure(rows, title))
        figures.append(table_figure(SENSITIVITY_HEADERS, sensitivity_rows(rows), "Step sensitivity"))
    body = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    html = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Continual benchmark</title></head><body>"
        + "".join(body)
        + "</body></html>\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, html)
    return path
