"""The continual benchmark through the CLI: schema, budgets and measurements checked against independent oracles."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from plate_inspect.bundle import Bundle
from plate_inspect.cli.main import cli
from plate_inspect.errors import ConfigError
from plate_inspect.experiments import digits
from plate_inspect.experiments.continual import ci95, symmetric_kl, validate_records


def documented_record_keys() -> set[str]:
    """The keys of a results.json record as README.md documents them for users ("Measured per run"): the schema's
    contract, written independently of the code under test (its RECORD_KEYS)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    paragraph = text[text.index("**Measured per run**") :]
    return set(re.findall(r"`([a-z0-9_]+)`", paragraph[: paragraph.index("the symmetrised KL")]))


QUICK_METHODS = ["full_ft", "l2_init", "lora", "mica", "osf", "plate", "plate_random_q"]
BACKBONE_PARAMS = 64 * 256 + 256 + 2 * (256 * 256 + 256)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("continual")
    args = ["experiment", "continual", "--out", str(out), "--quick", "-q"]
    result = CliRunner().invoke(cli, [*args, "--methods", ",".join(QUICK_METHODS)])
    assert result.exit_code == 0, result.output
    return out, result.output


def _softmax_kl_oracle(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    total = 0.0
    for lp_row, lq_row in zip(p_logits.double().tolist(), q_logits.double().tolist(), strict=True):
        zp = sum(math.exp(v) for v in lp_row)
        zq = sum(math.exp(v) for v in lq_row)
        p = [math.exp(v) / zp for v in lp_row]
        q = [math.exp(v) / zq for v in lq_row]
        total += 0.5 * sum(a * math.log(a / b) + b * math.log(b / a) for a, b in zip(p, q, strict=True))
    return total / len(p_logits)


def test_quick_results_json_schema_and_budgets(quick_run):
    out, _ = quick_run
    data = json.loads((out / "results.json").read_text())
    assert [rec["method"] for rec in data] == QUICK_METHODS  # one record per run, in the asked order
    schema = documented_record_keys()
    for rec in data:
        assert set(rec) == schema
        assert rec["seed"] == 0 and rec["data"] == "digits" and rec["steps"] == 60 and rec["stage1_steps"] == 180
        assert rec["trainable_pct"] == pytest.approx(100.0 * rec["trainable_params"] / BACKBONE_PARAMS, rel=1e-12)
        assert all(0.0 <= rec[k] <= 1.0 for k in ("task1_acc_before", "task1_acc_after", "task2_acc"))
    by = {rec["method"]: rec for rec in data}
    assert by["full_ft"]["trainable_params"] == BACKBONE_PARAMS and by["full_ft"]["trainable_pct"] == 100.0
    assert by["l2_init"]["config"] == {"lam": 0.01}
    rank = by["lora"]["config"]["rank"]
    assert by["lora"]["config"]["alpha"] == 0.5 * rank
    assert by["lora"]["trainable_params"] == rank * (64 + 256) + 2 * rank * (256 + 256)
    assert by["mica"]["trainable_params"] == by["mica"]["config"]["rank"] * (64 + 256 + 256)
    n = by["osf"]["config"]["n_low"]
    assert by["osf"]["trainable_params"] == n * (256 + 64 + 1) + 2 * n * (256 + 256 + 1)
    cfg = by["plate"]["config"]
    bundle = Bundle.load(out / "seed0" / f"bundle_r{cfg['r']}_tau{cfg['tau']:g}")
    assert by["plate"]["trainable_params"] == sum(rec.r * rec.k for rec in bundle)
    assert by["plate_random_q"]["trainable_params"] == by["plate"]["trainable_params"]  # matched capacity
    assert (cfg["r"], cfg["tau"]) == (8, 0.98)  # the paper's ablation setting is the first PLATE budget
    assert bundle.manifest.settings.target_modules == ("fc1", "fc2", "fc3")
    assert len({rec["task1_acc_before"] for rec in data}) == 1  # one stage-1 model per seed


def test_quick_measurements_match_an_independent_recomputation(quick_run):
    """Task-1 accuracy before and the full_ft KL recomputed from the saved stage-1 checkpoint and a rerun."""
    out, _ = quick_run
    data = {rec["method"]: rec for rec in json.loads((out / "results.json").read_text())}
    task1, task2 = digits.load_digit_tasks()
    stage1 = digits.load_model(out / "seed0" / "stage1.safetensors")
    with torch.no_grad():
        before = stage1(task1.x_test, task=1)
    acc = float((before.argmax(1) == task1.y_test).double().mean())
    assert data["full_ft"]["task1_acc_before"] == pytest.approx(acc, abs=1e-6)  # float32 mean
    # rerun full_ft by hand: Adam over the backbone and head 2 for 60 steps, same seed and batch order
    model = digits.load_model(out / "seed0" / "stage1.safetensors")
    torch.manual_seed(0)
    params = [p for n, p in model.named_parameters() if n.split(".")[0] in ("fc1", "fc2", "fc3", "head2")]
    digits.train(model, params, task2, 2, steps=60, seed=0)
    with torch.no_grad():
        after = model(task1.x_test, task=1)
    assert data["full_ft"]["kl_task1"] == pytest.approx(_softmax_kl_oracle(before, after), rel=1e-6)
    assert data["full_ft"]["kl_task1"] > 0.01  # full fine-tuning for 60 steps does move task 1


def test_quick_outputs_table_and_self_contained_html(quick_run):
    out, output = quick_run
    assert "plate_random_q" in output and "± n/a" in output  # one seed: no interval, not "± 0.00"
    assert "± 0.00" not in output
    html = (out / "continual.html").read_text()
    assert 'src="https://cdn.plot.ly' not in html
    assert len(html) > 1_000_000  # plotly.js is inlined
    assert "plasticity-retention frontier" in html and "Matched-capacity ablations" in html
    summary = (out / "summary.md").read_text()
    assert "± n/a" in summary and "± 0.00" not in summary
    assert summary.startswith("## All runs") and "## Ablations at 60 steps" in summary
    lines = (out / "runs.jsonl").read_text().splitlines()
    assert len(lines) == len(QUICK_METHODS)


def test_frontier_error_bars_only_where_there_is_an_interval(quick_run):
    """One seed: no interval, so no (zero-width) error bars; two seeds: the 95% half-widths as bars."""
    from plate_inspect.experiments.continual import records_from_dir, summarize
    from plate_inspect.experiments.continual_report import frontier_figure

    out, _ = quick_run
    rows = summarize(records_from_dir(out)[0])
    steps = max(r["steps"] for r in rows)
    one = frontier_figure(rows, steps, "one seed")
    assert one.data and all(t.error_x.visible is False and t.error_y.visible is False for t in one.data)
    two = [dict(r, seeds=2) for r in rows]
    bars = frontier_figure(two, steps, "two seeds")
    assert bars.data and all(t.error_x.visible and t.error_y.visible for t in bars.data)


def test_report_only_rebuilds_from_runs_jsonl(quick_run):
    out, _ = quick_run
    (out / "results.json").unlink()
    result = CliRunner().invoke(cli, ["experiment", "continual", "--out", str(out), "--report-only"])
    assert result.exit_code == 0, result.output
    assert len(json.loads((out / "results.json").read_text())) == len(QUICK_METHODS)


def test_bad_methods_and_steps_are_one_line_errors(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(cli, ["experiment", "continual", "--out", str(tmp_path), "--methods", "lora,adapter"])
    assert bad.exit_code == 2 and "unknown method 'adapter'" in bad.output and "Traceback" not in bad.output
    bad = runner.invoke(cli, ["experiment", "continual", "--out", str(tmp_path), "--steps", "60,x"])
    assert bad.exit_code == 2 and "--steps must be comma-separated integers" in bad.output


def test_symmetric_kl_hand_computed():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5], [0.6, 0.4]], dtype=torch.float64)
    kl = symmetric_kl(p.log(), q.log())
    row2 = 0.5 * (0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4) + 0.6 * math.log(0.6 / 0.9) + 0.4 * math.log(4))
    assert kl == pytest.approx(row2 / 2, rel=1e-9)
    assert symmetric_kl(q.log(), p.log()) == pytest.approx(kl, rel=1e-12)
    assert symmetric_kl(p.log(), p.log() + 3.0) == pytest.approx(0.0, abs=1e-12)  # logits shift-invariant


