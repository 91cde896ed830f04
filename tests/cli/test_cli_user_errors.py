"""User mistakes: one `error:` line and exit 2 (no traceback), nothing written; modes, counts, notes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_cli import assert_user_error, mount_tmpfs, run_cli

from plate_inspect import scan
from plate_inspect.cli.main import cli
from plate_inspect.formatting import counted


@pytest.fixture
def afile(tmp_path):
    path = tmp_path / "afile"
    path.write_text("x")
    return path


def _partials(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if "partial" in p.name]


# --------------------------------------------------------------------------- bug 1: merge --rescan onto a bundle
def test_merge_rescan_refuses_an_existing_bundle_without_overwrite(setup, tmp_path):
    root, model, bundle, adapter = setup
    manifest = (bundle.path / "manifest.json").read_bytes()
    for target in (bundle.path, tmp_path / "other"):  # the adapter's own bundle, and another one
        if target != bundle.path:
            scan(model, target, r=4, tau=0.9, max_rank=64)
        before = (target / "manifest.json").read_bytes()
        out = tmp_path / "merged"
        assert_user_error(["merge", model, adapter, "-o", out, "--rescan", target], str(target), "--overwrite")
        assert not out.exists() and (target / "manifest.json").read_bytes() == before
    assert (bundle.path / "manifest.json").read_bytes() == manifest
    code, output = run_cli(
        "merge", model, adapter, "-o", tmp_path / "m2", "--rescan", tmp_path / "other", "--overwrite"
    )
    assert code == 0, output


# --------------------------------------------------------------------------- bug 2: tracebacks -> one line
@pytest.mark.parametrize(
    "args",
    [
        ["scan", "{model}", "--target-modules", "[", "--out", "{tmp}/b"],
        ["audit", "{model}", "{model}", "--target-modules", "("],
        ["align", "--target-modules", "["],
    ],
)
def test_invalid_target_regex(setup, tmp_path, args):
    _, model, _, _ = setup
    args = [a.format(model=model, tmp=tmp_path) for a in args]
    assert_user_error(args, "--target-modules", "not a valid regular expression")
    assert not (tmp_path / "b").exists()


def test_out_under_or_at_a_file(setup, afile):
    _, _, bundle, _ = setup
    assert_user_error(["plan", bundle.path, "--budget", "1%", "-o", afile / "x.json"], "is a file", "-o")
    assert_user_error(["plan", bundle.path, "--budget", "1%", "-o", afile.parent], "is a directory")
    assert_user_error(["experiment", "continual", "--out", afile, "--quick", "--no-progress"], "is a file", "--out")
    assert_user_error(["experiment", "sequential", "--out", afile / "x", "--no-progress"], "is a file", "--out")
    assert_user_error(["curvature", "--out", afile, "-q"], "is a file", "--out")


def test_merge_onto_read_only_and_full_disk(setup, tmp_path, mounts):
    _, model, _, adapter = setup
    ro, full = tmp_path / "ro", tmp_path / "full"
    if not (mount_tmpfs(ro, "ro,size=64k") and mount_tmpfs(full, "size=64k")):
        pytest.skip("needs tmpfs mounts (root with mount permission)")
    mounts.extend([ro, full])
    assert_user_error(["merge", model, adapter, "-o", ro / "merged"], "cannot write the merged checkpoint", "--out")
    assert list(ro.iterdir()) == []
    # the merged file (~220 KB) does not fit in 64 KiB: safetensors' SafetensorError, not an OSError
    assert_user_error(["merge", model, adapter, "-o", full / "merged"], "disk full")
    assert list(full.iterdir()) == []


def test_merge_write_errors_without_mounts(setup, tmp_path, monkeypatch):
    """The same two failures, simulated: OSError from the temp dir, SafetensorError from save_file."""
    from safetensors import SafetensorError

    import plate_inspect.train.sequential as seq

    _, model, _, adapter = setup

    def readonly(parent, name):
        raise OSError(30, "Read-only file system", str(parent))

    monkeypatch.setattr(seq, "make_temp_dir", readonly)
    assert_user_error(["merge", model, adapter, "-o", tmp_path / "m"], "Read-only file system")
    monkeypatch.undo()

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(seq, "save_file", full)
    assert_user_error(["merge", model, adapter, "-o", tmp_path / "m"], "disk full")
    assert not (tmp_path / "m").exists() and _partials(tmp_path) == []


@pytest.mark.parametrize("command", ["scan", "audit"])
def test_sketch_dim_larger_than_d_in(setup, tmp_path, command):
    """The bound given is the smallest d_in of all targets (it named the first failing module's, down_proj's 176,
    and --sketch-dim 176 then failed on gate_proj's 64); following it works. One target: that module's own."""
    _, model, bundle, _ = setup
    smallest = min(bundle.record(name).shape[1] for name in bundle.modules)
    assert smallest == 64 and bundle.record("model.layers.0.mlp.down_proj").shape[1] == 176
    args = ["scan", model, "--out", tmp_path / "b", "-q"] if command == "scan" else ["audit", model, model, "-q"]
    for too_big in ("100000000", "176"):
        assert_user_error(
            [*args, "--sketch-dim", too_big],
            f"sketch dim {too_big} is larger than d_in=64, the smallest input dimension of the 14 target modules "
            "(module 'model.layers.0.mlp.gate_proj'); use --sketch-dim 64 or less",
        )
        assert not (tmp_path / "b").exists()  # refused when the scan is planned, before --out is made
    code, output = run_cli(*args, "--sketch-dim", "64")
    assert code == 0 and "error" not in output, output
    one = [*args, "--target-modules", "down_proj", "--layers", "1", "--sketch-dim", "177"]
    if command == "scan":
        one[3] = tmp_path / "b1"
    assert_user_error(
        one, "larger than the input dimension d_in=176 of the target module 'model.layers.1.mlp.down_proj'"
    )


# --------------------------------------------------------------------------- bug 3: merged files' mode
def test_merge_gives_the_umask_mode(setup, tmp_path):
    _, model, _, adapter = setup
    old = os.umask(0o027)
    try:
        code, output = run_cli("merge", model, adapter, "-o", tmp_path / "merged")
    finally:
        os.umask(old)
    assert code == 0, output
    out = tmp_path / "merged"
    assert stat.S_IMODE(out.stat().st_mode) == 0o750  # mkdtemp: 0o700
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f.name  # save_file: 0o600


# --------------------------------------------------------------------------- bug 4: curvature counts
@pytest.mark.parametrize("option", ["--probes", "--epochs", "--lora-rank", "--r", "--max-rank"])
def test_curvature_counts_must_be_positive(option):
    assert_user_error(["curvature", option, "0", "--json"], option, "positive")


# --------------------------------------------------------------------------- bug 5: align without a tokenizer
def test_align_refuses_a_model_dir_without_tokenizer_files(setup, tiny_bert):
    _, model, _, _ = setup
    for path in (tiny_bert, model):
        assert_user_error(["align", path, "-q"], str(path), "no tokenizer files", "tokenizer.json")


def test_align_refuses_missing_weights(tiny_bert, tmp_path, minilm_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "bert"
    shutil.copytree(tiny_bert, path)
    shutil.copy(minilm_dir / "vocab.txt", path / "vocab.txt")
    tensors = load_file(str(path / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("attention.self.query.weight"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert_user_error(["align", path, "-q"], str(path), "lacks 1 weight", name.removeprefix("bert."), "randomly")


# --------------------------------------------------------------------------- bug 6: small ones
def test_counted():
    assert [counted(n, "module") for n in (0, 1, 2, 1234)] == ["0 modules", "1 module", "2 modules", "1,234 modules"]
    assert counted(1, "problem") == "1 problem" and counted(3, "entry", "entries") == "3 entries"


def test_merge_output_counts_files_in_words(setup, tmp_path):
    _, model, _, adapter = setup
    code, output = run_cli("merge", model, adapter, "-o", tmp_path / "m")
    assert code == 0 and "merged 14 modules into 1 file in" in output, output


def test_sequential_methods_lists_only_its_own():
    out = assert_user_error(["experiment", "sequential", "--out", "x", "--methods", "foo"], "'foo'", "plate, lora, osf")
    assert "full_ft" not in out


def test_interrupt_note_only_where_work_resumes(setup, tmp_path, monkeypatch):
    import plate_inspect.auditing
    import plate_inspect.cli.scan

    _, model, _, _ = setup

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plate_inspect.auditing, "audit", interrupted)
    monkeypatch.setattr(plate_inspect.cli.scan, "run_scan", interrupted)
    code, output = run_cli("audit", model, model)
    assert code == 130 and "interrupted" in output and "resume" not in output and "saved" not in output, output
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "-q")
    assert code == 130 and "rerun the same command to resume" in output, output


def test_plan_huge_budget_is_printed_compactly(setup, tmp_path):
    _, _, bundle, _ = setup
    result = CliRunner().invoke(cli, ["plan", str(bundle.path), "--budget", "1e30", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    assert "budget 1.000e+30 parameters" in result.output and "1,000,000,000,000" not in result.output
    assert json.loads((tmp_path / "p.json").read_text())["budget"]["params"] == 10**30  # the count written (exact)


# --------------------------------------------------------------------------- rough edges of the second pass
def test_layers_out_of_range_names_the_layers_there(setup, tmp_path):
    _, model, _, _ = setup
    assert_user_error(["scan", model, "--out", tmp_path / "b", "--layers", "5", "-q"], "layers [5]", "its layers: 0-1")


def test_devices_and_a_device_together_are_refused(setup, tmp_path):
    _, model, _, _ = setup
    args = ["scan", model, "--out", tmp_path / "b", "-q", "--devices", "cpu,cpu", "--device", "cuda"]
    assert_user_error(args, "either --devices", "not both")
    assert not (tmp_path / "b").exists()


def test_report_labels_must_differ(setup, tmp_path):
    _, _, bundle, _ = setup
    args = ["report", bundle.path, bundle.path, "--labels", "a,a", "-o", tmp_path / "r.html"]
    assert_user_error(args, "'a' is given twice")


# --------------------------------------------------------------------------- the CLI speaks in flags
def test_cli_messages_name_flags_where_the_api_names_keywords(setup, tmp_path):
    """The same refusal: the Python API says overwrite=True (CLI: --overwrite), the CLI says --overwrite only."""
    from plate_inspect.errors import BundleError, cli_text

    root, model, bundle, _ = setup
    with pytest.raises(BundleError, match=r"overwrite=True \(CLI: --overwrite\)") as info:
        scan(model, bundle.path, r=5, tau=0.9, max_rank=64)
    code, output = run_cli("scan", model, "--out", bundle.path, "--r", "5", "--max-rank", "64", "-q")
    assert code == 2 and "--overwrite" in output and "overwrite=True" not in output and "CLI:" not in output
    assert cli_text(str(info.value)) in " ".join(output.split())  # the API's message, in the CLI's words
    assert cli_text("pass overwrite=True (CLI: --overwrite); or elsewhere (CLI: --out)") == (
        "pass --overwrite; or elsewhere (--out)"
    )


# --------------------------------------------------------------------------- --out that holds a model or a bundle
def test_scan_into_a_checkpoint_directory_deletes_nothing(setup, tmp_path):
    """QA: `scan M --out M --overwrite` deleted M's model.safetensors. A directory with safetensors files that are
    not bundle parts is refused, with or without --overwrite, and every file stays byte-identical."""
    import shutil

    root, model, _, _ = setup
    copy = tmp_path / "model"
    shutil.copytree(model, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    for extra in ([], ["--overwrite"]):
        assert_user_error(["scan", copy, "--out", copy, "--r", "4", *extra], "not parts of a PLATE bundle", "--out")
        assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    # a bundle directory with a stray model file beside its parts: refused as well (the file is not the bundle's)
    out = tmp_path / "bundle"
    scan(model, out, r=4, tau=0.9, max_rank=64)
    shutil.copy(model / "model.safetensors", out / "model.safetensors")
    assert_user_error(["scan", model, "--out", out, "--r", "4", "--overwrite"], "(model.safetensors)")
    assert (out / "model.safetensors").exists() and (out / "layer-00000.safetensors").exists()


def test_merge_into_a_bundle_directory_is_refused(setup, tmp_path):
    """QA: merge --overwrite into a bundle dir deleted its parts and left its manifest ("complete", parts missing)."""
    import shutil

    root, model, bundle, adapter = setup
    target = tmp_path / "bundle"
    shutil.copytree(bundle.path, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    for extra in ([], ["--overwrite"]):
        assert_user_error(["merge", model, adapter, "-o", target, *extra], "holds a PLATE bundle", "--out")
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before


# --------------------------------------------------------------------------- rough edges of the third pass
@pytest.mark.parametrize("flag", ["-q", "--quiet"])
def test_merge_quiet_draws_no_progress_bar_like_scan(setup, tmp_path, flag):
    """`merge` had no -q/--quiet while scan, report, audit, align, curvature and experiment do: with it, the merge's
    bar and the --rescan's bar are left out and nothing else changes (the same files, the same result lines)."""
    _, model, _, adapter = setup
    code, quiet = run_cli("merge", model, adapter, "-o", tmp_path / "m2", "--rescan", tmp_path / "r2", flag)
    assert code == 0, quiet
    code, loud = run_cli("merge", model, adapter, "-o", tmp_path / "m1", "--rescan", tmp_path / "r1")
    assert code == 0 and "27/27 tensors" in loud and "14/14 modules" in loud, loud  # the bars, without -q
    assert quiet.splitlines() == [
        f"merged 14 modules into 1 file in {tmp_path / 'm2'}",
        f"rescanned: 14 modules -> {tmp_path / 'r2'}",
    ]
    assert [line for line in loud.splitlines() if line.startswith(("merged", "rescanned"))] == [
        f"merged 14 modules into 1 file in {tmp_path / 'm1'}",
        f"rescanned: 14 modules -> {tmp_path / 'r1'}",
    ]
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "m1" / name).read_bytes() == (tmp_path / "m2" / name).read_bytes()


