"""The paper's four-task sequential protocol (appendix "Behaviour on longer task sequences"), PLATE vs LoRA vs OSF.

Tasks: the binary pairs 2v3 -> 4v5 -> 6v7 -> 8v9 (one 2-class head per task). Task 1 trains the backbone and head 1
from scratch. Each later task t trains only the method's adapter and head t, then merges the adapter into the
backbone, so the next task starts from the merged weights:

- ``plate`` (r, tau; default the canonical r=8, tau=0.98, rho 0.5): apply the current bundle, train, write the
  adapter (:func:`plate_inspect.train.layer.save_adapter`), then :func:`plate_inspect.train.sequential.sequential_step`
  merges it into the safetensors checkpoint and rescans it (fresh B and Q for the next task: Algorithm
  "Sequential PLATE").
- ``lora`` (rank, default 1: PLATE's budget) and ``osf`` (n trainable singular triplets per module, default 1):
  PEFT adapters merged with ``merge_and_unload``; OSF re-decomposes the merged weights for the next task with the
  same ``effective_rank = min(d_out, d_in) - n`` (it does not grow the frozen subspace across tasks).

After each task, every task seen so far is evaluated on its test split with its own head: retention of task j after
task t is the accuracy matrix entry acc[t][j].

Each finished (seed, method) is saved as ``OUT/seed<N>/<method>/records.json`` with the settings it ran with; a rerun
with the same settings keeps those and runs only the rest (an interrupted run resumes). ``OUT/sequential.json``
holds the records and mean matrices of the seeds and methods asked for; :func:`report_sequential` rewrites it from
the finished runs alone (CLI: --report-only).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plate_inspect.arguments import is_integer
from plate_inspect.atomic import atomic_write, make_dirs, path_argument
from plate_inspect.errors import ConfigError, os_error_text
from plate_inspect.experiments import digits
from plate_inspect.experiments.continual import (
    check_data_root,
    check_not_other_experiment,
    check_steps,
    seed_list,
    settings_diff,
    writing_errors,
)
from plate_inspect.experiments.methods import (
    BACKBONE,
    LORA_ALPHA_PER_RANK,
    PLATE_RHO,
    backbone_shapes,
    repeated_values,
)
from plate_inspect.progress import ProgressCallback, ProgressCounter, as_callback
from plate_inspect.targets import name_list

if TYPE_CHECKING:
    from rich.console import Console

SEQUENTIAL_METHODS = ("plate", "lora", "osf")
N_TASKS = 4
PAPER_PAIR_STEPS = 950  # 10 epochs of a ~12,000-image MNIST digit pair at batch 128 (the paper's binary tasks)
QUICK_PAIR_STEPS = 60  # a smoke run of every code path (CLI: --quick)


@dataclass
class SequentialRecord:
    """Accuracy on task ``task`` after training task ``after_task`` (1-based), one method and seed."""

    method: str
    seed: int
    data: str
    steps: int
    after_task: int
    task: int
    accuracy: float
    trainable_params: int


@dataclass
class SequentialResult:
    """A sequential-tasks run: the file its records live in, and every (method, seed, after_task, task) accuracy."""

    path: Path
    records: list[SequentialRecord] = field(default_factory=list)

    def matrix(self, method: str) -> list[list[float | None]]:
        """Mean accuracy (%) over seeds: rows = after task t, columns = task j (None above the diagonal)."""
        out: list[list[float | None]] = []
        for t in range(1, N_TASKS + 1):
            row: list[float | None] = []
            for j in range(1, N_TASKS + 1):
                vals = [r.accuracy for r in self.records if (r.method, r.after_task, r.task) == (method, t, j)]
                row.append(100 * statistics.fmean(vals) if vals else None)
            out.append(row)
        return out


def _train_head_and(
    model: torch.nn.Module,
    adapter: list,
    t: int,
    task: digits.Task,
    steps: int,
    seed: int,
    progress: ProgressCallback | None = None,
) -> None:
    head = model.get_submodule(f"head{t}")
    for p in head.parameters():
        p.requires_grad_(True)
    digits.train(model, adapter + list(head.parameters()), task, t, steps=steps, seed=seed, progress=progress)


def _peft_step(
    method: str,
    model: torch.nn.Module,
    t: int,
    task: digits.Task,
    steps: int,
    seed: int,
    size: int,
    progress: ProgressCallback | None = None,
) -> tuple[torch.nn.Module, int]:
    from peft import LoraConfig, OSFConfig, get_peft_model

    cfg: LoraConfig | OSFConfig
    if method == "lora":
        cfg = LoraConfig(
            r=size,
            lora_alpha=LORA_ALPHA_PER_RANK * size,  # type: ignore[arg-type]  # peft says int; its scaling is alpha / r
            lora_dropout=0.0,
            target_modules=list(BACKBONE),
        )
    else:
        shapes = dict(zip(BACKBONE, backbone_shapes(model), strict=True))
        pattern: dict[str, int | float] = {f"^{m}$": min(s) - size for m, s in shapes.items()}
        cfg = OSFConfig(target_modules=list(BACKBONE), rank_pattern=pattern, effective_rank=1)
    peft_model = get_peft_model(model, cfg)
    adapter = [p for n, p in peft_model.named_parameters() if p.requires_grad]
    _train_head_and(peft_model, adapter, t, task, steps, seed, progress)
    return peft_model.merge_and_unload(), sum(p.numel() for p in adapter)


def run_method(
    method: str,
    tasks: list[digits.Task],
    task1_ckpt: Path,
    work: Path,
    seed: int,
    steps: int,
    r: int = 8,
    tau: float = 0.98,
    size: int = 1,
    progress: ProgressCallback | None = None,
) -> tuple[list[tuple[int, int, float]], int]:
    """(after_task, task, accuracy) for tasks 2..4 of one method, and its trainable count per task (last task).

    ``progress``: one event per Adam step of tasks 2..4 (unit "steps", ``(N_TASKS - 1) * steps`` of them)."""
    from plate_inspect.scanner import scan
    from plate_inspect.train.layer import apply_bundle, save_adapter, unload
    from plate_inspect.train.sequential import sequential_step

    work.mkdir(parents=True, exist_ok=True)
    ckpt = task1_ckpt
    bundle = None
    if method == "plate":  # overwrite: a rerun recomputes an unfinished (seed, method) from its fresh task-1 model
        bundle = scan(
            ckpt,
            work / "bundle_t1",
            r=r,
            tau=tau,
            max_rank=256,
            seed=seed,
            target_modules=list(BACKBONE),
            overwrite=True,
        )
    accs: list[tuple[int, int, float]] = []
    n_train = 0
    counter = ProgressCounter(progress, (N_TASKS - 1) * steps, "steps")
    counter.start()
    for t in range(2, N_TASKS + 1):
        task_progress = counter.inner(f"task {t}")
        torch.manual_seed(seed + t)
        model = digits.load_model(ckpt)
        if method == "plate":
            assert bundle is not None  # scanned before task 2, rescanned by every sequential_step
            adapter = apply_bundle(model, bundle, rho=PLATE_RHO)
            n_train = sum(p.numel() for p in adapter)
            _train_head_and(model, adapter, t, tasks[t - 1], steps, seed, task_progress)
            adapter_path = save_adapter(model, work / f"adapter_t{t}.safetensors")
            source = work / f"pre_merge_t{t}" / "model.safetensors"  # backbone untouched, head t trained
            source.parent.mkdir(parents=True, exist_ok=True)
            digits.save_model(unload(model, merge=False), source)
            step = sequential_step(source, adapter_path, work / f"merged_t{t}", overwrite=True)
            ckpt, bundle = step.files[0], step.bundle
        else:
            merged, n_train = _peft_step(method, model, t, tasks[t - 1], steps, seed, size, task_progress)
            ckpt = work / f"merged_t{t}.safetensors"
            digits.save_model(merged, ckpt)
        evaluated = digits.load_model(ckpt)
        for j in range(1, t + 1):
            accs.append((t, j, digits.accuracy(evaluated, tasks[j - 1].x_test, tasks[j - 1].y_test, j)))
    return accs, n_train


def run_sequential(
    out: str | os.PathLike,
    methods: list[str] | tuple[str, ...] = SEQUENTIAL_METHODS,
    seeds: int | list[int] = 3,
    steps: int = PAPER_PAIR_STEPS,
    data: str = "digits",
    data_root: str | os.PathLike | None = None,
    progress: ProgressCallback | None = None,
    r: int = 8,
    tau: float = 0.98,
    lora_rank: int = 1,
    osf_n: int = 1,
) -> SequentialResult:
    """Run the four-task protocol for every method and seed (a count -> 0..K-1, or a list); write OUT/sequential.json.

    Each finished (seed, method) is saved at once (``OUT/seed<N>/<method>/records.json``) and OUT/sequential.json is
    rewritten after it; a rerun with the same settings keeps what finished (an interrupted run resumes), a rerun
    with other settings into the same OUT is refused. ``progress`` gets one event per Adam step (unit "steps": each
    seed's task-1 training, ``steps``, where one of its methods still runs, and the ``(N_TASKS - 1) * steps`` of tasks
    2..4 of every (seed, method); those of kept runs count as done in the opening event).
    """
    path_argument(out, "out")
    progress = as_callback(progress, "run_sequential")  # a non-function failed at the first event, after OUT was made
    names = name_list(methods, "methods")  # one string is one method (it was iterated: the methods p, l, a, t, e)
    unknown = [m for m in names if m not in SEQUENTIAL_METHODS]
    if not names or unknown:
        got = f"unknown method '{unknown[0]}'" if unknown else "no methods given"
        raise ConfigError(f"{got}; choose from {', '.join(SEQUENTIAL_METHODS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"methods list {', '.join(repeated_values(names))} twice; give each once")
    seeds_run = seed_list(seeds)
    for what, value in (("steps", steps), ("lora_rank", lora_rank), ("osf_n", osf_n), ("r", r)):
        if not (is_integer(value) and value >= 1):  # NumPy integers too (stored as int below)
            raise ConfigError(f"{what} must be an integer >= 1, got {value!r}")
    steps, lora_rank, osf_n, r = int(steps), int(lora_rank), int(osf_n), int(r)
    check_steps(steps, "steps (CLI: --steps)")
    check_data_root(data, data_root)
    tasks = digits.load_pair_tasks(data, str(data_root) if data_root else None)  # before OUT is touched
    check_not_other_experiment(out, "sequential")
    out = make_dirs(out, "the output directory")
    settings = {
        "data": data,
        "steps": steps,
        "r": r,
        "tau": tau,
        "lora_rank": lora_rank,
        "osf_n": osf_n,
        "rho": PLATE_RHO,
    }
    result = SequentialResult(out / "sequential.json")
    if result.path.exists():
        previous = _read_json(result.path, "the finished runs under OUT/seed<N>/ are kept")
        recorded = _with_legacy_data(previous)
        differ = settings_diff(recorded, settings, {"data": "--data", "steps": "--steps"})
        if differ:
            raise ConfigError(
                f"{out}: holds sequential runs made with other settings ({differ}); rerun with the same options "
                "to resume, or choose another --out"
            )
        if recorded is not previous.get("settings"):  # written before per-run files existed: keep its runs
            with writing_errors(out, "nothing was changed"):
                _keep_legacy_runs(out, previous.get("records"), settings)
    kept = {(seed, m): _kept_unit(out, seed, m, settings) for seed in seeds_run for m in names}
    per_run = (N_TASKS - 1) * steps
    stage1 = steps * len({seed for (seed, _), records in kept.items() if records is None})  # seeds that still train
    finished = per_run * sum(records is not None for records in kept.values())
    counter = ProgressCounter(progress, per_run * len(kept) + stage1, "steps", done=finished)
    counter.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    note = f"the (seed, method) runs that finished are kept under {out}/seed<N>/"
    try:
        with writing_errors(out, note):
            for seed in seeds_run:
                todo = [m for m in names if kept[(seed, m)] is None]
                seed_dir = out / f"seed{seed}"
                acc1 = ckpt = None
                if todo:
                    seed_dir.mkdir(parents=True, exist_ok=True)
                    stage1_progress = counter.inner(f"seed {seed}: task 1")
                    model = digits.train_stage1(tasks[0], seed, steps=steps, n_tasks=N_TASKS, progress=stage1_progress)
                    ckpt = seed_dir / "task1.safetensors"
                    digits.save_model(model, ckpt)
                    acc1 = digits.accuracy(model, tasks[0].x_test, tasks[0].y_test, 1)
                for method in names:
                    records = kept[(seed, method)]
                    if records is None:
                        assert ckpt is not None and acc1 is not None  # stage 1 ran: this method is in todo
                        size = {"lora": lora_rank, "osf": osf_n}.get(method, 0)
                        run_progress = counter.inner(f"seed {seed}: {method}")
                        accs, n_train = run_method(
                            method, tasks, ckpt, seed_dir / method, seed, steps, r, tau, size, run_progress
                        )
                        records = [
                            SequentialRecord(method, seed, data, steps, t, j, acc, n_train)
                            for t, j, acc in [(1, 1, acc1), *accs]
                        ]
                        unit = {"settings": settings, "records": [asdict(x) for x in records]}
                        atomic_write(_unit_path(out, seed, method), json.dumps(unit, indent=2) + "\n")
                    result.records.extend(records)
                    if kept[(seed, method)] is None:  # a run finished: sequential.json holds what finished so far
                        _write_sequential(result, names, settings)
            _write_sequential(result, names, settings)  # every run kept: written once
    finally:
        torch.set_num_threads(threads)
    return result


def _with_legacy_data(payload: dict[str, Any]) -> Any:
    """The settings of a sequential.json; one written before they recorded ``data`` (up to session 12) gets the data
    its records name (each record always did; "digits", the only default, where they name none or disagree)."""
    recorded = payload.get("settings")
    if not isinstance(recorded, dict) or "data" in recorded:
        return recorded
    records = payload.get("records")
    named = {r.get("data") for r in records if isinstance(r, dict)} if isinstance(records, list) else set()
    return {**recorded, "data": named.pop() if len(named) == 1 else "digits"}


def recorded_settings(out: str | os.PathLike) -> dict[str, Any]:
    """The settings OUT's sequential runs were made with (read only); ConfigError for an OUT without them."""
    path_argument(out, "out")
    check_not_other_experiment(out, "sequential")
    path = Path(out) / "sequential.json"
    if not path.exists():
        raise ConfigError(
            f"{out}: no sequential.json here; run "
            f"`plate-inspect experiment sequential --out {shlex.quote(str(out))}` first"
        )
    settings = _with_legacy_data(_read_json(path, "the finished runs under OUT/seed<N>/ are kept"))
    if not isinstance(settings, dict):
        raise ConfigError(
            f"{path}: records no settings; delete it and rerun the command that made these runs (the finished runs "
            "under OUT/seed<N>/ are kept)"
        )
    return settings


