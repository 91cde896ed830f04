"""Bad input to every command, systematically (missing, wrong kind, empty, corrupt, unreadable
paths; unwritable outputs; out-of-range numbers). Each case: exit 2, exactly one `error:` line naming the file and
what to do, no traceback, nothing written where the command refused.

The unreadable-path cases need a process that file permissions apply to: as root, a child process without
CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (``setpriv --bounding-set``), which obeys mode bits like any user.
Oracles: the OS's own errno (a mode-000 directory cannot be listed), the files left on disk, and click's
exit code.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_cli import assert_user_error, run_cli

import plate_inspect
from plate_inspect.cli.main import cli
from plate_inspect.errors import ConfigError, os_error_advice, os_error_text

#: Run CliRunner over a JSON list of argument lists in a fresh process; print one JSON record per case.
_CHILD = textwrap.dedent(
    """
    import json, sys
    from click.testing import CliRunner
    from plate_inspect.cli.main import cli

    out = []
    for args in json.loads(sys.argv[1]):
        res = CliRunner().invoke(cli, args)
        exc = res.exception
        crashed = exc is not None and not isinstance(exc, SystemExit)
        out.append({"code": res.exit_code, "output": res.output, "crash": repr(exc) if crashed else None})
    print(json.dumps(out))
    """
)


def _unprivileged() -> list[str] | None:
    """The command prefix that makes a child obey file permissions; None where that cannot be had."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import os; os.listdir('/root')"], capture_output=True)
    # /root is root's own: still listable (owner bits); what matters is that setpriv itself runs here
    return prefix if probe.returncode == 0 else None


