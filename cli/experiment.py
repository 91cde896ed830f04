"""``experiment``: reproducible experiments from the paper (``continual``, ``sequential``)."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from plate_inspect.cli.common import console, err_console, progress_bar, quiet_option

if TYPE_CHECKING:
    from plate_inspect.experiments.continual import ContinualSettings, RunRecord


#: --data and --data-root of the digits experiments (the commands here and benchmarks/arena_dead_units.py)
data_option = click.option(
    "--data", type=click.Choice(["digits", "fashion-mnist"]), default="digits", show_default=True
)
data_root_option = click.option(
    "--data-root",
    type=click.Path(path_type=Path),
    default=None,
    help="Fashion-MNIST IDX directory (--data fashion-mnist only).",
)


@click.group("experiment")
def experiment_group() -> None:
    """Run the paper's experiments on data that ships offline.

    \b
    Examples:
      plate-inspect experiment continual --out runs/continual --seeds 10
      plate-inspect experiment continual --out /tmp/cq --quick
      plate-inspect experiment sequential --out runs/seq --seeds 3
    """


def _given(name: str) -> bool:
    """Whether the user set option ``name`` (on the command line or through its environment variable)."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP)


def _out_dir(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    """--out as a Path; an empty value (an unset shell variable) is refused: as Path("") it would write into the
    current directory."""
    if not value.strip():
        raise click.BadParameter("is empty; give an output directory, e.g. runs/continual (--out . for this one)")
    return Path(value)


def _int_list(text: str, what: str) -> tuple[int, ...]:
    from plate_inspect.errors import ConfigError

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{what} must be positive integers, got '{text}'")
    return values


@experiment_group.command("continual")
@click.option("--out", "-o", type=click.Path(), required=True, callback=_out_dir, help="Output directory.")
@data_option
@click.option("--methods", default=None, help="Comma-separated methods (listed above) [all].")
@click.option("--seeds", type=click.IntRange(min=1), default=10, show_default=True, help="Seeds 0..K-1.")
@click.option("--steps", default="2400", show_default=True, help="Stage-2 Adam steps; a list runs each.")
@click.option(
    "--stage1-steps",
    type=click.IntRange(min=1),
    default=2400,
    show_default=True,
    help="Stage-1 Adam steps (backbone + head 1 on task 1).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="Smoke run: one budget per method; 1 seed and 180 + 60 steps unless --seeds/--stage1-steps/--steps given.",
)
@data_root_option
@click.option(
    "--report-only",
    is_flag=True,
    help="Rebuild results.json/summary.md/HTML from OUT/runs.jsonl, or OUT/results.json where runs.jsonl is absent "
    "(trains nothing); with --methods/--steps/--seeds, of those runs only (runs.jsonl only).",
)
@quiet_option("--no-progress")
def continual_command(
    out: Path,
    data: str,
    methods: str | None,
    seeds: int,
    steps: str,
    stage1_steps: int,
    quick: bool,
    data_root: Path | None,
    report_only: bool,
    quiet: bool,
) -> None:
    """Two-task continual learning: classes 0-4, then 5-9, every method at matched budgets.

    Stage 1 trains the d_in-256-256-256 MLP and head 1 on task 1 for --stage1-steps Adam steps (lr 1e-3, batch
    128) and saves it as safetensors. Stage 2 restores it per method and budget, freezes head 1 and trains the
    method + head 2 on task 2 for --steps steps (the paper's MNIST protocol is 10 + 10 epochs, ~2,400 steps per
    task). Methods: full_ft, l2_init, lora, o_lora, pissa, mica, osf, corda (data-using), plate, plate_random_b,
    plate_least_redundant_b, plate_random_q, plate_high_energy_q, plate_random_bq. Writes OUT/results.json (one
    record per run), OUT/runs.jsonl (resumable), OUT/summary.md and OUT/continual.html (frontier, ablation table,
    step sensitivity).

    \b
    Examples:
      plate-inspect experiment continual --out runs/digits --seeds 10
      plate-inspect experiment continual --out runs/fm --data fashion-mnist --seeds 3 --methods full_ft,lora,osf,plate
      plate-inspect experiment continual --out runs/steps --steps 60,300,1200,2400 --methods full_ft,lora,plate
      plate-inspect experiment continual --out /tmp/cq --quick --seeds 3     # smoke run with error bars
      plate-inspect experiment continual --out runs/digits --report-only     # tables/HTML of what finished
      plate-inspect experiment continual --out /tmp/cq --report-only --methods lora,plate   # of two methods

    A rerun of the same command resumes (finished runs are in OUT/runs.jsonl; more --seeds, --methods or --steps
    values add to them: only the new runs train); other settings into the same OUT (--data, --stage1-steps, a method's
    budgets, e.g. with or without --quick) are refused, naming what differs. The report is of the runs the command
    names; --report-only reports every finished run.
    """
    from plate_inspect.experiments.continual import (
        ContinualSettings,
        records_from_dir,
        run_continual,
        write_outputs,
    )
    from plate_inspect.experiments.continual_report import rich_table
    from plate_inspect.experiments.methods import METHODS, parse_methods

    names = tuple(parse_methods(methods)) if methods is not None else METHODS  # --methods "": refused, not all
    if report_only:
        records, settings = _report_records(
            out, names if methods is not None else None, steps, seeds, stage1_steps, data
        )
        result = write_outputs(out, records, settings, console=console)
        err_console.print(f"results: {result.results_json}\nfigure:  {result.html}")
        return
    root = str(data_root) if data_root else None
    settings = ContinualSettings(
        steps=_int_list(steps, "--steps"), stage1_steps=stage1_steps, data=data, methods=names, data_root=root
    )
    if quick:  # its small defaults, where the command line did not set the option itself
        given = {name for name in ("seeds", "steps", "stage1_steps") if _given(name)}
        quick_settings = ContinualSettings.quick(data=data, methods=names, data_root=root)
        settings = replace(
            quick_settings,
            steps=settings.steps if "steps" in given else quick_settings.steps,
            stage1_steps=settings.stage1_steps if "stage1_steps" in given else quick_settings.stage1_steps,
        )
        seeds = seeds if "seeds" in given else 1
    with progress_bar("continual", quiet=quiet) as progress:
        result = run_continual(out, seeds=seeds, settings=settings, progress=progress)
    console.print(rich_table(result.summary, title=f"{data} 0-4 -> 5-9, mean ± 95% CI over seeds"))
    err_console.print(f"results: {result.results_json}\nfigure:  {result.html}")
    _note_unreported(
        out, len(records_from_dir(out)[0]) - len(result.records), "continual", "--methods, --steps or --seeds"
    )


def _note_unreported(out: Path, others: int, command: str, options: str) -> None:
    """Say when OUT holds ``others`` finished runs this command's report leaves out (other ``options`` run before):
    the report is of the runs the command names, and --report-only reports all."""
    if others > 0:
        err_console.print(
            f"note: {out} also holds {others} finished run{'s' if others > 1 else ''} of other {options}, not in "
            f"this report; `plate-inspect experiment {command} --out {shlex.quote(str(out))} --report-only` "
            "reports all",
            soft_wrap=True,
        )


def _report_records(
    out: Path, methods: tuple[str, ...] | None, steps: str, seeds: int, stage1_steps: int, data: str
) -> tuple[list[RunRecord], ContinualSettings]:
    """--report-only: the finished runs of OUT, restricted by --methods/--steps/--seeds where given; --data and
    --stage1-steps must be OUT's own; --quick and --data-root (they only shape training) are refused, not ignored."""
    from plate_inspect.errors import ConfigError
    from plate_inspect.experiments.continual import (
        check_not_other_experiment,
        only_results_json,
        records_from_dir,
        seed_list,
        select_records,
    )

    _refuse_training_options("--methods, --steps and --seeds")
    check_not_other_experiment(out, "continual")
    selecting = [f"--{name}" for name in ("methods", "steps", "seeds") if _given(name)]
    if selecting and only_results_json(out):
        raise ConfigError(
            f"{out}: has no runs.jsonl, so results.json is its only record of the runs and a report of part of them "
            f"would overwrite it; drop {', '.join(selecting)} (or report part of a copy of the directory)"
        )
    records, settings = records_from_dir(out)
    _check_own_settings(out, {"data": (data, settings.data), "stage1_steps": (stage1_steps, settings.stage1_steps)})
    chosen_steps = _int_list(steps, "--steps") if _given("steps") else None
    chosen_seeds = seed_list(seeds) if _given("seeds") else None
    return select_records(records, out, methods, chosen_steps, chosen_seeds), settings


def _refuse_training_options(selecting: str) -> None:
    """--report-only: ConfigError naming --quick/--data-root where given (they only shape training: refused, not
    ignored); ``selecting`` names the options that do select runs to report."""
    from plate_inspect.errors import ConfigError

    training_only = [f"--{name.replace('_', '-')}" for name in ("quick", "data_root") if _given(name)]
    if training_only:
        raise ConfigError(
            f"--report-only trains nothing, so {' and '.join(training_only)} cannot apply; drop "
            f"{'it' if len(training_only) == 1 else 'them'} ({selecting} select runs to report)"
        )


def _check_own_settings(out: Path, values: dict[str, tuple]) -> None:
    """--report-only: ConfigError for an option given with another value than OUT's runs were made with (name ->
    (given, recorded)); such an option selects nothing, it must be the run's own."""
    from plate_inspect.errors import ConfigError

    for name, (value, recorded) in values.items():
        if _given(name) and value != recorded:
            flag = f"--{name.replace('_', '-')}"
            raise ConfigError(
                f"{out}: its runs were made with {flag} {recorded}, not {value}; drop {flag} or choose the --out of "
                "those runs"
            )


@experiment_group.command("sequential")
@click.option("--out", "-o", type=click.Path(), required=True, callback=_out_dir, help="Output directory.")
@data_option
@click.option(
    "--methods", default="plate,lora,osf", show_default=True, help="Comma-separated: any of plate, lora, osf."
)
@click.option("--seeds", type=click.IntRange(min=1), default=3, show_default=True, help="Seeds 0..K-1.")
@click.option(
    "--steps", type=click.IntRange(min=1), default=950, show_default=True, help="Adam steps per task (10 MNIST epochs)."
)
@data_root_option
@click.option("--quick", is_flag=True, help="Smoke run: 1 seed and 60 steps per task unless --seeds/--steps given.")
@click.option(
    "--report-only",
    is_flag=True,
    help="Rewrite sequential.json and print the matrices from OUT's finished runs (trains nothing); with --methods/"
    "--seeds, of those runs only.",
)
@quiet_option("--no-progress")
def sequential_command(
    out: Path,
    data: str,
    methods: str,
    seeds: int,
    steps: int,
    data_root: Path | None,
    quick: bool,
    report_only: bool,
    quiet: bool,
) -> None:
    """The paper's four-task sequential protocol: 2v3 -> 4v5 -> 6v7 -> 8v9, merge (+ rescan) after each task.

    Task 1 trains the backbone and head 1 from scratch; tasks 2-4 train only the method's adapter and the task's
    head, then merge it into the backbone: PLATE (r 8, tau 0.98) through save_adapter + sequential_step (merge and
    rescan, fresh B and Q per task), LoRA (r 1, matched to PLATE's budget) and OSF (n 1) through PEFT's
    merge_and_unload. After every merge each earlier task is evaluated with its own head. Writes
    OUT/sequential.json and prints the accuracy matrix (mean over seeds).

    A rerun of the same command resumes (each finished seed and method is kept in OUT/seed<N>/<method>/; more --seeds
    or --methods add to them); other settings into the same OUT (--data, --steps) are refused, naming what differs.
    --report-only rewrites sequential.json from what finished.

    \b
    Examples:
      plate-inspect experiment sequential --out runs/seq --seeds 3
      plate-inspect experiment sequential --out /tmp/sq --quick              # smoke run: 1 seed, 60 steps per task
      plate-inspect experiment sequential --out runs/seq-fm --data fashion-mnist --seeds 3 --methods plate,lora
      plate-inspect experiment sequential --out runs/seq --report-only      # matrices of what finished
      plate-inspect experiment sequential --out runs/seq --report-only --methods plate --seeds 2   # part of it
    """
    from plate_inspect.experiments.methods import parse_methods
    from plate_inspect.experiments.sequential_tasks import (
        QUICK_PAIR_STEPS,
        SEQUENTIAL_METHODS,
        finished_units,
        print_matrix,
        recorded_settings,
        report_sequential,
        run_sequential,
    )

    names = parse_methods(methods, SEQUENTIAL_METHODS)
    if report_only:
        _refuse_training_options("--methods and --seeds")
        own = recorded_settings(out)
        _check_own_settings(out, {"data": (data, own.get("data")), "steps": (steps, own.get("steps"))})
        result = report_sequential(out, names if _given("methods") else None, seeds if _given("seeds") else None)
        print_matrix(result, console)
        err_console.print(f"results: {result.path}")
        return
    if quick:  # its small defaults, where the command line did not set the option itself
        seeds = seeds if _given("seeds") else 1
        steps = steps if _given("steps") else QUICK_PAIR_STEPS
    with progress_bar("sequential", quiet=quiet) as progress:
        result = run_sequential(out, names, seeds=seeds, steps=steps, data=data, data_root=data_root, progress=progress)
    print_matrix(result, console)
    err_console.print(f"results: {result.path}")
    others = len(finished_units(out, recorded_settings(out))[0]) - len({(r.seed, r.method) for r in result.records})
    _note_unreported(out, others, "sequential", "--methods or --seeds")