def report_sequential(
    out: str | os.PathLike, methods: list[str] | tuple[str, ...] | None = None, seeds: int | list[int] | None = None
) -> SequentialResult:
    """Rewrite OUT/sequential.json from the finished (seed, method) runs of OUT (trains nothing): those of ``methods``
    and ``seeds`` (a count -> 0..K-1; None: all), for a report of a finished or interrupted run. Records in seed
    order, then method order; ConfigError for an OUT with nothing finished or a method or seed that has no finished
    run (naming what finished)."""
    from plate_inspect.experiments.continual import select_records

    settings = recorded_settings(out)
    methods = name_list(methods, "methods (CLI: --methods)") if methods is not None else None  # "lora": one method
    chosen_seeds = seed_list(seeds) if seeds is not None else None  # both checked before a legacy OUT is rewritten
    out = Path(out)
    path = out / "sequential.json"
    previous = _read_json(path)
    if "data" not in (previous.get("settings") or {}):  # written before per-run files: keep its runs as a resume does
        with writing_errors(out, "nothing was changed"):
            _keep_legacy_runs(out, previous.get("records"), settings)
    units, other = finished_units(out, settings)
    if not units:
        also = f" ({other} made with other settings than {path.name} records)" if other else ""
        raise ConfigError(f"{out}: holds no finished (seed, method) run yet{also}; nothing to report")
    records = [r for group in units.values() for r in group]
    records = select_records(records, out, methods, None, chosen_seeds)
    names = list(methods) if methods else [m for m in SEQUENTIAL_METHODS if any(r.method == m for r in records)]
    records.sort(key=lambda r: (r.seed, names.index(r.method)))  # stable: each run's records keep their order
    result = SequentialResult(path, records)
    with writing_errors(out, "the finished runs under OUT/seed<N>/ are kept"):
        _write_sequential(result, names, settings)
    return result