def test_ci95_hand_computed():
    mean, half = ci95([1.0, 2.0, 6.0])
    # mean 3, sample std sqrt(7), t(0.975, 2) = 4.302652729911275
    assert mean == 3.0
    assert half == pytest.approx(4.302652729911275 * math.sqrt(7.0) / math.sqrt(3.0), rel=1e-9)
    assert ci95([5.0]) == (5.0, 0.0)


def test_validate_records_rejects_malformed():
    good = {
        "method": "plate",
        "budget": "r8_tau0.98",
        "config": {},
        "seed": 0,
        "data": "digits",
        "steps": 60,
        "stage1_steps": 180,
        "data_using": False,
        "trainable_params": 10,
        "trainable_pct": 1.0,
        "task1_acc_before": 0.9,
        "task1_acc_after": 0.8,
        "task2_acc": 0.7,
        "kl_task1": 0.01,
    }
    validate_records([good])
    for bad in (
        {**good, "task2_acc": 95.0},
        {**good, "method": "adapter"},
        {**good, "data": "mnist"},
        {k: good[k] for k in list(good)[:-1]},
    ):
        with pytest.raises(ConfigError):
            validate_records([bad])


# --------------------------------------------------------------------------- bad input, crashes and resuming
def _tiny(**overrides):
    """Two cheap methods, a few steps: the resume/refusal paths, not the science."""
    from plate_inspect.experiments.continual import ContinualSettings
    from plate_inspect.experiments.methods import Budget

    base = {
        "methods": ("full_ft", "lora"),
        "steps": (3,),
        "stage1_steps": 5,
        "budgets": {"lora": [Budget("r1", {"rank": 1})]},
    }
    return ContinualSettings(**{**base, **overrides})