def _bert_with_vocab(tiny_bert, minilm_dir, path):
    """The tiny BERT with MiniLM's tokenizer files beside it: a model dir align loads."""
    shutil.copytree(tiny_bert, path)
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def locked(setup, tiny_bert, minilm_dir, tmp_path_factory):
    """Unreadable copies of the model dir (mode 000) and of the bundle's manifest, a read-only directory, and the
    CLI results of every case below, run in one unprivileged child process."""
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("no way to drop root's permission override here (setpriv missing or refused)")
    root, model, bundle, adapter = setup
    place = tmp_path_factory.mktemp("locked")
    noread_dir = place / "model_noreaddir"
    shutil.copytree(model, noread_dir)
    noread_manifest = place / "bundle_noread"
    shutil.copytree(bundle.path, noread_manifest)
    rodir = place / "rodir"
    rodir.mkdir()
    noread_file = place / "model_noread"  # the weights file, not the directory, unreadable
    shutil.copytree(model, noread_file)
    bert = _bert_with_vocab(tiny_bert, minilm_dir, place / "bert_noread")
    # experiment outputs whose records this user may not read (a sound record: nothing to delete or redo)
    continual_report, continual_resume, seq = place / "c", place / "c2", place / "s"
    for d in (continual_report, continual_resume):
        d.mkdir()
        (d / "settings.json").write_text("{}")
        (d / "runs.jsonl").touch()
    (seq / "seed0" / "lora").mkdir(parents=True)
    (seq / "seed0" / "lora" / "records.json").write_text("{}")
    unreadable = [d / "settings.json" for d in (continual_report, continual_resume)]
    unreadable.append(seq / "seed0" / "lora" / "records.json")
    unreadable += [noread_file / "model.safetensors", bert / "model.safetensors"]
    cases = {
        "scan": ["scan", noread_dir, "--out", place / "scan-out", "-q"],
        "verify": ["verify", bundle.path, noread_dir],
        "audit": ["audit", noread_dir, model, "-q"],
        "merge": ["merge", noread_dir, adapter, "-o", place / "merge-out", "-q"],
        "align": ["align", noread_dir, "-q"],
        "info-manifest": ["info", noread_manifest],  # qa18-bundle.patch
        "rescan-rodir": ["merge", model, adapter, "-o", place / "rescan-merged", "--rescan", rodir / "b", "-q"],
        "plan-rodir": ["plan", bundle.path, "--budget", "1%", "-o", rodir / "plan.json"],
        "report-rodir": ["report", bundle.path, "-o", rodir / "r.html", "-q"],
        "scan-rodir": ["scan", model, "--out", rodir / "b", "-q"],
        "scan-file": ["scan", noread_file, "--out", place / "scan-file-out", "-q"],  # qa18-checkpoint.patch
        "align-file": ["align", bert, "-q", "--max-tokens", "64", "--k", "1"],  # qa18-checkpoint.patch
        "continual-report": ["experiment", "continual", "-o", continual_report, "--report-only", "-q"],
        "continual-resume": ["experiment", "continual", "-o", continual_resume, "--quick", "-q"],
        "sequential-resume": ["experiment", "sequential", "-o", seq, "--quick", "--methods", "lora", "-q"],
    }
    os.chmod(noread_dir, 0)
    os.chmod(noread_manifest / "manifest.json", 0)
    for path in unreadable:
        os.chmod(path, 0)
    os.chmod(rodir, 0o555)
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, "-c", _CHILD, json.dumps([[str(a) for a in v] for v in cases.values()])],
            capture_output=True,
            text=True,
            timeout=600,
        )
        # the real console script, once: what a user sees has no traceback either
        console = subprocess.run(
            [*prefix, sys.executable, "-m", "plate_inspect", "scan", str(noread_dir), "-q", "--out", str(place / "o")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for path in unreadable:
            os.chmod(path, 0o644)
        os.chmod(noread_dir, 0o755)
        os.chmod(noread_manifest / "manifest.json", 0o644)
        os.chmod(rodir, 0o755)
    assert proc.returncode == 0, proc.stderr
    results = dict(zip(cases, json.loads(proc.stdout.splitlines()[-1]), strict=True))
    return place, noread_dir, results, console


def _one_error_line(result: dict, *needles: str) -> str:
    assert result["crash"] is None, result
    assert result["code"] == 2, result["output"]
    assert "Traceback" not in result["output"]
    errors = [line for line in result["output"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result["output"]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


# --------------------------------------------------------------------------- the OS's refusals: one rule
@pytest.mark.parametrize("command", ["scan", "verify", "audit", "merge", "align"])
def test_a_model_directory_that_cannot_be_listed_is_one_line(locked, command):
    """Before: PermissionError traceback from every command that opens a model (cli/main.py now turns an OSError
    on a named file into one line: errors.os_error_text)."""
    place, noread_dir, results, _ = locked
    line = _one_error_line(results[command], str(noread_dir), "Permission denied")
    assert f"may not enter the directory {noread_dir} (ls -ld {noread_dir})" in line  # the directory in the way
    assert not (place / "scan-out").exists() and not (place / "merge-out").exists()


def test_the_console_script_prints_the_same_line_without_traceback(locked):
    place, noread_dir, _, console = locked
    assert console.returncode == 2, console.stderr
    assert "Traceback" not in console.stderr
    lines = [line for line in console.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Permission denied" in lines[0] and str(noread_dir) in lines[0], console.stderr
    assert not (place / "o").exists()


@pytest.mark.parametrize("case, option", [("plan-rodir", "-o"), ("report-rodir", "-o"), ("scan-rodir", "--out")])
def test_outputs_in_a_read_only_directory_are_one_line(locked, case, option):
    """Already one line before this session: kept so (regression)."""
    _one_error_line(locked[2][case], "rodir", f"choose another {option}")


# qa18-checkpoint.patch (plate_inspect/checkpoint.py): needs that patch applied.
@pytest.mark.parametrize("case", ["scan-file", "align-file"])
def test_a_weights_file_that_cannot_be_read_says_what_to_do(locked, case):
    """Before: scan said "model.safetensors: cannot read: Permission denied" (nothing to do); align said
    "cannot load the model (FileNotFoundError: No such file or directory ...)" of a file that is there."""
    line = _one_error_line(
        locked[2][case], "model.safetensors: cannot read: Permission denied", "check the permissions"
    )
    assert "No such file" not in line


@pytest.mark.parametrize("case", ["continual-report", "continual-resume", "sequential-resume"])
def test_an_experiment_record_this_user_may_not_read_is_named_not_called_other_or_damaged(locked, case):
    """Before: continual said "holds runs made with other settings (settings.json is missing or unreadable)" and
    sequential "unreadable ([Errno 13] ...); delete it (its run reruns)": deleting a sound record loses a run."""
    line = _one_error_line(locked[2][case], "Permission denied", "check the permissions")
    assert "delete" not in line and "other settings" not in line


# qa18-bundle.patch (plate_inspect/bundle.py): needs that patch applied.
def test_an_unreadable_manifest_is_not_called_damaged(locked):
    """Before: "unreadable manifest ([Errno 13] Permission denied ...); the bundle's record is damaged: rescan the
    model into it with --overwrite" -- a rescan would not help, and --overwrite would replace a sound bundle."""
    line = _one_error_line(locked[2]["info-manifest"], "manifest.json", "Permission denied", "check the permissions")
    assert "damaged" not in line and "--overwrite" not in line


# qa18-rescan.patch (plate_inspect/train/sequential.py, scanner.py): needs that patch applied.
def test_a_rescan_into_a_read_only_directory_is_refused_before_the_merge(locked):
    """Before: the merge was written, then the rescan failed with "... not writable; choose another --out" (the
    flag of the merge that had worked)."""
    place, _, results, _ = locked
    _one_error_line(results["rescan-rodir"], "rodir", "not writable", "choose another --rescan")
    assert not (place / "rescan-merged").exists()


# qa18-rescan.patch: needs that patch applied.
def test_a_rescan_under_a_file_is_refused_before_the_merge(setup, tmp_path):
    root, model, bundle, adapter = setup
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = tmp_path / "merged"
    text = assert_user_error(["merge", model, adapter, "-o", out, "--rescan", afile / "b", "-q"], "--rescan")
    assert f"{afile} is a file, not a directory" in text
    assert not out.exists()


# qa18-rescan.patch: needs that patch applied.
def test_a_merge_that_cannot_be_written_does_not_say_free_space(setup, tmp_path):
    """Before: "(afile is a file, not a directory); free space or choose another --out"."""
    root, model, bundle, adapter = setup
    afile = tmp_path / "afile"
    afile.write_text("x")
    text = assert_user_error(["merge", model, adapter, "-o", afile / "out", "-q"], "choose another --out")
    assert "free space" not in text
    assert afile.read_text() == "x"


def test_os_error_text_keeps_the_traceback_for_an_error_that_names_no_file():
    assert os_error_text(OSError(errno.EIO, "Input/output error")) is None
    line = os_error_text(PermissionError(errno.EACCES, "Permission denied", "/x/y"))
    assert line == (
        "/x/y: Permission denied; check the permissions of it and of its directories (ls -ld), "
        "or run as a user who may use it"
    )


def test_an_os_error_without_a_file_is_not_hidden(setup, tmp_path, monkeypatch):
    """The rule is narrow: an OSError that names no file is no user input, so it is not made into a user error."""
    import plate_inspect.reports as reports

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(reports, "write_report", broken)
    result = CliRunner().invoke(cli, ["report", str(setup[2].path), "-o", str(tmp_path / "r.html"), "-q"])
    assert isinstance(result.exception, OSError) and result.exception.filename is None

    def broken_file(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error", str(tmp_path / "r.html"))

    monkeypatch.setattr(reports, "write_report", broken_file)
    assert_user_error(
        ["report", setup[2].path, "-o", tmp_path / "r.html", "-q"], "r.html: Input/output error; check the path"
    )


# --------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("bins", [str(10**30), "1001", "1", "0", "-1"])
def test_report_bins_out_of_range_is_one_line(setup, tmp_path, bins):
    """Before: --bins 10**30 ended in numpy's ValueError traceback ('Maximum allowed size exceeded')."""
    out = tmp_path / "r.html"
    assert_user_error(["report", setup[2].path, "-o", out, "--bins", bins, "-q"], "--bins", "between 2 and 1000")
    assert not out.exists()


def test_report_bins_at_the_cap_works(setup, tmp_path):
    from plate_inspect.reports import report_data

    out = tmp_path / "r.html"
    result = CliRunner().invoke(cli, ["report", str(setup[2].path), "-o", str(out), "--bins", "1000", "-q"])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0
    data = report_data([setup[2]], bins=1000)
    assert data.histograms and all(len(h.counts) == 1000 for hs in data.histograms.values() for h in hs)


# --------------------------------------------------------------------------- align --text
@pytest.mark.parametrize(
    "kind, needle",
    [
        ("dir", "is a directory; give a UTF-8 text file (--text)"),
        ("binary", "not UTF-8 text (byte 0xff at offset 0: a binary file?)"),
        ("empty", "text file is empty; give a UTF-8 text file (--text)"),
        ("missing", "text file not found; check the path"),
    ],
)
def test_align_text_that_is_not_text_says_what_to_give(tmp_path, kind, needle):
    """Before: "cannot read as UTF-8 text ([Errno 21] Is a directory: '...')" and "'utf-8' codec can't decode
    byte ..." with nothing to do."""
    path = tmp_path / "text"
    if kind == "dir":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00garbage")
    elif kind == "empty":
        path.write_text("  \n")
    assert_user_error(["align", "-q", "--text", path, "--max-tokens", "64", "--k", "1"], str(path), needle)


# --------------------------------------------------------------------------- align / curvature counts and seeds
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--epochs", str(10**30)], "--epochs 1,000,000,000,000,000,000,000,000,000,000 is more than 10,000"),
        (["--probes", str(10**30)], "--probes 1,000,000,000,000,000,000,000,000,000,000 is more than 100,000"),
        (["--probes", "100001"], "--probes 100,001 is more than 100,000 (~1,000x the default 100)"),
        (["--seed", str(2**63)], "--seed 9,223,372,036,854,775,808 is more than 2^63 - 1"),
        (["--seed", "-1"], "--seed must be a non-negative integer, got -1"),
    ],
)
def test_curvature_counts_and_seeds_beyond_reason_are_refused_before_training(monkeypatch, args, needle):
    """Before: --epochs 10^30 trained for ever; --probes 10^30 trained, then died in numpy ("Maximum allowed
    dimension exceeded"); --seed 10^30 was torch's OverflowError traceback."""
    from plate_inspect.experiments import digits

    def must_not_train(*a, **k):
        raise AssertionError("stage 1 trained before the settings were checked")

    monkeypatch.setattr(digits, "train_stage1", must_not_train)
    assert_user_error(["curvature", "-q", *args], needle)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--random-draws", str(10**30)], "is more than 10,000 (~1,250x the default 8)"),
        (["--seed", str(10**30)], "is more than 2^63 - 1"),
        (["--seed", "-3"], "--seed must be a non-negative integer, got -3"),
    ],
)
def test_align_counts_and_seeds_beyond_reason_are_refused_before_the_model_loads(monkeypatch, args, needle):
    """Before: --random-draws 10^30 ran for ever; --seed 10^30 was torch's OverflowError traceback."""
    import plate_inspect.analysis.alignment as alignment

    def must_not_run(*a, **k):
        raise AssertionError("the model ran before the settings were checked")

    monkeypatch.setattr(alignment, "hf_text_alignment", must_not_run)
    assert_user_error(["align", "-q", *args], needle)


def test_curvature_probes_are_drawn_one_at_a_time_and_equal_one_draw():
    """Oracle: the rows of one seeded (n, dim) draw, normalised (what the probes were); a count of 10^12 must not
    allocate n x dim numbers up front (it was numpy's 'Maximum allowed dimension exceeded' after the training)."""
    import numpy as np

    from plate_inspect.analysis.curvature import random_unit_probes

    g = np.random.default_rng(11).standard_normal((5, 37))
    oracle = g / np.linalg.norm(g, axis=1, keepdims=True)
    assert np.allclose(np.stack(list(random_unit_probes(37, 5, 11))), oracle, rtol=0, atol=1e-15)  # norm's rounding
    first = next(iter(random_unit_probes(148_224, 10**12, 0)))
    assert first.shape == (148_224,) and abs(np.linalg.norm(first) - 1) < 1e-12


# --------------------------------------------------------------------------- align: broken model directories
def test_align_truncated_weights_are_named_with_what_to_do(tiny_bert, minilm_dir, tmp_path):
    """Before: "cannot load the model (SafetensorError: ... incomplete metadata, file not fully covered)"."""
    path = _bert_with_vocab(tiny_bert, minilm_dir, tmp_path / "bert")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_user_error(["align", path, "-q", "--k", "1"], f"{weights}: file is truncated", "re-download")


def test_align_a_tokenizer_that_fails_on_the_text_is_one_line(tiny_bert, minilm_dir, tmp_path):
    """Before: an empty vocab.txt loaded, then the tokenizer's "WordPiece error: Missing [UNK] token" was a
    traceback."""
    path = _bert_with_vocab(tiny_bert, minilm_dir, tmp_path / "bert")
    (path / "vocab.txt").write_text("")
    assert_user_error(
        ["align", path, "-q", "--k", "1"],
        f"{path}: its tokenizer failed on the text",
        "Missing [UNK]",
        "tokenizer files",
    )


# --------------------------------------------------------------------------- outputs onto someone else's file
def _victims(setup, tmp_path):
    """Files an output path must not replace: a model's weights, a bundle's manifest, the user's own JSON data."""
    _, model, bundle, _ = setup
    shutil.copytree(model, tmp_path / "model")
    shutil.copytree(bundle.path, tmp_path / "bundle")
    (tmp_path / "data.json").write_text('{"mine": [1, 2, 3]}\n')
    weights = next((tmp_path / "model").glob("*.safetensors"))
    return [weights, tmp_path / "bundle" / "manifest.json", tmp_path / "data.json"]


# qa18-plan.patch (plate_inspect/plan.py): needs that patch applied.
def test_plan_out_onto_a_model_manifest_or_data_is_refused_and_an_old_plan_is_replaced(setup, tmp_path):
    """Before: `plan BUNDLE -o MODEL/model.safetensors` replaced the model's weights with the plan JSON (and
    -o BUNDLE/manifest.json the bundle's manifest): data lost, exit 0."""
    bundle = setup[2]
    for victim in _victims(setup, tmp_path):
        before = victim.read_bytes()
        assert_user_error(["plan", bundle.path, "--budget", "1%", "-o", victim], f"{victim}: exists and is not a plan")
        assert victim.read_bytes() == before
    old = tmp_path / "plan.json"
    for budget in ("1%", "2%"):  # an earlier plan is the one file -o replaces
        result = CliRunner().invoke(cli, ["plan", str(bundle.path), "--budget", budget, "-o", str(old)])
        assert result.exit_code == 0, result.output
        assert json.loads(old.read_text())["budget"]["spec"] == budget


@pytest.mark.parametrize("command, key", [("align", "module"), ("curvature", "family")])
def test_json_out_onto_a_model_manifest_or_data_is_refused_before_any_work(setup, tmp_path, monkeypatch, command, key):
    """Before: --json-out MODEL/model.safetensors replaced the weights with the records after the run."""
    import plate_inspect.analysis.alignment as alignment
    from plate_inspect.cli.analyze import _check_json_out
    from plate_inspect.experiments import digits

    def must_not_run(*a, **k):
        raise AssertionError("work ran before --json-out was checked")

    monkeypatch.setattr(alignment, "hf_text_alignment", must_not_run)
    monkeypatch.setattr(digits, "train_stage1", must_not_run)
    for victim in _victims(setup, tmp_path):
        before = victim.read_bytes()
        assert_user_error([command, "-q", "--json-out", victim], f"{victim}: exists and is not a JSON list of {key}")
        assert victim.read_bytes() == before
    earlier = tmp_path / "records.json"  # an earlier --json-out of the same command may be replaced
    earlier.write_text(json.dumps([{key: "x", "k": 1}]))
    _check_json_out(earlier, key)
    with pytest.raises(ConfigError):
        _check_json_out(earlier, "family" if key == "module" else "module")


@pytest.mark.parametrize(
    "command",
    [
        ["experiment", "continual", "--quick", "-q", "-o"],
        ["experiment", "sequential", "--quick", "-q", "-o"],
        ["experiment", "continual", "--report-only", "-q", "-o"],
        ["curvature", "-q", "--epochs", "1", "--probes", "2", "--out"],
    ],
)
def test_a_run_into_a_model_or_bundle_directory_is_refused_and_adds_nothing(setup, tmp_path, command):
    """Before: curvature and experiment continual wrote digits_task1.safetensors (and runs, a bundle/) into a model
    directory, exit 0: a second *.safetensors there makes it another checkpoint to every reader (scan included);
    into a bundle directory curvature wrote it, then failed on it."""
    _, model, bundle, _ = setup
    for target, needle in ((model, "holds a model checkpoint"), (bundle.path, "holds a PLATE bundle (manifest.json)")):
        place = tmp_path / target.name
        shutil.copytree(target, place)
        before = sorted(p.name for p in place.rglob("*"))
        assert_user_error([*command, place], f"{place}: {needle}", "a directory of its own")
        assert sorted(p.name for p in place.rglob("*")) == before


def test_curvature_reruns_into_its_own_directory():
    """Its own earlier output (the stage-1 checkpoint and bundle/) is no model directory to protect."""
    import tempfile

    from plate_inspect.analysis.curvature import STAGE1_CHECKPOINT
    from plate_inspect.experiments.continual import check_own_directory

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / STAGE1_CHECKPOINT).touch()
        (Path(d) / "bundle").mkdir()
        (Path(d) / "bundle" / "manifest.json").write_text("{}")
        check_own_directory(d, ours=(STAGE1_CHECKPOINT,))
        with pytest.raises(ConfigError, match="holds a model checkpoint"):
            check_own_directory(d)


# --------------------------------------------------------------------------- empty arguments: one rule
@pytest.mark.parametrize(
    "args, needle",
    [
        (["scan", "{model}", "-q", "--out", ""], "an empty value ('') after --out"),
        (["scan", "{model}", "-q", "--out="], "an empty value ('') for --out"),
        (["scan", ""], "an empty value ('') after scan"),
        (["plan", "{bundle}", "--budget", "1%", "-o", ""], "an empty value ('') after -o"),
        (["merge", "{model}", "{adapter}", "-o", "", "-q"], "an empty value ('') after -o"),
        (["report", "{bundle}", "-o", "", "-q"], "an empty value ('') after -o"),
        (["scan", "{model}", "-q", "--target-modules", ""], "an empty value ('') after --target-modules"),
    ],
)
def test_an_empty_argument_is_refused_and_nothing_is_written(setup, tmp_path, monkeypatch, args, needle):
    """Before: `scan MODEL --out ""` (an unset shell variable) wrote a bundle into the current directory, exit 0;
    `merge ... -o ""` said ".: holds a PLATE bundle" of it; `scan ""` scanned the current directory."""
    _, model, bundle, adapter = setup
    monkeypatch.chdir(tmp_path)
    args = [a.format(model=model, bundle=bundle.path, adapter=adapter) for a in args]
    assert_user_error(args, needle, "an unset shell variable?", "--help")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- info/health of a bundle with damaged parts
def _damaged_copy(bundle, dest: Path) -> Path:
    """A copy of ``bundle`` with layer-00000's part truncated by 100 bytes and layer-00001's deleted."""
    shutil.copytree(bundle.path, dest)
    part = dest / "layer-00000.safetensors"
    os.truncate(part, part.stat().st_size - 100)
    (dest / "layer-00001.safetensors").unlink()
    return dest


def test_damaged_parts_reads_headers_and_names_each_problem(setup, tmp_path):
    """Bundle.damaged_parts: {} for a sound bundle; a truncated part's own size check and a missing one by name."""
    _, _, bundle, _ = setup
    assert plate_inspect.Bundle.load(bundle.path).damaged_parts() == {}
    damaged = plate_inspect.Bundle.load(_damaged_copy(bundle, tmp_path / "b"))
    problems = damaged.damaged_parts()
    assert problems["layer-00001.safetensors"] == "missing"
    assert problems["layer-00000.safetensors"].startswith("file is truncated")
    assert "re-download" not in problems["layer-00000.safetensors"]  # the reader's mend is for models, not bundles


@pytest.mark.parametrize("command", [["info"], ["info", "--modules"], ["health"], ["health", "--json"]])
def test_info_and_health_name_missing_or_truncated_part_files(setup, tmp_path, command):
    """They name the damaged part files and the mend, exit 2 (was exit 0): info after its summary of the manifest (the
    command that shows what a bundle holds), health before printing anything (as plan/report/verify refuse)."""
    _, _, bundle, _ = setup
    path = _damaged_copy(bundle, tmp_path / "b")
    output = assert_user_error(
        [*command, str(path)],
        "2 of 2 part files missing or damaged",
        "layer-00000.safetensors (file is truncated",
        "layer-00001.safetensors (missing)",
        "rerun the scan that made this bundle",
    )
    before_error = run_cli(*command, str(path))[1].split("error:")[0]
    if command[0] == "info":
        assert "q_proj" in before_error  # the summary came first
    else:
        assert before_error.strip() == "", before_error  # no table, no alpha line, no JSON before the refusal
    assert output


def test_info_and_health_of_a_sound_bundle_exit_zero(setup):
    _, _, bundle, _ = setup
    for command in (["info"], ["health"]):
        code, output = run_cli(*command, str(bundle.path))
        assert code == 0, output
        assert "error" not in output


def test_info_of_a_file_that_is_no_safetensors_does_not_advise_scanning_it(tmp_path):
    """`info garbage.safetensors` advised `plate-inspect scan garbage.safetensors` (which fails on it)."""
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 100)
    output = assert_user_error(["info", str(garbage)], "not a bundle directory", "no readable safetensors file")
    assert "plate-inspect scan" not in output


