"""``audit``: how much of a fine-tune lands in the input directions and output rows PLATE would protect."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.table import Table

from plate_inspect.cli.common import console, progress_bar, quiet_option, split_names
from plate_inspect.targets import check_target_patterns, parse_layers


@click.command("audit")
@click.argument("base")
@click.argument("tuned")
@click.option("--bundle", type=click.Path(path_type=Path), default=None, help="Take B from this bundle of BASE.")
@click.option("--tau", type=float, default=0.9, show_default=True, help="Protected energy: top-m(tau) directions.")
@click.option("--r", "r", type=int, default=64, show_default=True, help="|B| when no bundle is given (as scan).")
@click.option("--anchors", type=int, default=256, show_default=True, help="Anchor rows for B (as scan).")
@click.option("--sketch-dim", type=int, default=None, help="B from the paper's sketched scores (as scan).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed (as scan; used with --sketch-dim).")
@click.option(
    "--target-modules", default=None, help="Modules to audit (as scan); narrows a bundle's or adapter's modules too."
)
@click.option(
    "--layers",
    default=None,
    help="Layer indices, e.g. '0-3,7', 'decoder:0-3' or 'decoder' (as scan); narrows any audit too.",
)
@click.option("--precision", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
@click.option("--revision", default=None, help="Hub revision of BASE/TUNED.")
@click.option("--offline", is_flag=True, help="Never contact the hub.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of records instead of the table.")
@click.option("--report", type=click.Path(path_type=Path), default=None, help="Also write a self-contained HTML audit.")
@click.option("--top", type=click.IntRange(min=0), default=30, show_default=True, help="Rows of the table (0: all).")
@quiet_option()
def audit_command(
    base: str,
    tuned: str,
    bundle: Path | None,
    target_modules: str | None,
    layers: str | None,
    offline: bool,
    as_json: bool,
    report: Path | None,
    top: int,
    quiet: bool,
    **settings: Any,
) -> None:
    """Audit TUNED against BASE from the weights alone: for every module with update dW,

    \b
      protected_input_share = ||dW P||^2 / ||dW||^2  (P: top-m(tau) eigenvectors of W_frozen^T W_frozen)
      frozen_row_share      = share of ||dW||^2 on rows outside B
      delta_norm, relative_delta = ||dW||, ||dW|| / ||W||
    A PLATE update scores ~0 on both shares; a dense random update ~m/d_in (shown as 'chance').
    Modules are ranked by risk = ||dW P|| / ||W||.

    TUNED: a fine-tuned checkpoint (dir, .safetensors, hub id), a PEFT LoRA adapter dir, or a PLATE
    adapter (save_adapter file or PEFT dir; B and Q from its bundle).

    \b
    Examples:
      plate-inspect audit ./base ./finetuned
      plate-inspect audit Qwen/Qwen2.5-7B ./lora-adapter --bundle bundles/qwen7b --json
      plate-inspect audit ./base adapter.safetensors --report audit.html
      plate-inspect audit ./base ./finetuned --bundle bundles/base --layers 0-3 --target-modules q_proj,v_proj
    """
    from plate_inspect.auditing import (
        TABLE_COLUMNS,
        audit,
        audit_notes,
        rank_by_risk,
        rounding_kind,
        summarize,
        table_cells,
    )

    check_target_patterns(split_names(target_modules))
    if report is not None:  # before the audit, which takes minutes on a large model
        from plate_inspect.reports import check_report_path

        check_report_path(report, "--report", "audit.html")
    with progress_bar("audit", quiet=quiet or as_json, transient=True) as progress:
        records = audit(  # settings: --tau, --r, --anchors, --sketch-dim, --seed, --precision, --revision by name
            base,
            tuned,
            bundle,
            target_modules=split_names(target_modules),
            layers=parse_layers(layers),
            offline=True if offline else None,
            progress=progress,
            **settings,
        )
    if report is not None:
        from plate_inspect.reports.audit import write_audit_report

        write_audit_report(records, report, title=f"audit: {tuned} against {base}", layers=parse_layers(layers))
    if as_json:
        click.echo(json.dumps([rec.to_json() for rec in records], indent=2))
        return
    ranked = rank_by_risk(records)
    shown = ranked if top <= 0 else ranked[:top]
    table = Table(
        title=f"modules by risk (tau={settings['tau']:g}; {len(shown)} of {len(records)})",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col == "module" else "right", no_wrap=col == "module")
    for rec in shown:
        table.add_row(*table_cells(rec))
    console.print(table)
    s = summarize(records)
    line = (
        f"model: {s.touched}/{s.modules} modules changed; protected share {s.protected_input_share:.4f}, "
        f"frozen-row share {s.frozen_row_share:.4f} (energy-weighted); ||dW||/||W|| {s.relative_delta:.3e}; "
        f"risk sqrt(sum ||dW P||^2 / sum ||W||^2) = {s.risk:.3e}"
    )
    rounding = rounding_kind(records)
    if s.touched == 0:  # shares of no update are not 0 (PLATE's form): say what happened
        line = (
            f"model: 0/{s.modules} modules changed: TUNED's weights equal BASE's in every audited module (no update "
            "to score; check that TUNED is the fine-tuned model)"
        )
        if rounding:
            line = (
                f"model: 0/{s.modules} modules changed: no update beyond {rounding} (TUNED equals BASE rounded to its "
                "storage in every audited module)"
            )
    console.print(line, soft_wrap=True)  # one line, as scripts grep it, whatever the terminal width
    for note in audit_notes(records):
        console.print(f"note: {note}", soft_wrap=True)
    if report is not None:
        console.print(f"report: {report}")