def test_a_run_listed_twice_is_refused_not_summarised_as_two_seeds(tmp_path):
    """--steps 3,3 (or seeds [0, 0]) would run once and be counted twice: two 'seeds' with a 0-width CI."""
    from plate_inspect.experiments.continual import run_continual

    args = ["experiment", "continual", "--out", str(tmp_path / "cli"), "--methods", "full_ft"]
    bad = CliRunner().invoke(cli, [*args, "--steps", "3,3", "--stage1-steps", "5", "--seeds", "1", "-q"])
    assert bad.exit_code == 2 and "lists 3 twice" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "cli" / "runs.jsonl").exists()
    with pytest.raises(ConfigError, match="seed 0 is listed twice"):
        run_continual(tmp_path / "api", seeds=[0, 0], settings=_tiny())
    with pytest.raises(ConfigError, match=r"seeds must be integers in \[0, 2\^63\)"):
        run_continual(tmp_path / "api", seeds=[-1], settings=_tiny())
    with pytest.raises(ConfigError, match="lists lora twice"):
        run_continual(tmp_path / "api", seeds=1, settings=_tiny(methods=("lora", "lora")))


def test_a_budget_typo_is_refused_before_anything_trains(tmp_path):
    from plate_inspect.experiments.continual import run_continual
    from plate_inspect.experiments.methods import Budget

    bad = _tiny(budgets={"lora": [Budget("r4", {"rnk": 4})]})
    with pytest.raises(
        ConfigError, match=r"lora: budget 'r4' has config keys \['rnk'\]; lora needs exactly \['rank'\]"
    ):
        run_continual(tmp_path, seeds=1, settings=bad)
    assert not (tmp_path / "seed0").exists()  # refused up front, not after stage 1 (or hours of other runs)


def test_torn_last_line_of_runs_jsonl_reruns_that_run(tmp_path):
    """A crash while appending a record leaves an unterminated line: the resume drops it, reruns that one run, and
    ends with the same results as an uninterrupted run (the oracle: a run in a fresh directory)."""
    from plate_inspect.experiments.continual import run_continual

    run_continual(tmp_path / "ref", seeds=1, settings=_tiny())
    reference = json.loads((tmp_path / "ref" / "results.json").read_text())
    out = tmp_path / "torn"
    out.mkdir()
    lines = (tmp_path / "ref" / "runs.jsonl").read_text().splitlines(keepends=True)
    (out / "settings.json").write_text((tmp_path / "ref" / "settings.json").read_text())
    (out / "runs.jsonl").write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # killed mid-append
    run_continual(out, seeds=1, settings=_tiny())
    assert json.loads((out / "results.json").read_text()) == reference
    rows = (out / "runs.jsonl").read_text().splitlines()
    assert len(rows) == 2 and [json.loads(r)["method"] for r in rows] == ["full_ft", "lora"]


def test_interrupted_run_resumes_to_the_same_numbers(tmp_path):
    from plate_inspect.experiments.continual import run_continual

    run_continual(tmp_path / "ref", seeds=2, settings=_tiny())
    events = []

    def stop_after_three(event):  # Adam steps: seed 0's stage 1 (5) + 2 runs (3 each), seed 1's stage 1 + 1 run
        events.append(event)
        if event.done == 5 + 3 + 3 + 5 + 3 + 1:  # the first step of the fourth run
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_continual(tmp_path / "cut", seeds=2, settings=_tiny(), progress=stop_after_three)
    assert len((tmp_path / "cut" / "runs.jsonl").read_text().splitlines()) == 3
    resumed = []
    run_continual(tmp_path / "cut", seeds=2, settings=_tiny(), progress=resumed.append)
    # only the missing run ran (after seed 1's stage 1): 3 runs' steps done at the start, 5 + 3 more
    assert (resumed[0].done, resumed[-1].done, resumed[-1].total) == (9, 17, 17)
    assert {e.label for e in resumed[1:]} == {"seed 1: stage 1", "seed 1 steps 3: lora r1"}
    for name in ("results.json", "summary.md"):
        assert (tmp_path / "cut" / name).read_text() == (tmp_path / "ref" / name).read_text()


