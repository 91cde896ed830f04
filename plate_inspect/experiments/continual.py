"""The paper's two-task continual-learning benchmark on scikit-learn's digits (Algorithm "two-task protocol").

Per seed: stage 1 trains the backbone (fc1, fc2, fc3) and head 1 on digits 0-4, saves the checkpoint as
safetensors and scans it with :func:`plate_inspect.scan` (one bundle per (r, tau)); the matched-capacity
ablations are bundles written by :mod:`plate_inspect.train.variants`. Stage 2, per method and config, restores the
checkpoint, freezes head 1 and trains the method's parameters plus head 2 on digits 5-9: Full FT (whole backbone),
LoRA via peft (alpha/r = 0.5, on fc1/fc2/fc3), PLATE and its ablations via
:func:`plate_inspect.train.layer.apply_bundle`.

Measured per run: task-1 test accuracy before/after stage 2, task-2 test accuracy, trainable backbone parameters
(head 2's 1,285 parameters train in every method and are not counted) and their % of the backbone's 148,224, and
the symmetrised KL 0.5 (KL(p||q) + KL(q||p)) between the stage-1 (p) and adapted (q) models' task-1 class
probabilities, averaged over the task-1 test inputs.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from plate_inspect.errors import ConfigError
from plate_inspect.experiments import digits

BACKBONE = ("fc1", "fc2", "fc3")
METHODS = (
    "full_ft",
    "lora",
    "plate",
    "plate_random_b",
    "plate_least_redundant_b",
    "plate_random_q",
    "plate_high_energy_q",
    "plate_random_bq",
)
RECORD_KEYS = (
    "method",
    "config",
    "seed",
    "trainable_params",
    "trainable_pct",
    "task1_acc_before",
    "task1_acc_after",
    "task2_acc",
    "kl_task1",
)


@dataclass
class ContinualSettings:
    """Epochs, optimiser and the method grids (defaults: the paper's grids on the digits MLP)."""

    epochs1: int = 30  # digits has ~675 training images per task: 30 epochs = 180 Adam steps (stage 1 converges)
    epochs2: int = 30
    lr: float = 1e-3
    batch_size: int = 128
    lora_ranks: tuple[int, ...] = (1, 8, 16, 32, 64)
    plate_rs: tuple[int, ...] = (32, 64, 128)
    plate_taus: tuple[float, ...] = (0.6, 0.8, 0.9)
    rho: float = 0.5
    max_rank: int = 256
    ablation: tuple[int, float] = (32, 0.9)  # the PLATE (r, tau) the matched-capacity ablations start from
    variants: tuple[str, ...] = ("random_b", "least_redundant_b", "random_q", "high_energy_q", "random_bq")
    full_ft: bool = True

    @classmethod
    def quick(cls) -> ContinualSettings:
        """One config per method, few epochs: a smoke run of every code path in seconds."""
        return cls(epochs1=10, epochs2=10, lora_ranks=(8,), plate_rs=(32,), plate_taus=(0.9,), ablation=(32, 0.9))


@dataclass
class RunRecord:
    """One stage-2 run (the results.json schema)."""

    method: str
    config: dict[str, Any]
    seed: int
    trainable_params: int
    trainable_pct: float
    task1_acc_before: float
    task1_acc_after: float
    task2_acc: float
    kl_task1: float

    @property
    def forgetting(self) -> float:
        return self.task1_acc_before - self.task1_acc_after


@dataclass
class ContinualResult:
    """Records and the files written."""

    records: list[RunRecord]
    results_json: Path
    html: Path
    settings: ContinualSettings
    summary: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- pieces
def backbone_params(model: nn.Module) -> int:
    """Parameters of fc1, fc2, fc3 (weights and biases)."""
    return sum(p.numel() for n, p in model.named_parameters() if n.split(".")[0] in BACKBONE)


def symmetric_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> float:
    """Mean over rows of 0.5 (KL(p||q) + KL(q||p)) between softmax(logits_p) and softmax(logits_q)."""
    lp = torch.log_softmax(logits_p.double(), dim=-1)
    lq = torch.log_softmax(logits_q.double(), dim=-1)
    kl_pq = (lp.exp() * (lp - lq)).sum(-1)
    kl_qp = (lq.exp() * (lq - lp)).sum(-1)
    return float((0.5 * (kl_pq + kl_qp)).mean())


@torch.no_grad()
def task1_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(x, task=1)


def stage1(out_dir: Path, seed: int, s: ContinualSettings, task1: digits.Task) -> tuple[Path, float, torch.Tensor]:
    """Train backbone + head 1 on task 1; save safetensors; return (checkpoint, task-1 accuracy, task-1 logits)."""
    torch.manual_seed(seed)
    model = digits.DigitsMLP()
    params = [p for n, p in model.named_parameters() if not n.startswith("head2")]
    digits.train(model, params, task1, 1, s.epochs1, lr=s.lr, batch_size=s.batch_size, seed=seed)
    ckpt = out_dir / "stage1.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(ckpt))
    return ckpt, digits.accuracy(model, task1.x_test, task1.y_test, 1), task1_logits(model, task1.x_test)


def load_stage1(ckpt: Path) -> digits.DigitsMLP:
    model = digits.DigitsMLP()
    model.load_state_dict(load_file(str(ckpt)))
    return model


def _set_trainable(model: nn.Module, names: set[str]) -> list[nn.Parameter]:
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    return [p for n, p in model.named_parameters() if n in names]


def prepare_method(
    method: str, config: dict[str, Any], ckpt: Path, bundle_path: Path | None, s: ContinualSettings
) -> tuple[nn.Module, list[nn.Parameter], int]:
    """(model ready for stage 2, parameters to train incl. head 2, trainable backbone parameter count)."""
    model = load_stage1(ckpt)
    if method == "full_ft":
        names = {n for n, _ in model.named_parameters() if n.split(".")[0] in (*BACKBONE, "head2")}
        params = _set_trainable(model, names)
        return model, params, backbone_params(model)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        rank = int(config["rank"])
        cfg = LoraConfig(r=rank, lora_alpha=0.5 * rank, lora_dropout=0.0, target_modules=list(BACKBONE))
        peft_model = get_peft_model(model, cfg)
        adapter = [p for p in peft_model.parameters() if p.requires_grad]
        for p in model.head2.parameters():
            p.requires_grad_(True)
        return peft_model, adapter + list(model.head2.parameters()), sum(p.numel() for p in adapter)
    from plate_inspect.train.layer import apply_bundle

    adapter = apply_bundle(model, bundle_path, rho=s.rho)
    for p in model.head2.parameters():
        p.requires_grad_(True)
    return model, adapter + list(model.head2.parameters()), sum(p.numel() for p in adapter)


def plan_runs(s: ContinualSettings) -> list[tuple[str, dict[str, Any]]]:
    """(method, config) for every stage-2 run of one seed."""
    runs: list[tuple[str, dict[str, Any]]] = []
    if s.full_ft:
        runs.append(("full_ft", {}))
    runs += [("lora", {"rank": r, "alpha": 0.5 * r}) for r in s.lora_ranks]
    runs += [("plate", {"r": r, "tau": t, "rho": s.rho}) for r in s.plate_rs for t in s.plate_taus]
    r, t = s.ablation
    runs += [(f"plate_{v}", {"r": r, "tau": t, "rho": s.rho, "variant": v}) for v in s.variants]
    return runs


def _bundle_dir(seed_dir: Path, r: int, tau: float) -> Path:
    return seed_dir / f"bundle_r{r}_tau{tau:g}"


def run_seed(out_dir: Path, seed: int, s: ContinualSettings, tasks: tuple[digits.Task, digits.Task], advance=None):
    """Stage 1, scans and ablation bundles, then every stage-2 run, for one seed."""
    from plate_inspect.scanner import scan
    from plate_inspect.train.variants import make_variant

    task1, task2 = tasks
    seed_dir = out_dir / f"seed{seed}"
    seed_dir.mkdir(parents=True, exist_ok=True)
    ckpt, acc_before, logits_before = stage1(seed_dir, seed, s, task1)
    grid = {(r, t) for r in s.plate_rs for t in s.plate_taus} | {s.ablation}
    for r, t in sorted(grid):
        scan(
            ckpt,
            _bundle_dir(seed_dir, r, t),
            r=r,
            tau=t,
            max_rank=s.max_rank,
            seed=seed,
            target_modules=list(BACKBONE),
            overwrite=True,
        )
    base = _bundle_dir(seed_dir, *s.ablation)
    for v in s.variants:
        make_variant(base, ckpt, v, seed_dir / f"variant_{v}", seed=seed, overwrite=True)
    n_backbone = backbone_params(load_stage1(ckpt))
    records = []
    for method, config in plan_runs(s):
        bundle_path = None
        if method == "plate":
            bundle_path = _bundle_dir(seed_dir, config["r"], config["tau"])
        elif method.startswith("plate_"):
            bundle_path = seed_dir / f"variant_{config['variant']}"
        model, params, n_train = prepare_method(method, config, ckpt, bundle_path, s)
        if bundle_path is not None:
            from plate_inspect.bundle import Bundle

            config = {**config, "k": {rec.name: rec.k for rec in Bundle.load(bundle_path)}}
        digits.train(model, params, task2, 2, s.epochs2, lr=s.lr, batch_size=s.batch_size, seed=seed)
        records.append(
            RunRecord(
                method=method,
                config=config,
                seed=seed,
                trainable_params=int(n_train),
                trainable_pct=100.0 * n_train / n_backbone,
                task1_acc_before=acc_before,
                task1_acc_after=digits.accuracy(model, task1.x_test, task1.y_test, 1),
                task2_acc=digits.accuracy(model, task2.x_test, task2.y_test, 2),
                kl_task1=symmetric_kl(logits_before, task1_logits(model, task1.x_test)),
            )
        )
        if advance is not None:
            advance(f"seed {seed}: {method} {_config_label(method, config)}")
    return records


# --------------------------------------------------------------------------- aggregation and output
def _config_label(method: str, config: dict[str, Any]) -> str:
    if method == "full_ft":
        return "-"
    if method == "lora":
        return f"r={config['rank']}"
    return f"r={config['r']} tau={config['tau']:g}"


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(records: list[RunRecord]) -> list[dict[str, Any]]:
    """Mean and std over seeds per (method, config); forgetting = task-1 accuracy before - after (in points)."""
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for rec in records:
        groups.setdefault((rec.method, _config_label(rec.method, rec.config)), []).append(rec)
    rows = []
    for (method, label), recs in groups.items():
        row: dict[str, Any] = {"method": method, "config": label, "seeds": len(recs)}
        for key, fn in (
            ("trainable_pct", lambda r: r.trainable_pct),
            ("task1_acc_before", lambda r: 100 * r.task1_acc_before),
            ("task1_acc_after", lambda r: 100 * r.task1_acc_after),
            ("forgetting", lambda r: 100 * r.forgetting),
            ("task2_acc", lambda r: 100 * r.task2_acc),
            ("kl_task1", lambda r: r.kl_task1),
        ):
            row[key], row[key + "_std"] = _mean_std([fn(r) for r in recs])
        row["trainable_params"] = recs[0].trainable_params
        rows.append(row)
    return rows


def _pm(row: dict[str, Any], key: str, fmt: str) -> str:
    return f"{row[key]:{fmt}} ± {row[key + '_std']:{fmt}}"


def rich_table(rows: list[dict[str, Any]], title: str = "digits 0-4 -> 5-9"):
    """The summary as a rich Table (mean ± std over seeds; accuracies and forgetting in %)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
    cells = [
        [
            row["method"],
            row["config"],
            f"{row['trainable_params']:,}",
            f"{row['trainable_pct']:.2f}",
            _pm(row, "task1_acc_after", ".2f"),
            _pm(row, "forgetting", ".2f"),
            _pm(row, "task2_acc", ".2f"),
            _pm(row, "kl_task1", ".4f"),
        ]
        for row in rows
    ]
    headers = ("method", "config", "trainable", "%", "task-1 after", "forgetting", "task-2", "sym. KL")
    for i, col in enumerate(headers):
        width = max([len(col)] + [len(c[i]) for c in cells])
        table.add_column(col, justify="left" if i < 2 else "right", no_wrap=True, min_width=width)
    for c in cells:
        table.add_row(*c)
    return table


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (for the docs)."""
    lines = [
        "| method | config | trainable | % backbone | task-1 after (%) | forgetting (pts) | task-2 (%) | sym. KL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['config']} | {row['trainable_params']:,} | {row['trainable_pct']:.2f} | "
            f"{_pm(row, 'task1_acc_after', '.2f')} | {_pm(row, 'forgetting', '.2f')} | "
            f"{_pm(row, 'task2_acc', '.2f')} | {_pm(row, 'kl_task1', '.4f')} |"
        )
    return "\n".join(lines)


def write_figure(rows: list[dict[str, Any]], path: Path) -> Path:
    """Forgetting and task-2 accuracy vs trainable % (log x), mean ± std, as a self-contained HTML file."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("Task-1 forgetting (points) vs trainable %", "Task-2 accuracy (%) vs trainable %"),
    )
    colors = {
        "full_ft": "#d62728",
        "lora": "#1f77b4",
        "plate": "#2ca02c",
        "plate_random_b": "#17becf",
        "plate_least_redundant_b": "#9467bd",
        "plate_random_q": "#ff7f0e",
        "plate_high_energy_q": "#8c564b",
        "plate_random_bq": "#e377c2",
    }
    for method in METHODS:
        sel = sorted((r for r in rows if r["method"] == method), key=lambda r: r["trainable_pct"])
        if not sel:
            continue
        x = [r["trainable_pct"] for r in sel]
        text = [f"{method} {r['config']}<br>KL {r['kl_task1']:.4f}" for r in sel]
        for col, key in ((1, "forgetting"), (2, "task2_acc")):
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[r[key] for r in sel],
                    error_y={"type": "data", "array": [r[key + "_std"] for r in sel], "visible": True},
                    mode="lines+markers" if method in ("lora", "plate") else "markers",
                    name=method,
                    legendgroup=method,
                    showlegend=col == 1,
                    marker={"color": colors[method], "size": 9},
                    text=text,
                    hovertemplate="%{text}<br>trainable %{x:.2f}%<br>%{y:.2f}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(type="log", title_text="trainable parameters (% of backbone)")
    fig.update_yaxes(title_text="forgetting (task-1 accuracy points lost)", row=1, col=1)
    fig.update_yaxes(title_text="task-2 test accuracy (%)", row=1, col=2)
    fig.update_layout(title="Continual learning on digits 0-4 -> 5-9 (mean ± std over seeds)", height=520)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return path


def validate_records(data: Any) -> None:
    """Raise ConfigError unless ``data`` is a list of records in the results.json schema."""
    if not isinstance(data, list) or not data:
        raise ConfigError("results.json must hold a non-empty list of records")
    for rec in data:
        if not isinstance(rec, dict) or tuple(sorted(rec)) != tuple(sorted(RECORD_KEYS)):
            raise ConfigError(f"record with keys {sorted(rec) if isinstance(rec, dict) else rec!r} is malformed")
        if rec["method"] not in METHODS or not isinstance(rec["config"], dict) or not isinstance(rec["seed"], int):
            raise ConfigError(f"record {rec} has a bad method/config/seed")
        for key in ("task1_acc_before", "task1_acc_after", "task2_acc"):
            if not 0.0 <= rec[key] <= 1.0:
                raise ConfigError(f"{key}={rec[key]} is not an accuracy in [0, 1]")
        if not (isinstance(rec["trainable_params"], int) and rec["trainable_params"] > 0):
            raise ConfigError(f"trainable_params={rec['trainable_params']!r} must be a positive int")
        if not (math.isfinite(rec["kl_task1"]) and rec["kl_task1"] >= 0 and rec["trainable_pct"] > 0):
            raise ConfigError(f"record {rec} has a bad KL or trainable %")


def run_continual(
    out_dir: str | os.PathLike,
    seeds: int | list[int] = 5,
    quick: bool = False,
    settings: ContinualSettings | None = None,
    console: Any = None,
    progress: bool = True,
) -> ContinualResult:
    """Run the benchmark over ``seeds`` (a count -> 0..K-1, or a list); write results.json, the table, the HTML."""
    s = settings or (ContinualSettings.quick() if quick else ContinualSettings())
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:
        raise ConfigError("seeds must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = digits.load_digit_tasks()
    total = len(seed_list) * len(plan_runs(s))
    records: list[RunRecord] = []
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-256-256-256 MLP: threads only add overhead (and contend on a shared machine)
    try:
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(
                TextColumn("[bold]continual[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=console,
                transient=False,
            ) as bar:
                task = bar.add_task("", total=total)
                for seed in seed_list:
                    records += run_seed(out, seed, s, tasks, lambda d: bar.update(task, advance=1, description=d))
        else:
            for seed in seed_list:
                records += run_seed(out, seed, s, tasks)
    finally:
        torch.set_num_threads(torch_threads)
    data = [asdict(r) for r in records]
    validate_records(data)
    results_json = out / "results.json"
    results_json.write_text(json.dumps(data, indent=2) + "\n")
    rows = summarize(records)
    (out / "settings.json").write_text(json.dumps({**asdict(s), "seeds": seed_list}, indent=2) + "\n")
    (out / "summary.md").write_text(markdown_table(rows) + "\n")
    html = write_figure(rows, out / "continual.html")
    if console is not None:
        table = rich_table(rows, title=f"digits 0-4 -> 5-9, {len(seed_list)} seed(s), mean ± std")
        console.print(table)
    return ContinualResult(records, results_json, html, s, rows)
