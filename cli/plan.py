"""``plan``: per-module k for a trainable-parameter budget, from a bundle's spectra (no rescan)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import click
from rich import box
from rich.table import Table

from plate_inspect.cli.common import console, err_console


@click.command("plan")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--budget",
    required=True,
    help="Parameters ('2e6' or '2,000,000'), a share of the target weights ('1%'), or LoRA's count at a rank "
    "('lora:16', 'lora 16' or 'as LoRA r=16').",
)
@click.option(
    "--objective",
    type=click.Choice(["minimax", "mean"]),
    default="minimax",
    show_default=True,
    help="minimax: smallest worst-module captured energy; mean: smallest mean captured energy.",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the plan here [default: plan.json; with --json only when -o is given].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan JSON on stdout instead of the summary.")
def plan_command(bundle: Path, budget: str, objective: str, out: Path | None, as_json: bool) -> None:
    """Choose k per module (at the bundle's r) for a trainable-parameter BUDGET and write the plan JSON.

    k comes from the bundle's spectra (captured energy of Q[:, :k] = the k smallest eigenvalues over the
    total), never more than the bundle's k: to give the planner room, scan with a smaller tau. Train with
    apply_bundle(..., plan=...) or PlateConfig(plan=...).

    \b
    Examples:
      plate-inspect plan bundles/qwen7b --budget 1% -o plan.json
      plate-inspect plan bundles/qwen7b --budget lora:16 --objective mean
      plate-inspect plan bundles/qwen7b --budget 2e6 --json | jq .summary    # writes no file
    """
    from plate_inspect.plan import plan_budget, write_plan

    plan = plan_budget(bundle, budget, objective)
    if out is None and not as_json:
        out = Path("plan.json")
    if out is not None:
        write_plan(plan, out)
    data = plan.to_json()
    if as_json:  # stdout is the plan alone; a file only where -o asked for one (it may overwrite a plan there)
        click.echo(json.dumps(data, indent=2))
        if out is not None:
            err_console.print(f"plan: {out}")
        return
    groups: dict[str, list[dict]] = defaultdict(list)
    from plate_inspect.bundle import Bundle

    b = Bundle.load(bundle)
    for name, m in plan.modules.items():
        groups[b.record(name).module_type].append(m)
    table = Table(title=f"plan: {objective}, budget {budget}", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("module type", "count", "mean k", "bundle k", "min tau", "max captured", "params"):
        table.add_column(col, justify="left" if col == "module type" else "right")
    for module_type, ms in groups.items():
        table.add_row(
            module_type,
            str(len(ms)),
            f"{sum(m['k'] for m in ms) / len(ms):.1f}",
            f"{sum(m['bundle_k'] for m in ms) / len(ms):.1f}",
            f"{min(m['tau'] for m in ms):.4f}",
            f"{max(m['captured_energy'] for m in ms):.3e}",
            f"{sum(m['params'] for m in ms):,}",
        )
    console.print(table)
    bud = data["budget"]
    console.print(
        f"budget {_count(bud['params'])} parameters ({bud['spec']}); planned {bud['spent']:,}; "
        f"max captured energy {plan.max_captured_energy:.3e}, mean {plan.mean_captured_energy:.3e}"
    )
    opt = data["optimality"]
    name = "max captured energy" if objective == "minimax" else "mean captured energy"
    if opt["method"] == "exact":
        console.print(
            f"optimal: exact: it spends the most the budget allows, and no plan spending as much has a smaller {name}",
            soft_wrap=True,
        )
    else:
        console.print(
            f"[yellow]note[/]: greedy fallback, not proven optimal ({opt['reason']}): its {name} "
            f"{opt['objective']:.3e} is within {opt['gap']:.3e} of the optimum (lower bound {opt['lower_bound']:.3e} "
            "for any plan spending as much)",
            soft_wrap=True,
        )
    if bud["limited_by_bundle"]:
        console.print(
            f"[yellow]note[/]: the bundle's Q holds at most {bud['capacity']:,} parameters at its r; "
            "scan with a smaller --tau (or larger --max-rank) to plan more"
        )
    console.print(f"plan: {out}")


def _count(n: int) -> str:
    """A parameter count with thousands separators, or in e-notation when beyond any real model (--budget 1e30)."""
    return f"{n:,}" if n < 10**15 else f"{n:.3e}"