def test_other_settings_in_out_are_named(tmp_path):
    """A setting that changes every run (stage 1, a budget) is refused by name, with what to do, in one line."""
    runner = CliRunner()
    args = ["experiment", "continual", "--out", str(tmp_path), "--methods", "full_ft", "--stage1-steps", "5", "-q"]
    assert runner.invoke(cli, [*args, "--steps", "3", "--seeds", "1"]).exit_code == 0
    quick = ["experiment", "continual", "--out", str(tmp_path / "q"), "--methods", "lora", "--stage1-steps", "5", "-q"]
    assert runner.invoke(cli, [*quick, "--steps", "3", "--quick"]).exit_code == 0
    before = [(tmp_path / d / "runs.jsonl").read_bytes() for d in (".", "q")]
    for bad, named in (
        ([*args, "--stage1-steps", "6", "--steps", "3,4"], "stage1_steps (--stage1-steps): 5 -> 6"),
        (
            [*quick, "--steps", "3,4", "--seeds", "1"],
            "budgets of lora: r1 -> r1, r8, r32 (--quick runs each method's first budget only)",
        ),
    ):
        again = runner.invoke(cli, bad)
        assert again.exit_code == 2 and named in again.output and "Traceback" not in again.output, again.output
        assert "rerun with its settings to resume or add runs" in again.output
        assert len(again.output.strip().splitlines()) == 1
    assert [(tmp_path / d / "runs.jsonl").read_bytes() for d in (".", "q")] == before  # nothing ran
    more = runner.invoke(cli, [*args, "--steps", "3", "--seeds", "2"])  # more seeds: same settings, it resumes
    assert more.exit_code == 0, more.output
    assert sorted({r["seed"] for r in json.loads((tmp_path / "results.json").read_text())}) == [0, 1]


def test_unwritable_output_is_a_one_line_error_and_keeps_finished_runs(tmp_path):
    """A file where the run must write (seed directory; results.json) is a one-line error, not a traceback."""
    runner = CliRunner()
    args = ["experiment", "continual", "--out", str(tmp_path), "--methods", "full_ft", "--stage1-steps", "5", "-q"]
    (tmp_path / "seed0").write_text("in the way")
    bad = runner.invoke(cli, [*args, "--steps", "3", "--seeds", "1"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output, bad.output
    assert "seed0 is a file, not a directory" in bad.output and "choose another --out" in bad.output
    (tmp_path / "seed0").unlink()
    (tmp_path / "results.json").mkdir()  # the last write fails after every run finished
    bad = runner.invoke(cli, [*args, "--steps", "3", "--seeds", "1"])
    assert bad.exit_code == 2 and f"{tmp_path / 'results.json'}: cannot write" in bad.output, bad.output
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 1  # the finished run is kept


def test_missing_fashion_mnist_names_the_flag_and_leaves_out_alone(tmp_path):
    out = tmp_path / "out"
    args = ["experiment", "continual", "--out", str(out), "--data", "fashion-mnist", "--data-root", str(tmp_path)]
    bad = CliRunner().invoke(cli, [*args, "--quick"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "--data-root" in bad.output and "apt-get install dataset-fashion-mnist" in bad.output
    assert not out.exists()  # refused before anything is written


def test_quick_keeps_the_options_given_on_the_command_line(tmp_path):
    args = ["experiment", "continual", "--out", str(tmp_path), "--quick", "--methods", "full_ft,lora", "-q"]
    result = CliRunner().invoke(cli, [*args, "--seeds", "2", "--stage1-steps", "5", "--steps", "3"])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "results.json").read_text())
    assert sorted({r["seed"] for r in data}) == [0, 1]
    assert {(r["steps"], r["stage1_steps"]) for r in data} == {(3, 5)}
    assert {r["budget"] for r in data} == {"all", "r1"}  # still --quick's one budget per method


def test_report_only_on_a_broken_directory_is_a_one_line_error(tmp_path):
    runner = CliRunner()
    record = {
        "method": "full_ft",
        "budget": "all",
        "config": {},
        "seed": 0,
        "data": "digits",
        "steps": 3,
        "stage1_steps": 5,
        "data_using": False,
        "trainable_params": BACKBONE_PARAMS,
        "trainable_pct": 100.0,
        "task1_acc_before": 0.9,
        "task1_acc_after": 0.8,
        "task2_acc": 0.7,
        "kl_task1": 0.1,
    }
    (tmp_path / "runs.jsonl").write_text(json.dumps(record) + "\n")
    args = ["experiment", "continual", "--out", str(tmp_path), "--report-only"]
    bad = runner.invoke(cli, args)  # settings.json missing
    assert bad.exit_code == 2 and "settings.json: missing or unreadable" in bad.output and "Traceback" not in bad.output
    (tmp_path / "settings.json").write_text(json.dumps({"methods": ["full_ft"], "steps": [3], "budgets": {}}))
    (tmp_path / "runs.jsonl").write_text("{not json\n" + json.dumps(record) + "\n")
    bad = runner.invoke(cli, args)
    assert bad.exit_code == 2 and "runs.jsonl: line 1 is not a run record" in bad.output, bad.output


def test_trainable_column_agrees_with_the_percent_column_across_seeds():
    """PLATE's k, hence its trainable count, comes from each seed's weights: the tables showed the first seed's count
    next to the mean %, which disagree; they show the range over seeds (and one number where it is fixed)."""
    from plate_inspect.experiments.continual import RunRecord, summarize
    from plate_inspect.experiments.continual_report import ablation_rows, markdown_table

    def rec(method, seed, n):
        return RunRecord(method, "r8_tau0.98", {}, seed, "digits", 60, 180, False, n, 100 * n / BACKBONE_PARAMS,
                         0.99, 0.98, 0.9, 0.01)  # fmt: skip

    rows = summarize([rec("plate", 0, 1464), rec("plate", 1, 1432), rec("plate_random_q", 0, 1464)])
    plate = next(r for r in rows if r["method"] == "plate")
    assert plate["trainable_pct"] == pytest.approx(100 * (1464 + 1432) / 2 / BACKBONE_PARAMS)
    table = markdown_table(rows)
    assert "| plate | r8_tau0.98 | 1,432-1,464 | 0.98 |" in table  # (1464 + 1432) / 2 / 148224 = 0.98%
    assert "| plate_random_q | r8_tau0.98 | 1,464 | 0.99 |" in table  # one seed: its own count, 0.99%
    assert [c[2] for c in ablation_rows(rows, 60)] == ["1,432-1,464", "1,464"]


def test_report_only_reports_the_named_runs_and_refuses_what_it_cannot_honour(tmp_path):
    """--report-only used to ignore --methods/--steps/--seeds (a report of everything) and every training option;
    now they select runs (the oracle: runs.jsonl filtered by hand), a name with no finished run is one error line
    naming what finished, and options that only shape training are refused by name."""
    from plate_inspect.experiments.continual import run_continual

    run_continual(tmp_path, seeds=2, settings=_tiny(steps=(3, 4)))
    lines = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(lines) == 8
    runner = CliRunner()
    args = ["experiment", "continual", "--out", str(tmp_path), "--report-only"]

    def reported(*extra):
        result = runner.invoke(cli, [*args, *extra])
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / "results.json").read_text())

    assert reported("--methods", "lora") == [r for r in lines if r["method"] == "lora"]
    assert reported("--methods", "lora", "--steps", "4", "--seeds", "1") == [
        r for r in lines if (r["method"], r["steps"], r["seed"]) == ("lora", 4, 0)
    ]
    assert reported("--data", "digits", "--stage1-steps", "5") == lines  # OUT's own settings: accepted
    for extra, message in (
        (["--methods", "osf,lora"], "has no finished run of method osf (--methods); finished: full_ft, lora"),
        (["--steps", "9"], "has no finished run of stage-2 step count 9 (--steps); finished: 3, 4"),
        (["--seeds", "3"], "has no finished run of seed 2 (--seeds); finished: 0, 1"),
        (["--quick"], "--report-only trains nothing, so --quick cannot apply"),
        (["--data-root", str(tmp_path)], "so --data-root cannot apply"),
        (["--stage1-steps", "6"], "its runs were made with --stage1-steps 5, not 6"),
        (["--data", "fashion-mnist"], "its runs were made with --data digits, not fashion-mnist"),
    ):
        bad = runner.invoke(cli, [*args, *extra])
        assert bad.exit_code == 2 and message in bad.output and "Traceback" not in bad.output, (extra, bad.output)
        assert len(bad.output.strip().splitlines()) == 1
    assert (tmp_path / "runs.jsonl").read_text().count("\n") == 8  # a report never touches the finished runs
    assert reported() == lines


