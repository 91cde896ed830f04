"""One progress style: every long-running API sends ProgressEvents whose ``done`` starts at 0, never decreases
and ends at ``total``, where total is the real number of units (modules, batches, families, runs), counted
here independently of the code under test (tensor names read with safetensors' own loader, lines written
to runs.jsonl, the inputs and families the test itself builds)."""

from __future__ import annotations

import io
import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from oracles import load_all
from rich.console import Console
from torch import nn

import plate_inspect
from plate_inspect.progress import ProgressEvent

QWEN_TARGET = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


class Recorder:
    """A progress callback that keeps every event."""

    def __init__(self) -> None:
        self.events: list[ProgressEvent] = []

    def __call__(self, event: ProgressEvent) -> None:
        self.events.append(event)

    def check(self, total: int | None, unit: str, units: int | None = None) -> None:
        """Opening event at 0, monotone, ending at ``units`` (= total unless total is unknown)."""
        ev = self.events
        assert ev, "no progress event"
        assert ev[0].label == "" and all(e.unit == unit and e.total == total for e in ev)
        done = [e.done for e in ev]
        assert done == sorted(done) and len(set(done)) == len(done)  # strictly increasing: one event per step
        assert done[-1] == (total if units is None else units)
        assert all(e.label for e in ev[1:])


@pytest.fixture(scope="module")
def qwen_targets(qwen_ckpt):
    """(name, stored bytes) of every Qwen2 target weight, by tensor name, read with safetensors' loader."""
    return {n[: -len(".weight")]: t.numel() * t.element_size() for n, t in load_all(qwen_ckpt.path).items()
            if QWEN_TARGET.search(n)}  # fmt: skip


def test_scan_reports_every_module_and_its_bytes(qwen_ckpt, qwen_targets, tmp_path):
    rec = Recorder()
    plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8, progress=rec)
    rec.check(len(qwen_targets), "modules")
    assert len(qwen_targets) == 14
    assert {e.label for e in rec.events[1:]} == set(qwen_targets)
    assert rec.events[-1].bytes_total == rec.events[-1].bytes_done == sum(qwen_targets.values())
    steps = [b.bytes_done - a.bytes_done for a, b in zip(rec.events, rec.events[1:], strict=False)]
    assert steps == [qwen_targets[e.label] for e in rec.events[1:]]
    again = Recorder()  # a rescan that keeps every module still reads and reports each one
    plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8, progress=again)
    again.check(len(qwen_targets), "modules")


def test_scan_on_two_worker_processes_counts_all_modules(qwen_ckpt, qwen_targets, tmp_path):
    rec = Recorder()
    plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8, devices="cpu,cpu", progress=rec)
    rec.check(len(qwen_targets), "modules")
    assert sorted(e.label for e in rec.events[1:]) == sorted(qwen_targets)
    assert rec.events[-1].bytes_done == sum(qwen_targets.values())


def test_old_scan_progress_object_still_works_with_a_warning(qwen_ckpt, qwen_targets, tmp_path):
    from plate_inspect.scanner import ScanProgress

    calls: list[tuple] = []

    class Old(ScanProgress):
        def start(self, total_modules, total_bytes, already_done, already_bytes):
            calls.append(("start", total_modules, total_bytes))

        def module_done(self, name, nbytes):
            calls.append(("module", name, nbytes))

        def finish(self):
            calls.append(("finish",))

    with pytest.warns(DeprecationWarning, match="ScanProgress"):
        plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8, layers=[0], progress=Old())
    layer0 = {n: b for n, b in qwen_targets.items() if ".layers.0." in n}
    assert calls[0] == ("start", len(layer0), sum(layer0.values())) and calls[-1] == ("finish",)
    assert {(n, b) for _, n, b in calls[1:-1]} == set(layer0.items())


def test_verify_reports_every_module(qwen_ckpt, qwen_targets, tmp_path):
    bundle = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8)
    rec = Recorder()
    assert plate_inspect.verify(bundle, qwen_ckpt.path, progress=rec).ok
    rec.check(len(qwen_targets), "modules")
    assert {e.label for e in rec.events[1:]} == set(qwen_targets)


