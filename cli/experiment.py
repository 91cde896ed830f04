"""``experiment``: reproducible experiments from the paper (``experiment continual``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from plate_inspect.cli.common import console, err_console


@click.group("experiment")
def experiment_group() -> None:
    """Run the paper's experiments on data that ships offline.

    \b
    Examples:
      plate-inspect experiment continual --out runs/continual --seeds 5
      plate-inspect experiment continual --out /tmp/cq --quick
    """


@experiment_group.command("continual")
@click.option("--out", "-o", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--seeds", type=click.IntRange(min=1), default=5, show_default=True, help="Seeds 0..K-1.")
@click.option("--quick", is_flag=True, help="1 seed, 10/10 epochs, one config per method (CI smoke run).")
@click.option("--epochs1", type=click.IntRange(min=1), default=None, help="Stage-1 epochs [30; quick: 10].")
@click.option("--epochs2", type=click.IntRange(min=1), default=None, help="Stage-2 epochs [30; quick: 10].")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def continual_command(out, seeds, quick, epochs1, epochs2, no_progress):
    """Two-task continual learning on scikit-learn's digits (0-4 then 5-9).

    Stage 1 trains the 64-256-256-256 MLP and head 1 on digits 0-4, saves it as safetensors and scans it into PLATE
    bundles. Stage 2 trains on digits 5-9 with Full FT, LoRA (peft; r 1/8/16/32/64, alpha/r 0.5), PLATE (r 32/64/128,
    tau 0.6/0.8/0.9, rho 0.5) and five matched-capacity ablations (r 32, tau 0.9). Writes OUT/results.json,
    OUT/summary.md and OUT/continual.html (self-contained plotly figure), and prints mean ± std over seeds.

    \b
    Examples:
      plate-inspect experiment continual --out runs/continual --seeds 10
      plate-inspect experiment continual --out /tmp/cq --quick
      plate-inspect experiment continual --out runs/paper-epochs --epochs1 10 --epochs2 10
    """
    from plate_inspect.experiments.continual import ContinualSettings, run_continual

    settings = ContinualSettings.quick() if quick else ContinualSettings()
    if epochs1:
        settings = replace(settings, epochs1=epochs1)
    if epochs2:
        settings = replace(settings, epochs2=epochs2)
    result = run_continual(
        out,
        seeds=1 if quick else seeds,
        settings=settings,
        console=console,
        progress=not no_progress,
    )
    err_console.print(f"results: {result.results_json}\nfigure:  {result.html}")