def test_merge_of_a_garbage_adapter_says_what_to_give(setup, tmp_path):
    """A cut-short or garbage adapter file: one line that says what the file should be (it had no what-to-do)."""
    _, model, _, adapter = setup
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(Path(adapter).read_bytes()[:50])
    assert_user_error(
        ["merge", str(model), str(cut), "--out", str(tmp_path / "out")], "give the file save_adapter wrote"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("error", "fix"),
    [
        (
            PermissionError(errno.EACCES, "Permission denied", "OUT/runs.jsonl"),
            "let this user write there (ls -ld shows who may)",
        ),
        (OSError(errno.ENOSPC, "No space left on device", "OUT/runs.jsonl"), "free space"),
        (OSError(errno.EIO, "Input/output error", "OUT/runs.jsonl"), "mend that"),
    ],
)
def test_an_experiment_that_cannot_write_says_mend_then_resume_or_start_elsewhere(error, fix):
    """Was "cannot write (Permission denied); ...: rerun the same command to resume; choose another --out": two
    conflicting orders. Now: what to mend, then resume, or another --out."""
    from plate_inspect.experiments.continual import writing_errors

    with pytest.raises(ConfigError) as caught, writing_errors(Path("OUT"), "the runs that finished are kept in X"):
        raise error
    text = str(caught.value)
    assert text.startswith("OUT/runs.jsonl: cannot write (")
    assert f"kept in X: {fix}, then rerun the same command to resume; or choose another --out" in text