def test_audit_reports_every_module(qwen_ckpt, qwen_targets):
    from plate_inspect.auditing import audit

    rec = Recorder()
    records = audit(qwen_ckpt.path, qwen_ckpt.path, r=8, progress=rec)
    rec.check(len(qwen_targets), "modules")
    assert [e.label for e in rec.events[1:]] == [r.module for r in records]


def test_report_counts_modules_and_expert_groups(qwen_ckpt, qwen_targets, tmp_path):
    from plate_inspect.reports import report_data, write_report
    from plate_inspect.testing.synthetic import write_family

    bundle = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8)
    rec = Recorder()
    write_report([bundle], tmp_path / "r.html", progress=rec)
    rec.check(len(qwen_targets), "modules")
    # a MoE bundle: experts are aggregated per (layer, type) group, one step of as many units as experts
    ckpt = write_family(tmp_path / "mixtral", "mixtral")
    moe = plate_inspect.scan(ckpt.path, tmp_path / "moe", r=4, max_rank=16)
    stored = [n for n in load_all(ckpt.path) if n.endswith(".weight") and re.search(r"(proj|w[123])\.weight$", n)]
    rec = Recorder()
    report_data([moe], progress=rec)
    rec.check(len(stored), "modules")
    n_experts = json.loads((ckpt.path / "config.json").read_text())["num_local_experts"]
    group_steps = [b.done - a.done for a, b in zip(rec.events, rec.events[1:], strict=False) if b.done - a.done > 1]
    assert group_steps and set(group_steps) == {n_experts}


def test_old_three_argument_report_callback_still_works(qwen_ckpt, qwen_targets, tmp_path):
    from plate_inspect.reports import report_data

    bundle = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8, layers=[0])
    seen: list[tuple[int, int]] = []
    with pytest.warns(DeprecationWarning, match=r"progress\(done, total, name\)"):
        report_data([bundle], progress=lambda done, total, name: seen.append((done, total)))
    n = sum(".layers.0." in name for name in qwen_targets)
    assert seen == [(i, n) for i in range(1, n + 1)]


@pytest.mark.parametrize("function", ["write_report", "render_report", "report_data"])
def test_old_style_report_callback_warning_names_the_function_called(qwen_ckpt, tmp_path, function):
    import plate_inspect.reports as reports

    bundle = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8, layers=[0])
    call = getattr(reports, function)
    args = ([bundle], tmp_path / "r.html") if function == "write_report" else ([bundle],)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(*args, progress=lambda done, total, name: None)
    deprecations = [w for w in caught if w.category is DeprecationWarning]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    assert str(deprecations[0].message).startswith(f"{function}: progress(done, total, name) is deprecated")
    assert deprecations[0].filename == __file__  # the warning points at the caller's line, not the library's


@pytest.mark.parametrize("function", ["scan", "run_scan"])
def test_old_style_scan_callback_warning_names_the_function_called(qwen_ckpt, tmp_path, function):
    from plate_inspect.bundle import ScanSettings
    from plate_inspect.scanner import plan_scan, run_scan

    seen: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if function == "scan":
            plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8, layers=[0], progress=lambda d, t, n: seen.append(d))
        else:
            plan = plan_scan(qwen_ckpt.path, ScanSettings(r=8, layers=(0,)))
            run_scan(plan, tmp_path / "b", progress=lambda d, t, n: seen.append(d))
    deprecations = [w for w in caught if w.category is DeprecationWarning]
    assert [str(w.message).split(":")[0] for w in deprecations] == [function]
    assert deprecations[0].filename == __file__
    assert seen and seen == list(range(1, len(seen) + 1))


def test_activation_moments_count_batches():
    from plate_inspect.analysis.alignment import collect_input_moments

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    batches = [torch.randn(5, 4) for _ in range(7)]
    rec = Recorder()
    collect_input_moments(model, batches, progress=rec)
    rec.check(len(batches), "batches")
    streamed = Recorder()  # an iterator: the total is unknown, the count still reaches the number of batches
    collect_input_moments(model, iter(batches), progress=streamed)
    streamed.check(None, "batches", units=len(batches))