def test_data_root_with_digits_is_refused_not_ignored(tmp_path):
    """digits read no files: --data-root there used to be silently ignored (a user believing their files ran)."""
    from plate_inspect.experiments.continual import run_continual
    from plate_inspect.experiments.sequential_tasks import run_sequential

    runner = CliRunner()
    small = {"continual": ["--stage1-steps", "2"], "sequential": []}  # without the check: a short run, not hours
    for command in ("continual", "sequential"):
        out = tmp_path / command
        args = ["experiment", command, "--out", str(out), "--methods", "lora", "--seeds", "1", "--steps", "2"]
        bad = runner.invoke(cli, [*args, *small[command], "--data-root", str(tmp_path), "-q"])
        assert bad.exit_code == 2 and "Traceback" not in bad.output, bad.output
        assert "--data-root applies to fashion-mnist only" in bad.output and not out.exists()
    with pytest.raises(ConfigError, match="--data-root applies to fashion-mnist only"):
        run_continual(tmp_path / "api", seeds=1, settings=_tiny(data_root=str(tmp_path)))
    with pytest.raises(ConfigError, match="applies to fashion-mnist only"):
        run_sequential(tmp_path / "api", ["lora"], seeds=1, steps=2, data_root=tmp_path)
    assert not (tmp_path / "api").exists()


