"""The paper's two-task continual-learning benchmark (Algorithm "two-task protocol"), every method at matched budgets.

Per seed: stage 1 trains the backbone (fc1, fc2, fc3) and head 1 on task 1 (classes 0-4) for ``stage1_steps`` Adam
steps and saves the checkpoint as safetensors; PLATE bundles are scanned from it with :func:`plate_inspect.scan`
and the ablations written by :mod:`plate_inspect.train.variants` on first use. Stage 2, per method and budget
(:mod:`plate_inspect.experiments.methods`), restores the checkpoint, freezes head 1 and trains the method's
parameters plus head 2 on task 2 (classes 5-9) for ``steps`` Adam steps (several values -> a step-sensitivity study).

Measured per run (one results.json record): task-1 test accuracy before/after stage 2, task-2 test accuracy, the
trainable backbone parameters (head 2 trains in every method and is not counted) and their % of the backbone, and
the symmetrised KL 0.5 (KL(p||q) + KL(q||p)) between the stage-1 (p) and adapted (q) models' task-1 class
probabilities, averaged over the task-1 test inputs. Summaries: mean and 95% CI (Student t) over seeds.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import shlex
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from plate_inspect.arguments import (
    MAX_SEED,
    describe,
    finite_numbers,
    is_integer,
    iterable_argument,
    positive_int,
    positive_ints,
    real_value,
)
from plate_inspect.atomic import atomic_write, make_dirs, os_error_reason, path_argument
from plate_inspect.errors import ConfigError, os_error_text, os_fault
from plate_inspect.experiments import digits
from plate_inspect.experiments.methods import (
    DATA_USING,
    METHODS,
    Budget,
    StageOne,
    backbone_params,
    check_budget,
    default_budgets,
    prepare,
    repeated_values,
)
from plate_inspect.progress import ProgressCallback, ProgressCounter, as_callback
from plate_inspect.targets import name_list

if TYPE_CHECKING:
    from rich.console import Console

    from plate_inspect.experiments.sequential_tasks import SequentialRecord

PAPER_STEPS = 2400  # the paper's MNIST protocol: 10 epochs of ~30k images at batch 128 per task
RECORD_KEYS = (
    "method",
    "budget",
    "config",
    "seed",
    "data",
    "steps",
    "stage1_steps",
    "data_using",
    "trainable_params",
    "trainable_pct",
    "task1_acc_before",
    "task1_acc_after",
    "task2_acc",
    "kl_task1",
)
SUMMARY_KEYS = ("trainable_pct", "task1_acc_before", "task1_acc_after", "forgetting", "task2_acc", "kl_task1")


@dataclass
class ContinualSettings:
    """Data, methods, their budgets, step counts and optimiser (defaults: the paper's MNIST protocol)."""

    data: str = "digits"
    methods: tuple[str, ...] = METHODS
    steps: tuple[int, ...] = (PAPER_STEPS,)  # stage-2 Adam steps; several values -> the sensitivity table
    stage1_steps: int = PAPER_STEPS
    lr: float = 1e-3
    batch_size: int = 128
    max_rank: int = 256
    budgets: dict[str, list[Budget]] = field(default_factory=dict)  # method -> budgets; missing = default grid
    data_root: str | None = None

    def __post_init__(self) -> None:
        """One string is one method and one int one step count, as elsewhere (``methods="plate"`` was iterated: the
        methods p, l, a, t, e; ``steps=60`` raised "Value after * must be an iterable")."""
        if isinstance(self.methods, str):
            self.methods = (self.methods,)
        if is_integer(self.steps):
            self.steps = (self.steps,)

    def budgets_of(self, method: str) -> list[Budget]:
        """This method's budgets: the ones given in ``budgets``, else its default grid."""
        return self.budgets.get(method) or default_budgets(method)

    @classmethod
    def quick(cls, **overrides: Any) -> ContinualSettings:
        """One budget per method, 60 stage-2 and 180 stage-1 steps: a smoke run of every code path."""
        s = cls(steps=(60,), stage1_steps=180, **overrides)
        return replace(s, budgets={m: default_budgets(m)[:1] for m in name_list(s.methods, "methods (CLI: --methods)")})

    def validate(self) -> None:
        """ConfigError for a setting that would fail mid-run or give a misleading summary (a run listed twice would
        be counted as a second seed: a fake confidence interval)."""
        check_data_root(self.data, self.data_root)
        lr = real_value(self.lr)
        if not (math.isfinite(lr) and lr > 0):
            raise ConfigError(f"lr must be a positive finite number (Adam's step size, e.g. 1e-3), got {self.lr!r:.80}")
        for what, value in (("batch_size", self.batch_size), ("max_rank", self.max_rank)):
            if not (is_integer(value) and value >= 1):
                raise ConfigError(f"{what} must be an integer >= 1, got {value!r:.80}")
        if not isinstance(self.budgets, dict) or not all(
            isinstance(b, (list, tuple)) and all(isinstance(x, Budget) for x in b) for b in self.budgets.values()
        ):
            raise ConfigError(
                f"budgets must map method names to lists of Budget (e.g. {{'lora': [Budget('r8', {{'rank': 8}})]}}), "
                f"got {self.budgets!r:.80}"
            )
        if not self.methods:
            raise ConfigError(f"no methods given; choose from {', '.join(METHODS)}")
        for m in name_list(self.methods, "methods (CLI: --methods)"):  # 3 was iterated: a TypeError
            if m not in METHODS:
                raise ConfigError(f"unknown method '{m}'; choose from {', '.join(METHODS)}")
        stage2 = iterable_argument(self.steps, "steps (CLI: --steps)", "step counts (e.g. [60, 2400])")
        steps = (*stage2, self.stage1_steps)
        if not self.steps or not all(is_integer(v) and v >= 1 for v in steps):
            raise ConfigError(f"steps must be integers >= 1 (got stage 2 {self.steps}, stage 1 {self.stage1_steps})")
        for v in self.steps:
            check_steps(v, "steps (CLI: --steps)")
        check_steps(self.stage1_steps, "stage1_steps (CLI: --stage1-steps)")
        for what, values in (("methods (CLI: --methods)", self.methods), ("steps (CLI: --steps)", self.steps)):
            if len(set(values)) != len(values):
                raise ConfigError(f"{what} lists {', '.join(map(str, repeated_values(values)))} twice; give each once")
        for m in self.methods:
            budgets = self.budgets_of(m)
            for b in budgets:
                check_budget(m, b)
            if len({b.id for b in budgets}) != len(budgets):
                raise ConfigError(f"{m}: budget ids {', '.join(repeated_values([b.id for b in budgets]))} repeat")


def check_data_root(data: str, data_root: str | os.PathLike | None) -> None:
    """ConfigError for an unknown data set, or a data root given for a data set that reads no files (digits ship
    with scikit-learn: the root would be silently ignored)."""
    if data not in digits.DATA_SETS:
        raise ConfigError(f"unknown data set '{data}'; choose one of {', '.join(digits.DATA_SETS)}")
    if data_root is not None and data != "fashion-mnist":
        raise ConfigError(
            f"--data-root applies to fashion-mnist only: {data} ships with scikit-learn and reads no files; drop "
            "--data-root (API: data_root=None) or use --data fashion-mnist"
        )
    if data_root is not None:
        path_argument(data_root, "data_root (CLI: --data-root)")


_MARKERS = {"continual": "runs.jsonl", "sequential": "sequential.json"}  # the file each experiment's OUT holds


def check_own_directory(out: str | os.PathLike, ours: tuple[str, ...] = ()) -> None:
    """ConfigError when an existing ``out`` is a model checkpoint (config.json, or *.safetensors other than
    ``ours``) or a PLATE bundle (manifest.json): the run would add its files to it (a model directory with a second
    *.safetensors is another checkpoint to every reader, the scan included)."""
    out = path_argument(out, "out")
    if not out.is_dir():
        return
    if (out / "manifest.json").is_file():
        found = "a PLATE bundle (manifest.json)"
    else:
        weights = sorted(p.name for p in out.glob("*.safetensors") if p.name not in ours)
        if not weights and not (out / "config.json").is_file():
            return
        found = f"a model checkpoint ({weights[0] if weights else 'config.json'})"
    raise ConfigError(
        f"{out}: holds {found}; the run would add its own files to it: give the run a directory of its own (--out)"
    )


def check_not_other_experiment(out: str | os.PathLike, experiment: str) -> None:
    """ConfigError when ``out`` holds the other experiment's runs (both write seed<N>/ directories, so one OUT mixed
    would make each resume and report read the other's files), a model checkpoint or a bundle
    (:func:`check_own_directory`)."""
    out = path_argument(out, "out")
    check_own_directory(out)
    for other, marker in _MARKERS.items():
        if other != experiment and (Path(out) / marker).exists():
            raise ConfigError(
                f"{out}: holds `experiment {other}` runs ({marker}); give `experiment {experiment}` its own --out"
            )


MAX_STEPS = 1_000_000  # ~400x the paper's 2,400 Adam steps per task (~33 h a run at 0.12 s/step); more is a typo
MAX_SEEDS = 10_000  # far beyond any useful confidence interval (the paper: 10); a larger count is a typo


def check_steps(value: int, what: str) -> None:
    """ConfigError for a step count above MAX_STEPS (e.g. --steps 10^23: it would train for ever, with no bar under
    -q) or one that is no positive integer; ``what`` names the setting and its flag."""
    value = positive_int(value, what)
    if value > MAX_STEPS:
        raise ConfigError(
            f"{what} {value:,} is more than {MAX_STEPS:,} Adam steps (~{MAX_STEPS // PAPER_STEPS}x the paper's "
            f"{PAPER_STEPS:,} per task); give a step count such as {PAPER_STEPS}"
        )


def seed_list(seeds: int | Iterable[int]) -> list[int]:
    """``seeds`` as a list (a count K -> 0..K-1): distinct integers in [0, 2^63), at most MAX_SEEDS, else ConfigError
    (a seed listed twice would be summarised as two seeds; a count of 10^11 would exhaust memory planning it)."""
    neither = "seeds must be a count or a list of integers, got {!r}"
    if isinstance(seeds, (bool, str, bytes, bytearray)):  # bool: an int, but no count; bytes would iterate as ints
        raise ConfigError(neither.format(seeds))
    if isinstance(seeds, (int, numbers.Integral)):  # NumPy integers too (bool was refused above)
        count = int(seeds)
        if count > MAX_SEEDS:
            raise ConfigError(
                f"seeds (CLI: --seeds) {count:,} is more than {MAX_SEEDS:,}; give a count such as 10 (the paper's)"
            )
        values = list(range(count))
    else:
        try:
            values = list(seeds)
        except TypeError:  # 2.5, None: neither a count nor a list
            raise ConfigError(neither.format(seeds)) from None
    if not values:
        raise ConfigError(f"seeds must be at least 1 (got {seeds!r})")
    if len(values) > MAX_SEEDS:
        raise ConfigError(f"{len(values):,} seeds is more than {MAX_SEEDS:,}; give fewer")
    bad = [v for v in values if not (is_integer(v) and 0 <= v <= MAX_SEED)]
    if bad:
        raise ConfigError(f"seeds must be integers in [0, 2^63), got {bad[0]!r}")
    if len(set(values)) != len(values):
        raise ConfigError(f"seed {repeated_values(values)[0]} is listed twice; give each seed once")
    return values


@dataclass
class RunRecord:
    """One stage-2 run (the results.json schema)."""

    method: str
    budget: str
    config: dict[str, Any]
    seed: int
    data: str
    steps: int
    stage1_steps: int
    data_using: bool
    trainable_params: int
    trainable_pct: float
    task1_acc_before: float
    task1_acc_after: float
    task2_acc: float
    kl_task1: float

    @property
    def forgetting(self) -> float:
        """Task-1 accuracy lost in stage 2 (before minus after; negative when it rose)."""
        return self.task1_acc_before - self.task1_acc_after

    @property
    def key(self) -> tuple[str, str, int, int]:
        """(method, budget, seed, steps): what identifies a run; a resumed experiment keeps the runs recorded."""
        return (self.method, self.budget, self.seed, self.steps)


@dataclass
class ContinualResult:
    """Records, their summary and the files written."""

    records: list[RunRecord]
    results_json: Path
    html: Path
    settings: ContinualSettings
    summary: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- measurements
def symmetric_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> float:
    """Mean over rows of 0.5 (KL(p||q) + KL(q||p)) between softmax(logits_p) and softmax(logits_q)."""
    for argument, logits in (("logits_p", logits_p), ("logits_q", logits_q)):
        if not (isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.numel() and logits.ndim):
            raise ConfigError(
                f"symmetric_kl: {argument} must be a non-empty float tensor of logits [rows, classes], got "
                f"{describe(logits)}"
            )
    if logits_p.shape != logits_q.shape:
        raise ConfigError(
            f"symmetric_kl: logits_p {list(logits_p.shape)} and logits_q {list(logits_q.shape)} differ in shape; give "
            "the two models' logits on the same inputs"
        )
    lp = torch.log_softmax(logits_p.double(), dim=-1)
    lq = torch.log_softmax(logits_q.double(), dim=-1)
    kl_pq = (lp.exp() * (lp - lq)).sum(-1)
    kl_qp = (lq.exp() * (lq - lp)).sum(-1)
    return float((0.5 * (kl_pq + kl_qp)).mean())


@torch.no_grad()
def task_logits(model: torch.nn.Module, x: torch.Tensor, task: int = 1) -> torch.Tensor:
    """The logits of one task's head, in eval mode (the benchmark's models have one head per task)."""
    from plate_inspect.train.layer import model_argument

    model_argument(model, "task_logits").eval()
    return model(x, task=task)


def ci95(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% Student-t confidence interval of the mean); half-width 0 for one value."""
    values = finite_numbers(values, "ci95: values")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    from scipy.stats import t

    return mean, float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


# --------------------------------------------------------------------------- running
def stage_one(
    out: Path,
    seed: int,
    s: ContinualSettings,
    task1: digits.Task,
    finished: Iterable[RunRecord] = (),
    progress: ProgressCallback | None = None,
) -> tuple[StageOne, float, torch.Tensor]:
    """Train and save the seed's stage-1 model; return it with its task-1 accuracy and task-1 test logits. Checked
    against the seed's ``finished`` runs (:func:`check_same_stage_one`) before it replaces their checkpoint.
    ``progress``: one event per Adam step."""
    seed_dir = out / f"seed{seed}"
    seed_dir.mkdir(parents=True, exist_ok=True)
    n_classes = int(task1.y_train.max()) + 1
    init = digits.initial_model(task1.d_in, seed, n_classes=n_classes).state_dict()
    model = digits.train_stage1(task1, seed, steps=s.stage1_steps, lr=s.lr, batch_size=s.batch_size, progress=progress)
    acc = digits.accuracy(model, task1.x_test, task1.y_test, 1)
    check_same_stage_one(out, seed, acc, finished)
    ckpt = seed_dir / "stage1.safetensors"
    digits.save_model(model, ckpt)
    stage1 = StageOne(seed, seed_dir, ckpt, task1, {k: v.clone() for k, v in init.items()}, s.max_rank)
    return stage1, acc, task_logits(model, task1.x_test)


def plan(s: ContinualSettings, seeds: list[int]) -> list[tuple[int, int, str, Budget]]:
    """(seed, steps, method, budget) of every stage-2 run, in run order."""
    return [(seed, st, m, b) for seed in seeds for st in s.steps for m in s.methods for b in s.budgets_of(m)]


def run_one(
    stage1: StageOne,
    acc_before: float,
    logits_before: torch.Tensor,
    method: str,
    budget: Budget,
    steps: int,
    task2: digits.Task,
    s: ContinualSettings,
    progress: ProgressCallback | None = None,
) -> RunRecord:
    """One stage-2 run of ``method`` at ``budget`` for ``steps`` steps, measured (``progress``: per Adam step)."""
    torch.manual_seed(stage1.seed)
    prep = prepare(method, budget.config, stage1)
    digits.train(
        prep.model,
        prep.params,
        task2,
        2,
        steps=steps,
        lr=s.lr,
        batch_size=s.batch_size,
        seed=stage1.seed,
        penalty=prep.penalty,
        progress=progress,
    )
    task1 = stage1.task1
    n_backbone = backbone_params(digits.load_model(stage1.checkpoint))
    return RunRecord(
        method=method,
        budget=budget.id,
        config={**budget.config, **prep.config},
        seed=stage1.seed,
        data=s.data,
        steps=steps,
        stage1_steps=s.stage1_steps,
        data_using=method in DATA_USING,
        trainable_params=int(prep.trainable_params),
        trainable_pct=100.0 * prep.trainable_params / n_backbone,
        task1_acc_before=acc_before,
        task1_acc_after=digits.accuracy(prep.model, task1.x_test, task1.y_test, 1),
        task2_acc=digits.accuracy(prep.model, task2.x_test, task2.y_test, 2),
        kl_task1=symmetric_kl(logits_before, task_logits(prep.model, task1.x_test)),
    )


def _read_jsonl(path: Path) -> list[RunRecord]:
    """The finished runs of ``path``. A torn last line (the process died while appending it: no newline after it)
    is left out, so that run runs again; any other unreadable line is a ConfigError naming the file and line."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(RunRecord(**json.loads(line)))
        except (ValueError, TypeError) as e:
            if number == len(lines):  # the unterminated tail of an interrupted append
                break
            raise ConfigError(
                f"{path}: line {number} is not a run record ({e}); delete that line (its run reruns) or choose "
                "another --out"
            ) from None
    return records


def _drop_torn_tail(path: Path) -> None:
    """Cut an unterminated last line off ``path`` (a torn append) so the next record starts on a line of its own."""
    if not path.exists():
        return
    text = path.read_text()
    if text and not text.endswith("\n"):
        atomic_write(path, text[: text.rfind("\n") + 1])


def _append_record(path: Path, rec: RunRecord) -> None:
    with path.open("a") as f:
        f.write(json.dumps(asdict(rec)) + "\n")
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def writing_errors(out: Path, kept: str) -> Iterator[None]:
    """An OSError while writing under ``out`` (disk full, read-only file system, a file in the way) as a one-line
    ConfigError naming the file; ``kept`` says what is saved so far."""
    try:
        yield
    except OSError as e:
        where = Path(e.filename) if e.filename else out  # atomic_write names its target, not its temp file
        reason = os_error_reason(where, e)
        fix = os_fault(e).mend
        raise ConfigError(
            f"{where}: cannot write ({reason}); {kept}: {fix}, then rerun the same command to resume; or choose "
            "another --out"
        ) from None


def settings_diff(old: Any, new: dict[str, Any], flags: dict[str, str] | None = None) -> str:
    """How the settings ``old`` (as read back from JSON) differ from ``new``: "a: x -> y; ..." ("" when they agree);
    a key in ``flags`` is named with its CLI flag ("stage1_steps (CLI: --stage1-steps): 5 -> 6"), and budgets by
    method and budget id ("budgets of lora: r1, r8 -> r1")."""
    if not isinstance(old, dict):
        return f"no readable settings recorded ({_brief(old)})"
    new = json.loads(json.dumps(new))  # as JSON reads it back: tuples -> lists
    keys = [k for k in sorted(set(old) | set(new)) if k not in _NOT_IDENTITY and old.get(k) != new.get(k)]
    if "methods" in keys and "budgets" in keys:  # other methods have other budgets: that says nothing more
        keys.remove("budgets")
    flags = flags or {}
    parts = []
    for k in keys:
        if k == "budgets" and isinstance(old.get(k), dict) and isinstance(new.get(k), dict):
            parts.extend(_budgets_diff(old[k], new[k]))
        else:
            name = f"{k} (CLI: {flags[k]})" if k in flags else k
            parts.append(f"{name}: {_brief(old.get(k))} -> {_brief(new.get(k))}")
    return "; ".join(parts)


def _budgets_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Per method whose budgets differ: "budgets of lora: r1, r8 -> r1" (their ids; their configs where ids agree),
    noting --quick where one side is the other's first budget alone (a --quick run beside a full one)."""

    def ids(budgets: Any) -> list[str]:
        try:
            return [str(b["id"]) for b in budgets]
        except (TypeError, KeyError):
            return [_brief(budgets)]

    parts = []
    for m in sorted(set(old) | set(new)):
        if old.get(m) != new.get(m):
            was, now = ids(old.get(m)), ids(new.get(m))
            shorter, longer = sorted((was, now), key=len)
            quick = len(shorter) == 1 and len(longer) > 1 and longer[0] == shorter[0]
            if was == now:
                was, now = [_brief(old.get(m))], [_brief(new.get(m))]
            note = " (--quick runs each method's first budget only)" if quick else ""
            parts.append(f"budgets of {m}: {', '.join(was)} -> {', '.join(now)}{note}")
    return parts


_FLAGS = {"data": "--data", "stage1_steps": "--stage1-steps"}  # the CLI options behind continual's settings
_NOT_IDENTITY = ("data_root",)  # where the data files are read from does not change a run


def _brief(value: Any, width: int = 60) -> str:
    text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return text if len(text) <= width else text[: width - 3] + "..."


def run_continual(
    out_dir: str | os.PathLike,
    seeds: int | list[int] = 10,
    settings: ContinualSettings | None = None,
    console: Console | None = None,
    progress: ProgressCallback | None = None,
) -> ContinualResult:
    """Run the benchmark over ``seeds`` (a count -> 0..K-1, or a list); write results.json, summary.md, the HTML.

    Finished runs are appended to OUT/runs.jsonl as they complete; rerunning with the same settings skips them
    (an interrupted run resumes), and more seeds, methods or stage-2 step counts add only their own runs (other
    data, stage-1 steps or budgets are a ConfigError naming them). The outputs are of the runs ``seeds`` and
    ``settings`` name. ``progress`` gets one event per Adam step (unit "steps": each seed's stage 1 and every
    run of ``plan``, so a sweep of 60 to 2,400 steps gets a true ETA; the steps of runs already in runs.jsonl count
    as done in the opening event).
    """
    path_argument(out_dir, "out_dir")
    progress = as_callback(progress, "run_continual")  # a non-function failed at the first event, after OUT was made
    if console is not None and not callable(getattr(console, "print", None)):  # failed after every run had finished
        raise ConfigError(f"console must be a rich.console.Console or None, got {console!r:.80}")
    if settings is not None and not isinstance(settings, ContinualSettings):
        raise ConfigError(f"settings must be a ContinualSettings or None, got {settings!r:.80}")
    s = settings or ContinualSettings()
    s.validate()
    seeds_run = seed_list(seeds)
    if only_results_json(out_dir):
        raise ConfigError(
            f"{out_dir}: holds results.json but no runs.jsonl, so its runs cannot be resumed or added to (a run would "
            "overwrite results.json); choose another --out, or add --report-only to rebuild its summary and figure"
        )
    task1, task2 = digits.load_tasks(s.data, s.data_root)  # a missing data set is refused before OUT is touched
    check_not_other_experiment(out_dir, "continual")
    out = make_dirs(out_dir, "the output directory")
    settings_dict = _settings_dict(s)
    settings_json = json.dumps(settings_dict, indent=2, sort_keys=True) + "\n"
    jsonl = out / "runs.jsonl"
    settings_path = out / "settings.json"
    if jsonl.exists():
        try:
            recorded = json.loads(settings_path.read_text())
        except PermissionError as e:  # there, but not this user's to read: not "other settings"
            raise ConfigError(os_error_text(e) or str(e)) from None
        except (OSError, ValueError):
            recorded = None
        differ = settings_diff(*_shared_runs(recorded, settings_dict), _FLAGS) if recorded is not None else ""
        if recorded is None or differ:
            differ = differ or "settings.json is missing or unreadable"
            raise ConfigError(
                f"{out}: holds runs made with other settings ({differ}); rerun with its settings to resume "
                "or add runs (more --methods, --steps or --seeds), or choose another --out"
            )
        # methods/steps added to a run: settings.json lists every one run
        settings_dict = _all_runs(recorded, settings_dict)
        settings_json = json.dumps(settings_dict, indent=2, sort_keys=True) + "\n"
    kept = f"the runs that finished are kept in {jsonl}"
    with writing_errors(out, kept):
        atomic_write(settings_path, settings_json)
        _drop_torn_tail(jsonl)
    done = {r.key: r for r in _read_jsonl(jsonl)}
    todo = plan(s, seeds_run)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 3-layer MLP: threads only add overhead (and contend on a shared machine)
    left = {seed for seed, st, m, b in todo if (m, b.id, seed, st) not in done}  # seeds whose stage 1 trains
    total = sum(st for _, st, _, _ in todo) + s.stage1_steps * len(left)
    finished = sum(st for seed, st, m, b in todo if (m, b.id, seed, st) in done)
    counter = ProgressCounter(progress, total, "steps", done=finished)
    counter.start()
    try:
        with writing_errors(out, kept):
            for seed in seeds_run:
                mine = [r for r in todo if r[0] == seed and (r[2], r[3].id, seed, r[1]) not in done]
                if not mine:
                    continue
                stage1_progress = counter.inner(f"seed {seed}: stage 1")
                stage1, acc_before, logits_before = stage_one(out, seed, s, task1, done.values(), stage1_progress)
                for _, steps, method, budget in mine:
                    run_progress = counter.inner(f"seed {seed} steps {steps}: {method} {budget.id}")
                    rec = run_one(stage1, acc_before, logits_before, method, budget, steps, task2, s, run_progress)
                    _append_record(jsonl, rec)
                    done[rec.key] = rec
    finally:
        torch.set_num_threads(torch_threads)
    records = [done[(m, b.id, seed, st)] for seed, st, m, b in todo]
    with writing_errors(out, kept):
        return write_outputs(out, records, s, console=console)


def check_same_stage_one(out: Path, seed: int, acc_before: float, finished: Iterable[RunRecord]) -> None:
    """ConfigError when the seed's retrained stage-1 model is not the one its finished runs started from (its task-1
    accuracy differs: another torch, another machine): runs added to OUT would be compared across two models."""
    recorded = sorted({r.task1_acc_before for r in finished if r.seed == seed})
    if recorded and recorded != [acc_before]:
        raise ConfigError(
            f"{out}: stage 1 of seed {seed} does not reproduce (task-1 accuracy {acc_before:.4f} now, "
            f"{', '.join(f'{a:.4f}' for a in recorded)} in its finished runs), so new runs would start from another "
            "model; give them another --out"
        )


def _shared_runs(old: Any, new: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``old`` and ``new`` settings without the method and stage-2 step lists, and with the budgets of the methods both
    name: each (method, steps) run starts from the same stage-1 model on its own, so adding (or leaving out) a method
    or a step count changes no other run; the rest (data, stage-1 steps, optimiser, shared budgets) must agree."""
    if not (isinstance(old, dict) and isinstance(old.get("methods"), list) and isinstance(old.get("budgets"), dict)):
        return old, new
    both = set(old["methods"]) & set(new["methods"])

    def shared(d: dict[str, Any]) -> dict[str, Any]:
        kept = {k: v for k, v in d.items() if k not in ("methods", "steps")}
        return {**kept, "budgets": {m: b for m, b in d["budgets"].items() if m in both}}

    return shared(old), shared(new)


def _all_runs(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` listing every method of ``old`` too (in METHODS order, each with its budgets) and every stage-2 step
    count of either (ascending)."""
    methods = [m for m in METHODS if m in old["methods"] or m in new["methods"]]
    steps = sorted({*_int_values(old.get("steps")), *new["steps"]})
    return {**new, "methods": methods, "steps": steps, "budgets": {**old["budgets"], **new["budgets"]}}


def _int_values(value: Any) -> list[int]:
    """The integers of a settings.json list (an older or hand-edited file may hold anything)."""
    return [v for v in value if is_integer(v)] if isinstance(value, list) else []


def _settings_dict(s: ContinualSettings) -> dict[str, Any]:
    d = asdict(s)
    d["budgets"] = {m: [asdict(b) for b in s.budgets_of(m)] for m in s.methods}
    return d


def write_outputs(
    out: Path, records: list[RunRecord], s: ContinualSettings, console: Console | None = None
) -> ContinualResult:
    """results.json (validated), summary.md and continual.html from ``records``; print the table to ``console``."""
    from plate_inspect.experiments.continual_report import markdown_report, rich_table, write_html

    data = [asdict(r) for r in records]
    validate_records(data)
    results_json = out / "results.json"
    atomic_write(results_json, json.dumps(data, indent=2) + "\n")
    rows = summarize(records)
    atomic_write(out / "summary.md", markdown_report(rows) + "\n")
    html = write_html(rows, out / "continual.html", title=f"{s.data}: classes 0-4 -> 5-9")
    if console is not None:
        seeds = sorted({r.seed for r in records})
        console.print(rich_table(rows, title=f"{s.data} 0-4 -> 5-9, seeds {seeds}, mean ± 95% CI"))
    return ContinualResult(records, results_json, html, s, rows)


def records_from_dir(out: str | os.PathLike) -> tuple[list[RunRecord], ContinualSettings]:
    """The finished runs of an output directory and its settings (for reports of partial runs): from runs.jsonl, or
    from results.json where runs.jsonl is absent (a published directory such as docs/arena/steps keeps only that)."""
    out = path_argument(out, "out")
    if not (out / "runs.jsonl").exists() and not (out / "results.json").exists():
        raise ConfigError(
            f"{out}: no runs.jsonl or results.json here; run "
            f"`plate-inspect experiment continual --out {shlex.quote(str(out))}` first"
        )
    try:
        raw = json.loads((out / "settings.json").read_text())
        raw["budgets"] = {m: [Budget(**b) for b in bs] for m, bs in raw["budgets"].items()}
        for key in ("methods", "steps"):
            raw[key] = tuple(raw[key])
        settings = ContinualSettings(**raw)
    except PermissionError as e:  # there, but not this user's to read: rerunning would not help
        raise ConfigError(os_error_text(e) or str(e)) from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(
            f"{out / 'settings.json'}: missing or unreadable ({type(e).__name__}: {e}); it is written by "
            f"`plate-inspect experiment continual --out {shlex.quote(str(out))}`: rerun that command with the run's "
            "options"
        ) from None
    if not (out / "runs.jsonl").exists():
        return _read_results(out / "results.json"), settings
    records = _read_jsonl(out / "runs.jsonl")
    if not records:
        raise ConfigError(f"{out / 'runs.jsonl'}: holds no finished run yet; nothing to report")
    return records, settings


def _read_results(path: Path) -> list[RunRecord]:
    """The run records of a results.json (validated: ConfigError naming the file and what is wrong)."""
    try:
        data = json.loads(path.read_text())
        validate_records(data)
    except (OSError, ValueError, ConfigError) as e:  # validate_records' ConfigError: named with the file here
        raise ConfigError(f"{path}: not a results.json of run records ({e})") from None
    return [RunRecord(**rec) for rec in data]


def only_results_json(out: str | os.PathLike) -> bool:
    """Whether ``out`` keeps its runs in results.json alone (no runs.jsonl): they cannot be resumed or added to,
    and a report of part of them would overwrite the only copy of the others."""
    out = path_argument(out, "out")
    return (out / "results.json").is_file() and not (out / "runs.jsonl").exists()


_R = TypeVar("_R", bound="RunRecord | SequentialRecord")


def select_records(
    records: list[_R],
    where: str | os.PathLike,
    methods: list[str] | tuple[str, ...] | None = None,
    steps: list[int] | tuple[int, ...] | None = None,
    seeds: list[int] | None = None,
) -> list[_R]:
    """The finished runs of the given methods, stage-2 step counts and seeds (None: all), for a report of part of a
    run; ConfigError naming what ``where`` holds for a value no finished run has (a report of a typo would be empty).
    Records of the continual benchmark or of the sequential one (both have method, steps and seed)."""
    records = list(iterable_argument(records, "records", "run records (RunRecord or SequentialRecord)"))
    methods = name_list(methods, "methods (CLI: --methods)") if methods is not None else None
    steps = positive_ints(steps, "steps (CLI: --steps)") if steps is not None else None
    seeds = seed_list(seeds) if seeds is not None else None
    rank = {m: i for i, m in enumerate(METHODS)}
    for flag, what, wanted, attr in (
        ("CLI: --methods", "method", methods, "method"),
        ("CLI: --steps", "stage-2 step count", steps, "steps"),
        ("CLI: --seeds", "seed", seeds, "seed"),
    ):
        if wanted is None:
            continue
        have = sorted({getattr(r, attr) for r in records}, key=lambda v: rank.get(v, 0) if attr == "method" else v)
        missing = [str(v) for v in wanted if v not in have]
        if missing:
            raise ConfigError(
                f"{where} has no finished run of {what} {', '.join(missing)} ({flag}); finished: "
                f"{', '.join(map(str, have))}"
            )
        records = [r for r in records if getattr(r, attr) in wanted]
    return records


# --------------------------------------------------------------------------- aggregation
def summarize(records: list[RunRecord]) -> list[dict[str, Any]]:
    """Mean and 95% CI over seeds per (data, steps, method, budget); accuracies/forgetting in %, KL raw; the trainable
    count's mean and its range over seeds (it differs by seed for PLATE and its ablations)."""
    records = list(iterable_argument(records, "summarize: records", "RunRecord"))
    if not all(isinstance(rec, RunRecord) for rec in records):
        bad = next(rec for rec in records if not isinstance(rec, RunRecord))
        raise ConfigError(f"summarize: records must be RunRecords (records_from_dir gives them), got {bad!r:.80}")
    groups: dict[tuple[str, int, str, str], list[RunRecord]] = {}
    for rec in records:
        groups.setdefault((rec.data, rec.steps, rec.method, rec.budget), []).append(rec)
    rows = []
    for (data, steps, method, budget), recs in groups.items():
        row: dict[str, Any] = {
            "data": data,
            "steps": steps,
            "method": method,
            "budget": budget,
            "seeds": len(recs),
            # PLATE's k (hence its count) comes from each seed's weights: the mean for sorting, the range for tables
            "trainable_params": round(statistics.fmean(r.trainable_params for r in recs)),
            "trainable_min": min(r.trainable_params for r in recs),
            "trainable_max": max(r.trainable_params for r in recs),
            "data_using": recs[0].data_using,
        }
        values = {
            "trainable_pct": [r.trainable_pct for r in recs],
            "task1_acc_before": [100 * r.task1_acc_before for r in recs],
            "task1_acc_after": [100 * r.task1_acc_after for r in recs],
            "forgetting": [100 * r.forgetting for r in recs],
            "task2_acc": [100 * r.task2_acc for r in recs],
            "kl_task1": [r.kl_task1 for r in recs],
        }
        for key in SUMMARY_KEYS:
            row[key], row[key + "_ci"] = ci95(values[key])
        rows.append(row)
    return rows


def validate_records(data: Any) -> None:
    """Raise ConfigError unless ``data`` is a list of records in the results.json schema."""
    if not isinstance(data, list) or not data:
        raise ConfigError("results.json must hold a non-empty list of records")
    for rec in data:
        if not isinstance(rec, dict) or set(rec) != set(RECORD_KEYS):
            raise ConfigError(f"record with keys {sorted(rec) if isinstance(rec, dict) else rec!r} is malformed")
        if rec["method"] not in METHODS or not isinstance(rec["config"], dict) or not isinstance(rec["seed"], int):
            raise ConfigError(f"record {rec} has a bad method/config/seed")
        if rec["data"] not in digits.DATA_SETS or not (isinstance(rec["steps"], int) and rec["steps"] > 0):
            raise ConfigError(f"record {rec} has a bad data set or step count")
        for key in ("task1_acc_before", "task1_acc_after", "task2_acc"):
            if not 0.0 <= real_value(rec[key]) <= 1.0:  # None, a string, NaN: not an accuracy (was a TypeError)
                raise ConfigError(f"{key}={rec[key]!r:.80} is not an accuracy in [0, 1]")
        if not (is_integer(rec["trainable_params"]) and rec["trainable_params"] > 0):
            raise ConfigError(f"trainable_params={rec['trainable_params']!r} must be a positive int")
        kl, pct = real_value(rec["kl_task1"]), real_value(rec["trainable_pct"])
        if not (math.isfinite(kl) and kl >= 0 and 0 < pct <= 100):
            raise ConfigError(f"record {rec} has a bad KL or trainable %")
