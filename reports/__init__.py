"""HTML redundancy reports from PLATE init bundles: one self-contained file (plotly.js inlined, no network).

One bundle gives the single view; two or more give comparison mode (heatmaps differenced against the first
bundle, k(tau), spectra and score histograms overlaid, per-bundle table columns with Δk and B overlap)::

    from plate_inspect import Bundle
    from plate_inspect.reports import write_report
    write_report([Bundle.load("bundles/qwen7b")], "qwen7b.html")

The data behind every plot comes from :func:`report_data` (pure; see :mod:`plate_inspect.reports.data`).
"""

from __future__ import annotations

import os
from pathlib import Path

from plate_inspect.atomic import atomic_write, make_dirs, os_error_reason
from plate_inspect.bundle import Bundle
from plate_inspect.errors import ConfigError, ReportError, refuse_to_replace
from plate_inspect.progress import ProgressCallback, as_callback
from plate_inspect.reports.data import (
    DEFAULT_BINS,
    DEFAULT_MAX_POINTS,
    MAX_BINS,
    BundleSummary,
    Heatmap,
    KTauCurve,
    ReportData,
    ScoreHistogram,
    SpectrumView,
    bundle_summary,
    bundles_argument,
    check_bundles,
    heatmap,
    k_tau_curves,
    report_data,
    score_histogram,
    spectrum_view,
)


def plotly_js() -> str:
    """The plotly.js bundle shipped with the installed plotly package (inlined: no CDN, no network)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def render_report(
    bundles: list[Bundle],
    labels: list[str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    bins: int = DEFAULT_BINS,
    progress: ProgressCallback | None = None,
) -> str:
    """The report's HTML text for ``bundles`` (raises BundleError for incomplete or incompatible bundles)."""
    from plate_inspect.reports.html import render_page

    progress = as_callback(progress, "render_report")  # a deprecation warning names the function called
    if max_points < 16:
        raise ConfigError(f"--max-points (max_points) must be at least 16, got {max_points}")
    if not 2 <= bins <= MAX_BINS:
        raise ConfigError(f"--bins (bins) must be between 2 and {MAX_BINS}, got {bins}")
    rd = report_data(bundles_argument(bundles), labels=labels, max_points=max_points, bins=bins, progress=progress)
    return render_page(rd, plotly_js())


def write_report(
    bundles: list[Bundle],
    path: str | os.PathLike,
    *,
    labels: list[str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    bins: int = DEFAULT_BINS,
    progress: ProgressCallback | None = None,
) -> Path:
    """Write ONE self-contained HTML report for one bundle (single view) or several (comparison); returns its path.

    Incomplete bundles and bundles of different architectures raise :class:`plate_inspect.errors.BundleError`.
    """
    progress = as_callback(progress, "write_report")  # before render_report, so a deprecation names this function
    bundles = bundles_argument(bundles)
    refuse_bundle_file(Path(path), bundles)  # first: its message names the bundle and a path that works there
    path = check_report_path(path)
    text = render_report(bundles, labels=labels, max_points=max_points, bins=bins, progress=progress)
    write_report_text(path, text)
    return path


def check_report_path(path: str | os.PathLike, option: str = "-o", example: str = "report.html") -> Path:
    """Refuse, before any work, a report path that cannot be written: a directory, a parent that cannot be created
    or one without write permission (``option``: the CLI flag the message names). Creates the parent directories."""
    path = Path(path)
    try:
        path.stat()
    except FileNotFoundError:
        pass
    except OSError as e:  # a name too long, a file where a directory should be: is_dir() would raise these
        raise ReportError(
            f"{path}: cannot write the report ({os_error_reason(path, e)}); choose another {option}"
        ) from None
    if path.is_dir():
        raise ReportError(f"{path}: is a directory; give a file name, e.g. {option} {path / example}")
    if path.exists() and not path.is_file():
        raise ReportError(
            f"{path}: is not a regular file (a device, FIFO or socket; writing would replace it); "
            f"give a file name, e.g. {option} {example}"
        )
    refuse_to_replace(path, is_html_page, "an HTML page", "the report", option, example, ReportError)
    make_dirs(path.parent, "the report's directory", option)
    if not os.access(path.parent, os.W_OK):
        raise ReportError(
            f"{path}: cannot write the report (no write permission in {path.parent}); choose another {option}"
        )
    return path


def is_html_page(path: Path) -> bool:
    """Whether an existing file is an HTML page, by name (.html, .htm) or content (an earlier report written to a
    name without that suffix): the one kind of file a report may replace."""
    if path.suffix.lower() in (".html", ".htm"):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip().lower()
    except OSError:
        return False
    return head.startswith((b"<!doctype html", b"<html"))


def refuse_bundle_file(path: Path, bundles: list[Bundle]) -> None:
    """Refuse a report path inside a bundle directory unless it is an HTML file: ``-o bundle/manifest.json`` (or a
    part file) would replace the bundle's own data with the page."""
    where = path.resolve().parent
    for b in bundles:
        if isinstance(b, Bundle) and Path(b.path).resolve() == where and path.suffix.lower() not in (".html", ".htm"):
            raise ReportError(
                f"{path}: is inside the bundle {b.path} and is not an .html file (the report would replace or sit "
                f"among the bundle's own files); choose another -o, e.g. -o {Path(b.path) / 'report.html'}"
            )


def write_report_text(path: Path, text: str, option: str = "-o", remedy: str | None = None) -> None:
    """Write a rendered page atomically; ReportError naming the path, the reason and what to do (``remedy``, else
    choose another ``option``) when it fails."""
    try:
        atomic_write(path, text)
    except OSError as e:
        raise ReportError(
            f"{path}: cannot write the report ({os_error_reason(path, e)}); {remedy or f'choose another {option}'}"
        ) from None


__all__ = [
    "BundleSummary",
    "Heatmap",
    "KTauCurve",
    "ReportData",
    "ReportError",
    "ScoreHistogram",
    "SpectrumView",
    "bundle_summary",
    "check_bundles",
    "check_report_path",
    "heatmap",
    "k_tau_curves",
    "plotly_js",
    "render_report",
    "report_data",
    "score_histogram",
    "spectrum_view",
    "write_report",
]