def test_frontier_error_bars_are_per_point():
    """One budget with one seed used to hide the bars of every budget of that method; now each point has its own
    bar, none (null) only where that point has one seed. Oracle: the Student-t half-width of two values by hand,
    t(0.975, 1) * |a - b| / 2."""
    from plate_inspect.experiments.continual import RunRecord, summarize
    from plate_inspect.experiments.continual_report import frontier_figure, sensitivity_figure

    def rec(budget, seed, n, after, task2, steps=60):
        return RunRecord("plate", budget, {}, seed, "digits", steps, 180, False, n, 100 * n / BACKBONE_PARAMS,
                         0.99, after, task2, 0.01)  # fmt: skip

    records = [rec("small", 0, 1464, 0.97, 0.80), rec("small", 1, 1464, 0.95, 0.90), rec("big", 0, 10336, 0.9, 0.95)]
    t975 = 12.7062047361747  # Student t quantile, 1 degree of freedom
    fig = frontier_figure(summarize(records), 60, "mixed").to_dict()
    (trace,) = fig["data"]
    assert trace["text"] == ["small", "big"]  # ordered by size
    assert trace["error_x"]["array"][0] == pytest.approx(t975 * 2.0 / 2, rel=1e-9)  # forgetting 2 and 4 points
    assert trace["error_y"]["array"][0] == pytest.approx(t975 * 10.0 / 2, rel=1e-9)  # task-2 80% and 90%
    assert trace["error_x"]["array"][1] is None and trace["error_y"]["array"][1] is None  # one seed: no bar
    assert trace["error_x"]["visible"] is True and trace["error_y"]["visible"] is True
    steps = [*records, *(rec(b, s, n, a, t, steps=300) for b, s, n, a, t in [("small", 0, 1464, 0.9, 0.8)])]
    sens = sensitivity_figure(summarize(steps), "mixed").to_dict()
    small = next(t for t in sens["data"] if t["name"] == "plate small")
    assert small["x"] == [60, 300] and small["error_y"]["array"][1] is None
    assert small["error_y"]["array"][0] == pytest.approx(t975 * 2.0 / 2, rel=1e-9)


def test_an_impossible_seed_count_is_one_error_line_not_a_memory_error(tmp_path):
    """--seeds 99999999999 (a typo) used to build a list of 10^11 seeds: MemoryError and a traceback."""
    from plate_inspect.experiments.sequential_tasks import run_sequential

    runner = CliRunner()
    for command, extra in (("continual", ["--methods", "lora", "--quick"]), ("sequential", ["--methods", "lora"])):
        out = tmp_path / command
        bad = runner.invoke(cli, ["experiment", command, "--out", str(out), *extra, "--seeds", "99999999999", "-q"])
        assert bad.exit_code == 2 and "Traceback" not in bad.output, bad.output
        assert "--seeds) 99,999,999,999 is more than 10,000" in bad.output and not out.exists()
    with pytest.raises(ConfigError, match=r"seeds must be integers in \[0, 2\^63\), got 9223372036854775808"):
        run_sequential(tmp_path / "api", ["lora"], seeds=[2**63], steps=2)


def test_methods_can_be_added_to_a_finished_run(tmp_path):
    """Each method's runs start from the same stage-1 model and are independent: adding one to an OUT used to be
    refused as "other settings" (so it could never share a report); now it runs only the new method (its record is
    the one a fresh directory gives) and keeps the rest, while another budget for a method already run is refused."""
    from plate_inspect.experiments.continual import run_continual
    from plate_inspect.experiments.methods import Budget

    mica = {"mica": [Budget("r1", {"rank": 1})]}
    run_continual(tmp_path / "fresh", seeds=1, settings=_tiny(methods=("mica",), budgets=mica))
    fresh = json.loads((tmp_path / "fresh" / "results.json").read_text())
    out = tmp_path / "out"
    first = run_continual(out, seeds=1, settings=_tiny())
    events = []
    more = _tiny(methods=("lora", "mica"), budgets={**_tiny().budgets, **mica})
    run_continual(out, seeds=1, settings=more, progress=events.append)
    assert (events[0].done, events[-1].done) == (3, 3 + 5 + 3)  # lora's 3 steps kept; stage 1 and mica ran
    assert {e.label for e in events[1:]} == {"seed 0: stage 1", "seed 0 steps 3: mica r1"}
    data = json.loads((out / "results.json").read_text())
    assert (
        data == [r for r in json.loads(json.dumps([vars(x) for x in first.records])) if r["method"] == "lora"] + fresh
    )
    assert json.loads((out / "settings.json").read_text())["methods"] == ["full_ft", "lora", "mica"]
    with pytest.raises(ConfigError, match=r"other settings \(budgets of lora: r1 -> r2\); rerun"):
        run_continual(out, seeds=1, settings=_tiny(budgets={"lora": [Budget("r2", {"rank": 2})]}))
    result = CliRunner().invoke(cli, ["experiment", "continual", "--out", str(out), "--report-only"])
    assert result.exit_code == 0, result.output
    assert [r["method"] for r in json.loads((out / "results.json").read_text())] == ["full_ft", "lora", "mica"]


