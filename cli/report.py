"""``report``: one self-contained HTML redundancy report for a bundle, or a comparison of several."""

from __future__ import annotations

from pathlib import Path

import click

from plate_inspect.bundle import Bundle
from plate_inspect.cli.common import console, human_bytes, progress_bar, quiet_option


@click.command("report")
@click.argument("bundles", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--out",
    "-o",
    type=click.Path(path_type=Path),
    default=Path("report.html"),
    show_default=True,
    help="HTML file to write.",
)
@click.option("--labels", default=None, help="Comma-separated display names, one per bundle [default: dir names].")
@click.option(
    "--max-points",
    type=int,
    default=300,
    show_default=True,
    help="Spectra longer than this are drawn downsampled (the plot says so).",
)
@click.option("--bins", type=int, default=40, show_default=True, help="Bins of the redundancy score histograms.")
@quiet_option()
def report_command(
    bundles: tuple[Path, ...], out: Path, labels: str | None, max_points: int, bins: int, quiet: bool
) -> None:
    """Write ONE self-contained HTML report (plotly.js inlined; opens offline) for BUNDLE.

    With two or more bundles (same architecture) the report compares them: heatmaps of the change
    against the first bundle and of B overlap, k(tau), spectra and score histograms overlaid, and
    per-bundle columns in the module table.

    \b
    Examples:
      plate-inspect report bundles/qwen7b -o qwen7b.html
      plate-inspect report bundles/qwen7b-tau0.8 bundles/qwen7b-tau0.95 -o compare.html
      plate-inspect report bundles/base bundles/finetuned --labels base,ft -o drift.html
      plate-inspect scan ./model --report          # scan, then write <out>/report.html
    """
    from plate_inspect.reports import write_report

    loaded = [Bundle.load(p) for p in bundles]  # BundleError (one line) for missing or incomplete bundles
    names = [x.strip() for x in labels.split(",")] if labels else None
    with progress_bar("report", quiet=quiet, transient=True) as progress:
        path = write_report(loaded, out, labels=names, max_points=max_points, bins=bins, progress=progress)
    mode = "comparison of " + ", ".join(str(p) for p in bundles) if len(loaded) > 1 else str(bundles[0])
    console.print(f"report: {path} ({human_bytes(path.stat().st_size)}; {mode})")