def test_a_second_sigterm_while_the_first_unwinds_raises_nothing():
    """scancel sends SIGTERM twice: the first ends the scan (KeyboardInterrupt), the second must not raise again
    while the first unwinds (it landed in a GC callback once: "Exception ignored in ... KeyboardInterrupt"), nor
    kill the process after the scan, before it said the interrupted line (torchrun's, late on a busy node). A
    scan that was not interrupted gives the handler back."""
    import signal

    from plate_inspect.cli.scan import sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_interrupt():
        pass
    assert signal.getsignal(signal.SIGTERM) == before
    try:
        with sigterm_as_interrupt():
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)  # the second: nothing raised
        after = signal.getsignal(signal.SIGTERM)
        assert callable(after)  # not SIG_DFL (which would end pytest here)
        after(signal.SIGTERM, None)  # a third, after the scan: ignored
    finally:
        signal.signal(signal.SIGTERM, before)


def test_permission_advice_names_the_directory_that_may_not_be_entered(tmp_path):
    """A model dir this user may not enter: the line named DIR/manifest.json (the first file tried) and said "check
    the permissions of it and of its directories"; now it names DIR itself."""
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("no way to drop root's permission override here (setpriv missing)")
    closed = tmp_path / "model"
    closed.mkdir()
    closed.chmod(0)
    code = (
        "import errno, sys; from plate_inspect.errors import os_error_advice; "
        "print(os_error_advice(PermissionError(errno.EACCES, 'Permission denied', sys.argv[1])))"
    )
    try:
        done = subprocess.run([*prefix, sys.executable, "-c", code, str(closed / "manifest.json")], capture_output=True)
    finally:
        closed.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert f"may not enter the directory {closed} (ls -ld {closed})" in done.stdout.decode()
    # a file that may not be read, in directories that may be entered: the general advice
    assert "check the permissions" in os_error_advice(PermissionError(errno.EACCES, "no", str(tmp_path / "f")))