def test_steps_can_be_added_to_a_finished_run(tmp_path):
    """More --steps values into a finished OUT used to be refused ("steps: [3] -> [3, 4]"); each (method, steps) run
    starts from the same stage-1 model on its own, so now only the new runs train, the finished ones are kept byte
    for byte, and the report lists both. Oracle: the steps-4 runs of a fresh OUT."""
    runner = CliRunner()

    def run(out, steps, *extra):
        args = ["experiment", "continual", "--out", str(out), "--methods", "full_ft,lora", "--stage1-steps", "5"]
        result = runner.invoke(cli, [*args, "--seeds", "1", "--steps", steps, "-q", *extra])
        assert result.exit_code == 0, result.output
        return result.output, json.loads((out / "results.json").read_text())

    _, fresh = run(tmp_path / "fresh", "4")
    out = tmp_path / "out"
    _, first = run(out, "3")
    finished = (out / "runs.jsonl").read_bytes()
    assert [r["steps"] for r in first] == [3] * 4  # full_ft + lora's three budgets
    _, both = run(out, "3,4")
    assert both == first + fresh
    runs = (out / "runs.jsonl").read_bytes()
    assert runs.startswith(finished) and runs.count(b"\n") == 8  # the finished runs untouched, 4 new ones after them
    assert json.loads((out / "settings.json").read_text())["steps"] == [3, 4]
    all_runs, sensitivity = (out / "summary.md").read_text().split("## Stage-2 step sensitivity")
    rows = [line.split(" | ")[:3] for line in all_runs.splitlines() if line.startswith("| 4 |")]
    assert rows == [["| 4", "full_ft", "all"], ["| 4", "lora", "r1"], ["| 4", "lora", "r8"], ["| 4", "lora", "r32"]]
    output, alone = run(out, "4")  # a report of the runs the command names, with a note about the others
    assert alone == fresh and (out / "runs.jsonl").read_bytes() == runs
    assert "also holds 4 finished runs of other --methods, --steps or --seeds" in output
    again = runner.invoke(cli, ["experiment", "continual", "--out", str(out), "--report-only"])
    assert again.exit_code == 0 and json.loads((out / "results.json").read_text()) == first + fresh


def test_runs_are_not_added_to_an_out_whose_stage_one_does_not_reproduce(tmp_path, monkeypatch):
    """Added runs retrain the seed's stage 1: were it another model (another torch or machine), old and new runs would
    be compared across two models in silence. A stage 1 that differs (planted: fc1 zeroed) is refused; nothing runs."""
    from plate_inspect.experiments import continual

    continual.run_continual(tmp_path, seeds=1, settings=_tiny())
    before = (tmp_path / "runs.jsonl").read_bytes()
    checkpoint = (tmp_path / "seed0" / "stage1.safetensors").read_bytes()
    train_stage1 = digits.train_stage1

    def another_model(*args, **kwargs):
        model = train_stage1(*args, **kwargs)
        with torch.no_grad():
            model.fc1.weight.zero_()
        return model

    monkeypatch.setattr(continual.digits, "train_stage1", another_model)
    with pytest.raises(ConfigError, match="stage 1 of seed 0 does not reproduce"):
        continual.run_continual(tmp_path, seeds=1, settings=_tiny(steps=(3, 4)))
    assert (tmp_path / "runs.jsonl").read_bytes() == before
    assert (tmp_path / "seed0" / "stage1.safetensors").read_bytes() == checkpoint  # their stage-1 model is kept


def test_one_out_holds_one_experiment(tmp_path):
    """continual and sequential both write OUT/seed<N>/: pointed at the other's OUT they used to mix their files in
    silence; each now refuses it in one line before writing anything."""
    runner = CliRunner()
    seq = tmp_path / "seq"
    args = ["experiment", "sequential", "--out", str(seq), "--methods", "lora", "--seeds", "1", "--steps", "2", "-q"]
    assert runner.invoke(cli, args).exit_code == 0
    before = sorted(p.relative_to(seq) for p in seq.rglob("*"))
    for extra in (["--methods", "lora", "--seeds", "1", "--steps", "2", "--stage1-steps", "2"], ["--report-only"]):
        bad = runner.invoke(cli, ["experiment", "continual", "--out", str(seq), *extra, "-q"])
        assert bad.exit_code == 2 and "Traceback" not in bad.output, bad.output
        assert "holds `experiment sequential` runs (sequential.json); give `experiment continual` its own --out" in (
            bad.output
        )
    assert sorted(p.relative_to(seq) for p in seq.rglob("*")) == before
    cont = tmp_path / "cont"
    args = ["experiment", "continual", "--out", str(cont), "--methods", "lora", "--seeds", "1", "--steps", "2"]
    assert runner.invoke(cli, [*args, "--stage1-steps", "2", "-q"]).exit_code == 0
    bad = runner.invoke(cli, ["experiment", "sequential", "--out", str(cont), "--methods", "lora", "--steps", "2"])
    assert bad.exit_code == 2 and "holds `experiment continual` runs (runs.jsonl)" in bad.output, bad.output
    assert not (cont / "sequential.json").exists() and not (cont / "seed0" / "lora").exists()


def test_sequential_quick_is_a_smoke_run_keeping_the_options_given(tmp_path):
    """experiment sequential had no --quick (continual has): a new user's first run was 3 seeds x 950 steps."""
    runner = CliRunner()
    args = ["experiment", "sequential", "--out", str(tmp_path / "a"), "--quick", "--methods", "lora", "-q"]
    assert runner.invoke(cli, args).exit_code == 0
    written = json.loads((tmp_path / "a" / "sequential.json").read_text())
    assert written["settings"]["steps"] == 60 and {r["seed"] for r in written["records"]} == {0}
    args = ["experiment", "sequential", "--out", str(tmp_path / "b"), "--quick", "--methods", "lora", "-q"]
    assert runner.invoke(cli, [*args, "--seeds", "2", "--steps", "3"]).exit_code == 0
    written = json.loads((tmp_path / "b" / "sequential.json").read_text())
    assert written["settings"]["steps"] == 3 and {r["seed"] for r in written["records"]} == {0, 1}


