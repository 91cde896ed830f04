"""``health``: the spectral-health metrics a scan recorded per module (WeightWatcher's conventions)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich import box
from rich.table import Table

from plate_inspect.bundle import Bundle
from plate_inspect.cli.common import console
from plate_inspect.errors import BundleError
from plate_inspect.formatting import counted
from plate_inspect.targets import expert_of

COLUMNS = ("alpha", "alpha_weighted", "spectral_norm", "stable_rank", "entropy", "mp_softrank", "num_spikes")


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def checked_health(b: Bundle, name: str, health: object) -> dict:
    """A module's health record from the manifest, refused (one line naming the module and field) when it is not
    what a scan writes: an object whose metrics are numbers or null."""
    bad = None if isinstance(health, dict) else ("health", health)
    for key in (*COLUMNS, "xmin", "ks_distance", "log_spectral_norm", "num_pl_spikes", "sigma_mp"):
        value = health.get(key) if isinstance(health, dict) else None
        if bad is None and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            bad = (key, value)
    if bad is not None:
        raise BundleError(
            f"{b.path / 'manifest.json'}: module '{name}': health field '{bad[0]}' is {bad[1]!r}, not a number (the "
            "manifest was edited or is corrupt); rescan the model into it with --overwrite to rewrite it"
        )
    assert isinstance(health, dict)  # else bad was set above
    return health


def table_rows(records: dict[str, dict], experts: bool) -> list[tuple[str, list[str]]]:
    """The table's rows: one per module, except that a layer's experts of one type share a row holding the mean of
    each metric over them (a DeepSeek-V3 bundle has ~46,000 experts) unless ``experts``."""
    from plate_inspect.reports.data import group_label

    groups: dict[str, list[dict]] = {}
    for name, h in records.items():
        expert = None if experts else expert_of(name)
        groups.setdefault(name if expert is None else group_label(name, expert), []).append(h)
    rows = []
    for label, members in groups.items():
        if len(members) == 1 and "*" not in label:
            rows.append((label, [_fmt(members[0].get(c)) for c in COLUMNS]))
            continue
        means = []
        for c in COLUMNS:
            values = [h[c] for h in members if h.get(c) is not None]
            means.append(_fmt(sum(values) / len(values)) if values else "-")
        rows.append((f"{label} [{len(members)} experts, mean]", means))
    return rows


@click.command("health")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print {module: health record} as JSON (every module).")
@click.option(
    "--experts", is_flag=True, help="One row per expert (default: one per layer's expert group, its experts' means)."
)
def health_command(bundle: Path, as_json: bool, experts: bool) -> None:
    """Show the spectral health of every module of BUNDLE: power-law alpha (and xmin), alpha-weighted,
    spectral norm, stable rank, entropy, Marchenko-Pastur soft rank and spikes, from the spectrum of the frozen
    rows W_frozen (the one the scan computes; W's own needs another eigvalsh).

    \b
    Examples:
      plate-inspect health bundles/qwen7b
      plate-inspect health bundles/qwen7b --json > health.json
      plate-inspect health bundles/dsv3 --experts     # every expert, not their groups' means
    """
    b = Bundle.load(bundle)
    b.check_parts()  # before anything is shown, as plan/report/verify: a table would include a missing part's modules
    records = {rec.name: checked_health(b, rec.name, rec.health) for rec in b if rec.health is not None}
    if not records:
        raise BundleError(f"{b.path}: no health records (a bundle from an older scan); rescan to add them")
    lacking = len(b.modules) - len(records)
    if as_json:
        click.echo(json.dumps(records, indent=2))
        return
    table = Table(title=f"spectral health ({next(iter(records.values()))['spectrum_of']})", box=box.SIMPLE_HEAD)
    table.add_column("module", no_wrap=True)
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for name, cells in table_rows(records, experts):
        table.add_row(name, *cells)
    console.print(table)
    if lacking:
        console.print(
            f"{counted(lacking, 'module')} of {len(b.modules)} without a health record (not shown; scanned by an older "
            "version): rescan to add them"
        )
    alphas = [h["alpha"] for h in records.values() if h.get("alpha") is not None]
    unfitted = len(records) - len(alphas)
    why = "too few eigenvalues for a tail, or a flat one"
    without = f"; {counted(unfitted, 'module')} without a fit ({why})" if unfitted else ""
    if alphas:
        inside = sum(1 for a in alphas if 2 <= a <= 6)
        console.print(f"alpha: mean {sum(alphas) / len(alphas):.3f}; {inside}/{len(alphas)} modules in [2, 6]{without}")
    elif unfitted:
        console.print(f"alpha: no module has a power-law fit{without}")