def test_scan_refuses_a_moe_layer_the_config_calls_dense_in_one_line(tmp_path):
    """A Qwen2-MoE checkpoint whose config.json lists an expert layer in mlp_only_layers: one error line naming the
    layer, the field and what to do; nothing written."""
    from plate_inspect.testing.synthetic import write_family

    ckpt = write_family(tmp_path / "m", "qwen2_moe")
    config = json.loads((ckpt.path / "config.json").read_text())
    assert config["mlp_only_layers"] == [0]
    (ckpt.path / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0, 1]}))
    assert_user_error(
        ["scan", ckpt.path, "--out", tmp_path / "b", "-q"],
        "layer 1:",
        "holds routed experts",
        "mlp_only_layers = [0, 1] lists it",
        "use the config.json that came with these weights",
    )
    assert not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- README walk-through
def _benchmark(name: str):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_health_cost_benchmark_adds_w_own_health_to_every_module(setup, tmp_path, capsys):
    """benchmarks/health_cost.py --minilm patched `scanner.health_of_weight`, gone since the scanner records health
    from W_frozen's spectrum: AttributeError. It now times the scan with W's own health computed per module besides:
    one `health_of_weight` per module, of the weight as the checkpoint holds it (oracle: the tensors read back)."""
    from safetensors.torch import load_file

    from plate_inspect.health import health_of_weight

    bench = _benchmark("health_cost")
    _, model, bundle, _ = setup
    with bench.w_health_per_module() as records:
        scan(model, tmp_path / "b", r=4, tau=0.9, max_rank=64)
    tensors = load_file(next(model.glob("*.safetensors")))
    expected = sorted(health_of_weight(tensors[f"{name}.weight"].float())["spectral_norm"] for name in bundle.modules)
    assert len(records) == len(bundle.modules) == 14
    assert {r["spectrum_of"] for r in records} == {"W"}
    assert sorted(r["spectral_norm"] for r in records) == pytest.approx(expected, rel=1e-5)
    times = bench.scan_with_and_without_w_health(model, rounds=1, r=4, tau=0.9, max_rank=64)
    assert times["modules"] == 14 and times["with"] > 0 and times["without"] > 0
    assert "with W's health per module" in capsys.readouterr().out