def test_an_empty_out_or_methods_is_refused_not_read_as_a_default(tmp_path, monkeypatch):
    """--out "" (an unset shell variable) used to write the runs into the current directory, and continual's
    --methods "" ran every method (a comma alone was refused); both are one line now and nothing is written."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    small = ["--seeds", "1", "--steps", "1", "-q"]
    for command, extra in (
        ("continual", ["--methods", "lora", "--stage1-steps", "1"]),
        ("sequential", ["--methods", "lora"]),
    ):
        bad = runner.invoke(cli, ["experiment", command, "--out", "", *extra, *small])
        assert bad.exit_code == 2 and "an empty value ('') after --out" in bad.output, bad.output  # cli/main.py's rule
        bad = runner.invoke(cli, ["experiment", command, "--out", str(tmp_path / "out"), "--methods", "", *small])
        assert bad.exit_code == 2 and "an empty value ('') after --methods" in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_absurd_step_counts_and_repeated_methods_are_refused_in_one_line(tmp_path):
    """--steps 10^23 used to train for ever (no cap, no bar under -q); --methods lora,lora was silently run once
    while --steps 3,3 was refused. One rule now: a value listed twice is refused, for --methods as for --steps and
    seeds; a step count above 1,000,000 (~400x the paper's 2,400 per task) is refused before anything runs."""
    from plate_inspect.experiments.continual import MAX_STEPS, ContinualSettings

    assert MAX_STEPS == 1_000_000
    runner = CliRunner()
    out = tmp_path / "out"
    small = ["--out", str(out), "--seeds", "1", "-q"]
    for command, extra, message in (
        ("continual", ["--methods", "lora", "--steps", "9" * 23], "(--steps) 99,999,999,999,999,999,999,999 is more"),
        ("continual", ["--methods", "lora", "--steps", "3", "--stage1-steps", "1000001"], "(--stage1-steps) 1,000,001"),
        ("sequential", ["--methods", "lora", "--steps", "1000001"], "(--steps) 1,000,001 is more than 1,000,000"),
        ("continual", ["--methods", "lora,full_ft,lora", "--steps", "3"], "--methods lists lora twice"),
        ("sequential", ["--methods", "lora,lora", "--steps", "3"], "--methods lists lora twice"),
    ):
        bad = runner.invoke(cli, ["experiment", command, *small, *extra])
        assert bad.exit_code == 2 and message in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1 and "Traceback" not in bad.output
    assert not out.exists()
    with pytest.raises(ConfigError, match="1,000,001 is more than 1,000,000"):
        ContinualSettings(steps=(3, MAX_STEPS + 1)).validate()
    ContinualSettings(steps=(MAX_STEPS,), stage1_steps=MAX_STEPS).validate()  # the cap itself is allowed


def test_report_only_rebuilds_a_directory_that_keeps_only_results_json(tmp_path):
    """docs/arena/steps keeps results.json and settings.json, no runs.jsonl: --report-only used to refuse it. It
    now rebuilds the report from results.json. Oracle: the published summary.md, written by the original run from
    its runs.jsonl; results.json must come back byte for byte. What would overwrite results.json, the only copy of
    the runs (a report of part of them, a run into that OUT), is refused in one line."""
    import shutil
    from pathlib import Path

    published = Path(__file__).resolve().parents[2] / "docs" / "arena" / "steps"
    out = tmp_path / "steps"
    out.mkdir()
    for name in ("results.json", "settings.json"):
        shutil.copyfile(published / name, out / name)
    runner = CliRunner()
    result = runner.invoke(cli, ["experiment", "continual", "--out", str(out), "--report-only"])
    assert result.exit_code == 0, result.output
    assert (out / "results.json").read_bytes() == (published / "results.json").read_bytes()
    assert (out / "summary.md").read_text() == (published / "summary.md").read_text()
    assert (out / "continual.html").stat().st_size > 1_000_000 and not (out / "runs.jsonl").exists()
    for extra, message in (
        (["--report-only", "--methods", "lora"], "results.json is its only record of the runs"),
        (["--methods", "lora", "--steps", "3", "--stage1-steps", "2", "--seeds", "1", "-q"], "no runs.jsonl, so"),
    ):
        bad = runner.invoke(cli, ["experiment", "continual", "--out", str(out), *extra])
        assert bad.exit_code == 2 and message in bad.output and "Traceback" not in bad.output, bad.output
        assert (out / "results.json").read_bytes() == (published / "results.json").read_bytes()
        kept = ["continual.html", "results.json", "settings.json", "summary.md"]
        assert sorted(p.name for p in out.iterdir()) == kept  # no runs.jsonl, stage 1 or seed directory