def finished_units(
    out: str | os.PathLike, settings: dict[str, Any]
) -> tuple[dict[tuple[int, str], list[SequentialRecord]], int]:
    """The finished (seed, method) runs under OUT/seed<N>/<method>/ made with ``settings`` (their records), and how
    many others there are (made with other settings)."""
    out = Path(out)
    units, other = {}, 0
    for unit in out.glob("seed*/*/records.json"):
        number, method = unit.parent.parent.name.removeprefix("seed"), unit.parent.name
        if method in SEQUENTIAL_METHODS and number.isdigit() and _unit_path(out, int(number), method) == unit:
            kept = _kept_unit(out, int(number), method, settings)  # None: made with other settings
            if kept is None:
                other += 1
            else:
                units[(int(number), method)] = kept
    return units, other


def _keep_legacy_runs(out: Path, records: Any, settings: dict[str, Any]) -> None:
    """Save each complete (seed, method) of an old-style sequential.json (all records in that one file) as its
    OUT/seed<N>/<method>/records.json, so a resume keeps it instead of rerunning it and rewriting the file without it.
    An incomplete or unreadable group is left to run again."""
    groups: dict[tuple[int, str], list[SequentialRecord]] = {}
    for raw in records if isinstance(records, list) else []:
        try:
            rec = SequentialRecord(**raw)
        except TypeError:
            continue
        groups.setdefault((rec.seed, rec.method), []).append(rec)
    for (seed, method), group in groups.items():
        path = _unit_path(out, seed, method)
        same = all((x.data, x.steps) == (settings["data"], settings["steps"]) for x in group)
        if method not in SEQUENTIAL_METHODS or path.exists() or not same or not _complete(group):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        unit = {"settings": settings, "records": [asdict(x) for x in group]}
        atomic_write(path, json.dumps(unit, indent=2) + "\n")