def _invoke(*args):
    """The CLI as `plate-inspect` (CliRunner would call it `cli`), stdout and stderr apart."""
    result = CliRunner().invoke(cli, [str(a) for a in args], prog_name="plate-inspect", catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_click_usage_errors_are_one_error_line_naming_the_commands_help(setup, tmp_path):
    """README: every bad input ends with one `error:` line. Click's own checks printed a four-line Usage / Try /
    blank / Error block; now one line in the project's style, exit 2, naming the command's --help (also for the
    errors click raises without a context: a missing option value, a UsageError from a command)."""
    _, model, bundle, _ = setup
    missing = tmp_path / "nothere.safetensors"
    cases = {
        ("merge", model, missing, "-o", tmp_path / "m"): (
            f"Invalid value for 'ADAPTER': Path '{missing}' does not exist.",
            "merge",
        ),
        ("scan", model, "--precision", "float16"): (
            "Invalid value for '--precision': 'float16' is not one of 'float32', 'float64'.",
            "scan",
        ),
        ("report",): ("Missing argument 'BUNDLES...'.", "report"),
        ("plan", bundle.path, "--budget"): ("Option '--budget' requires an argument.", "plan"),
        ("experiment", "continual", "--seeds"): ("Option '--seeds' requires an argument.", "experiment continual"),
        ("experiment", "bogus"): ("No such command 'bogus'.", "experiment"),
        ("scna",): ("No such command 'scna'. Did you mean 'scan'?", ""),
        ("--bogus",): ("No such option '--bogus'.", ""),
    }
    for args, (message, command) in cases.items():
        code, out, err = _invoke(*args)
        see = " ".join(["plate-inspect", command]).strip()
        assert (code, out, err) == (2, "", f"error: {message} (see {see} --help)\n"), args
    assert not (tmp_path / "m").exists()


def test_help_and_bare_groups_still_print_clicks_help(setup):
    """--help and a group given no command print click's help, unchanged (not an error line)."""
    code, out, err = _invoke("--help")
    assert code == 0 and out.startswith("Usage: plate-inspect [OPTIONS] COMMAND [ARGS]...") and err == ""
    code, out, err = _invoke()  # click prints a bare group's help on stderr, exit 2
    assert code == 2 and err.startswith("Usage: plate-inspect [OPTIONS] COMMAND") and "Commands:" in err
    assert "error:" not in err
    code, out, err = _invoke("experiment")
    assert code == 2 and err.startswith("Usage: plate-inspect experiment [OPTIONS] COMMAND") and "continual" in err
    code, out, err = _invoke("merge", "--help")
    assert code == 0 and out.startswith("Usage: plate-inspect merge [OPTIONS] CHECKPOINT ADAPTER") and err == ""


@pytest.mark.parametrize("command", ["report", "info", "health"])
def test_a_model_given_as_a_bundle_is_named_a_model_and_the_hint_works(setup, tmp_path, command):
    """`report/info/health MODEL_DIR` said "create a bundle with: plate-inspect scan MODEL --out MODEL_DIR", an --out
    that scan refuses (it holds the model's safetensors). Now: it looks like a model checkpoint, scan it into another
    directory; a .safetensors file is named the MODEL too; an empty directory keeps the --out hint, which works."""
    _, model, _, _ = setup
    extra = ["-o", tmp_path / "r.html"] if command == "report" else []
    output = assert_user_error([command, model, *extra], f"{model}: not a bundle (no manifest.json)")
    hint = f"a model checkpoint; create a bundle of it with: plate-inspect scan {model} --out <another directory>"
    assert "(model.safetensors, config.json)" in output and hint in output, output
    assert_user_error(["scan", model, "--out", model, "-q"], "not parts of a PLATE bundle")  # the old hint's --out
    weights = model / "model.safetensors"
    output = assert_user_error([command, weights, *extra], "is a file, not a bundle directory")
    assert f"plate-inspect scan {weights} --out <a directory>" in output
    code, output = run_cli("scan", weights, "--out", tmp_path / "b", "--r", "4", "--max-rank", "64", "-q")
    assert code == 0, output
    empty = tmp_path / "empty"
    empty.mkdir()
    output = assert_user_error(
        [command, empty, *extra], f"create a bundle with: plate-inspect scan MODEL --out {empty}"
    )
    code, output = run_cli("scan", model, "--out", empty, "--r", "4", "--max-rank", "64", "-q")
    assert code == 0, output


def test_plan_help_lists_every_budget_form_and_each_works(setup, tmp_path):
    """`plan --help` listed '2e6', '1%' and 'lora:16'; the README also uses '2,000,000', 'lora 16' and 'as LoRA r=16'
    (all accepted). Every form is in the help now, and each one listed plans (the same LoRA budget three ways)."""
    _, _, bundle, _ = setup
    code, help_text, _ = _invoke("plan", "--help")
    help_text = " ".join(help_text.split())  # click wraps the option help
    forms = ["2e6", "2,000,000", "1%", "lora:16", "lora 16", "as LoRA r=16"]
    assert code == 0 and all(f"'{form}'" in help_text for form in forms), help_text
    budgets = {}
    for form in forms:
        code, out, err = _invoke("plan", bundle.path, "--budget", form, "--json")
        assert code == 0, (form, err)
        budgets[form] = json.loads(out)["budget"]["params"]
    assert budgets["2e6"] == budgets["2,000,000"] == 2_000_000
    assert budgets["lora:16"] == budgets["lora 16"] == budgets["as LoRA r=16"] > 0


def test_continual_methods_help_points_at_the_list_that_is_there():
    """`--methods ... see below` with nothing below: the help names every method above the options and says so."""
    from plate_inspect.experiments.methods import METHODS

    code, help_text, _ = _invoke("experiment", "continual", "--help")
    above, options = help_text.split("Options:")
    assert code == 0 and "see below" not in help_text and "(listed above)" in options
    assert all(method in " ".join(above.split()) for method in METHODS)