def _curvature_parts(name: str, n_probes: int) -> list[str]:
    """The labels one family's analysis must send, in order: three solves, each probe, the forgetting curve."""
    solves = ["top Hessian eigenvalue", "top GGN eigenvalue", "drift radius"]
    probes = [f"probe {i}/{n_probes}" for i in range(1, n_probes + 1)]
    return [f"{name}: {part}" for part in (*solves, *probes, "forgetting curve")]


def test_curvature_counts_solves_probes_and_curves(monkeypatch):
    """Finer than one event per family (QA: the bar sat still through full_backbone's minutes): one per
    top-eigenvalue solve, per GN probe and per forgetting curve, for analyze_families and analyze_family alike."""
    monkeypatch.setattr(plate_inspect.progress, "WITHIN_INTERVAL_S", float("inf"))  # units only (within: _qa)
    from plate_inspect.analysis.curvature import (
        OldTaskProblem,
        analyze_families,
        analyze_family,
        full_family,
        lora_family,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.arange(12) % 3
    families = [full_family(model), lora_family(model, ["2"], rank=1, seed=0)]
    rec = Recorder()
    records = analyze_families(model, F.cross_entropy, [(x, y)], families, n_probes=2, rhos=(0.1,), progress=rec)
    want = [label for f in families for label in _curvature_parts(f.name, 2)]
    rec.check(len(want), "parts")
    assert [e.label for e in rec.events[1:]] == want
    assert [r.family for r in records] == [f.name for f in families]
    one = Recorder()
    problem = OldTaskProblem(model, F.cross_entropy, [(x, y)])
    analyze_family(problem, families[1], n_probes=3, rhos=(0.1,), progress=one)
    one.check(7, "parts")
    assert [e.label for e in one.events[1:]] == _curvature_parts(families[1].name, 3)


def test_stage_one_training_counts_adam_steps():
    """The stage-1 trainer reports every Adam step (QA: curvature's stage 1 was ~10 s with no bar); the total is
    epochs x ceil(n_train / batch), computed here from the task's own size."""
    from plate_inspect.experiments import digits

    task1, _ = digits.load_digit_tasks()
    rec = Recorder()
    digits.train_stage1(task1, seed=0, epochs=2, progress=rec)
    per_epoch = -(-task1.x_train.shape[0] // 128)
    rec.check(2 * per_epoch, "steps")
    labels = [e.label for e in rec.events[1:]]
    assert labels[per_epoch - 1] == "task 1, epoch 1" and labels[per_epoch] == labels[-1] == "task 1, epoch 2"
    steps = Recorder()
    model = digits.initial_model(task1.d_in, seed=0)
    assert digits.train(model, list(model.parameters()), task1, 1, steps=5, progress=steps) == 5
    steps.check(5, "steps")


def test_curvature_cli_draws_a_bar_for_stage_one_and_for_the_analysis(monkeypatch):
    """`plate-inspect curvature`: one bar through the stage-1 training, one through the analysis (both counted)."""
    from contextlib import contextmanager

    from click.testing import CliRunner

    from plate_inspect.analysis import curvature
    from plate_inspect.cli import analyze
    from plate_inspect.cli.main import cli
    from plate_inspect.experiments import digits

    bars: dict[str, Recorder] = {}

    @contextmanager
    def recording_bar(label: str, quiet: bool = False, transient: bool = False):
        bars[label] = Recorder()
        yield None if quiet else bars[label]

    monkeypatch.setattr(analyze, "progress_bar", recording_bar)
    monkeypatch.setattr(curvature, "batches", lambda x, y: [(x[:16], y[:16])])  # P0 cut to 16 images: fast
    monkeypatch.setattr(plate_inspect.progress, "WITHIN_INTERVAL_S", float("inf"))  # units only (within: _qa)
    args = ["curvature", "--epochs", "1", "--probes", "1", "--families", "plate", "--rho", "0.1"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    stage1, analysis = bars.pop("stage 1: train on task 1"), bars.pop("curvature")
    assert not bars
    task1, _ = digits.load_digit_tasks()
    stage1.check(-(-task1.x_train.shape[0] // 128), "steps")
    analysis.check(5, "parts")
    assert [e.label for e in analysis.events[1:]] == _curvature_parts("plate", 1)


def test_continual_counts_adam_steps_and_resumes(tmp_path):
    """One event per Adam step of every stage 1 and run (was one per run: a sweep of 60 to 2,400 steps got a wrong
    ETA, and the seed's stage 1 was silent). Oracle: the runs written to runs.jsonl and their recorded steps."""
    from plate_inspect.experiments.continual import ContinualSettings, run_continual

    settings = ContinualSettings(methods=("full_ft", "lora"), steps=(3, 4), stage1_steps=5)
    rec = Recorder()
    run_continual(tmp_path, seeds=1, settings=settings, progress=rec)
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]  # what actually ran
    assert len(runs) >= 4
    total = sum(r["steps"] for r in runs) + 5  # one seed's stage 1
    rec.check(total, "steps")
    labels = [e.label for e in rec.events[1:]]
    assert labels[:5] == ["seed 0: stage 1"] * 5 and labels[5:8] == ["seed 0 steps 3: full_ft all"] * 3
    again = Recorder()  # everything is done: one opening event at total, with no stage 1 to train
    run_continual(tmp_path, seeds=1, settings=settings, progress=again)
    assert [(e.done, e.total) for e in again.events] == [(total - 5, total - 5)]


def test_scan_bytes_of_an_fp8_checkpoint_count_the_scales(tmp_path):
    """The bar's byte total is what the scan reads: FP8 codes and their scales (QA: 33.47 KB on the bar, 34.24 KB
    in the summary). Oracle: the stored sizes of the weights and scale tensors, from safetensors' own loader."""
    from plate_inspect.testing.synthetic import write_family

    ckpt = write_family(tmp_path / "fp8", "deepseek_v3", fp8=True)
    rec = Recorder()
    bundle = plate_inspect.scan(ckpt.path, tmp_path / "b", r=4, progress=rec)
    tensors = load_all(ckpt.path)
    want = 0
    for module in bundle.manifest.modules:  # one 2-D FP8 weight + block scales per module in this family
        weight = tensors[module + ".weight"]
        scale = tensors[module + ".weight_scale_inv"]
        want += weight.numel() * weight.element_size() + scale.numel() * scale.element_size()
    assert rec.events[-1].bytes_total == rec.events[-1].bytes_done == want


def test_cli_bar_draws_done_of_total_and_bytes(monkeypatch):
    from plate_inspect.cli import common

    buffer = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buffer, width=200, force_terminal=False))
    with common.progress_bar("scan") as show:
        show(ProgressEvent(0, 3, "modules", "", 0, 3 * 2**20))
        show(ProgressEvent(3, 3, "modules", "model.layers.0.mlp.down_proj", 3 * 2**20, 3 * 2**20))
    text = buffer.getvalue()
    assert "3/3" in text and "modules" in text and "model.layers.0.mlp.down_proj" in text
    assert "3.15 MB/3.15 MB" in text  # 3 * 2**20 bytes in decimal units
    with common.progress_bar("scan", quiet=True) as show:
        assert show is None


def test_cli_bar_stays_silent_when_an_error_comes_before_any_event(monkeypatch):
    """Off a terminal rich prints the bar when it stops: an error raised before the first event must not be
    preceded by an empty "0/?" line, while one raised midway still shows how far the work got."""
    from plate_inspect.cli import common

    buffer = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buffer, width=200, force_terminal=False))
    with pytest.raises(ValueError), common.progress_bar("scan"):
        raise ValueError("bad input")
    assert buffer.getvalue() == ""
    with pytest.raises(ValueError), common.progress_bar("scan") as show:
        show(ProgressEvent(2, 5, "modules", "model.layers.1.mlp.up_proj", None, None))
        raise ValueError("bad input")
    assert "2/5" in buffer.getvalue() and "up_proj" in buffer.getvalue()


def test_a_non_callable_progress_is_a_type_error(qwen_ckpt, tmp_path):
    with warnings.catch_warnings(), pytest.raises(TypeError, match="ProgressEvent"):
        plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=8, progress=42)