def _complete(records: list[SequentialRecord]) -> bool:
    """Whether ``records`` hold every (after task, task) of the protocol exactly once."""
    pairs = [(x.after_task, x.task) for x in records]
    return len(pairs) == len(set(pairs)) and set(pairs) == {
        (t, j) for t in range(1, N_TASKS + 1) for j in range(1, t + 1)
    }


def _unit_path(out: Path, seed: int, method: str) -> Path:
    return out / f"seed{seed}" / method / "records.json"


def _read_json(path: Path, after_delete: str = "its run reruns") -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except PermissionError as e:  # a sound record this user may not read: deleting it would lose a finished run
        raise ConfigError(os_error_text(e) or str(e)) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({e}); delete it ({after_delete}) or choose another --out") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: not a JSON object; delete it ({after_delete}) or choose another --out")
    return value


def _kept_unit(out: Path, seed: int, method: str, settings: dict[str, Any]) -> list[SequentialRecord] | None:
    """The records of a (seed, method) finished earlier with the same settings, else None (it runs again)."""
    path = _unit_path(out, seed, method)
    if not path.exists():
        return None
    unit = _read_json(path)
    if unit.get("settings") != settings:
        return None
    try:
        records = [SequentialRecord(**r) for r in unit["records"]]
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a sequential run record ({e}); delete it (its run reruns)") from None
    want = {(t, j) for t in range(1, N_TASKS + 1) for j in range(1, t + 1)}
    if {(x.after_task, x.task) for x in records} != want or {(x.seed, x.method) for x in records} != {(seed, method)}:
        raise ConfigError(f"{path}: does not hold every (after task, task) of seed {seed} {method}; delete it")
    return records


def _write_sequential(result: SequentialResult, methods: Iterable[str], settings: dict[str, Any]) -> None:
    payload: dict[str, Any] = {
        "protocol": "2v3 -> 4v5 -> 6v7 -> 8v9, merge after each task (PLATE: merge + rescan)",
        "settings": settings,
        "records": [asdict(r) for r in result.records],
        "matrices": {m: result.matrix(m) for m in methods},
    }
    atomic_write(result.path, json.dumps(payload, indent=2) + "\n")


def print_matrix(result: SequentialResult, console: Console) -> None:
    """One accuracy matrix per method (mean over seeds, %): rows = after task t, columns = task j."""
    from rich.table import Table

    for method in sorted({r.method for r in result.records}, key=SEQUENTIAL_METHODS.index):
        table = Table(title=f"{method}: accuracy (%) on task j after training task t")
        table.add_column("after")
        for j in range(1, N_TASKS + 1):
            table.add_column(f"task {j}", justify="right")
        for t, row in enumerate(result.matrix(method), start=1):
            table.add_row(f"task {t}", *("" if v is None else f"{v:.2f}" for v in row))
        console.print(table)
