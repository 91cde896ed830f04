"""The public Python API checks its arguments at the boundary (plate_inspect.arguments): a ConfigError naming the
argument, not a TypeError/AttributeError from deep inside; audit takes its settings as scan does; inputs the type
annotations allow are read as meant (one string is one name or pattern, not its characters; a plan file or seed list
of the wrong kind is a ConfigError); a missing GPU is named by the keyword in Python and by the flag in the CLI.
(train.layer's own argument checks: tests/train/test_layer_arguments.py.)"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil

import helpers_train
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from peft import get_peft_model
from torch import nn

import plate_inspect
from plate_inspect.analysis.alignment import collect_input_moments, select_linear_modules
from plate_inspect.analysis.curvature import full_family, lora_family, plate_family
from plate_inspect.bundle import ScanSettings
from plate_inspect.checkpoint import Checkpoint, fingerprint_tensor, parse_safetensors_header
from plate_inspect.cli.main import cli
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.experiments.continual import seed_list
from plate_inspect.health import fit_marchenko_pastur, health_of_weight
from plate_inspect.targets import check_target_patterns, parse_layers, select_targets, target_matches
from plate_inspect.testing.synthetic import write_gpt2
from plate_inspect.train.layer import apply_bundle, load_plan
from plate_inspect.train.peft import PlateConfig
from plate_inspect.verification import check_exactness


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A small GPT-2 checkpoint and its bundle (r=4)."""
    root = tmp_path_factory.mktemp("review18")
    model = write_gpt2(root / "model").path
    plate_inspect.scan(str(model), out=str(root / "bundle"), r=4, tau=0.9)
    return model, plate_inspect.Bundle.load(root / "bundle")


# --------------------------------------------------------------------------- audit takes its settings as scan does
def test_audit_target_modules_string_is_one_name(gpt2):
    """One string is one module name, as in scan (it was iterated: 'mlp.c_fc' became the patterns m, l, p, ...)."""
    model, _ = gpt2
    records = plate_inspect.audit(model, model, target_modules="mlp.c_fc", r=4)
    as_list = plate_inspect.audit(model, model, target_modules=["mlp.c_fc"], r=4)
    assert [r.module for r in records] == [r.module for r in as_list] == ["h.0.mlp.c_fc", "h.1.mlp.c_fc"]
    assert all(r.delta_norm == 0.0 for r in records)  # the model against itself: no update


@pytest.mark.parametrize("seed", ["1", 1.5, True, None])
def test_scan_settings_refuse_a_non_integer_seed(seed):
    """The seed was taken as it came: "1" and 1 gave the same B (module_seed formats it) but other manifests."""
    with pytest.raises(ConfigError, match=r"seed must be an integer"):
        ScanSettings(seed=seed)


@pytest.mark.parametrize("seed", ["1", 1.5, True, None])
def test_audit_refuses_a_non_integer_seed(gpt2, seed):
    model, _ = gpt2
    with pytest.raises(ConfigError, match=r"seed must be an integer"):
        plate_inspect.audit(model, model, seed=seed)


def test_scan_settings_take_a_numpy_integer_seed_as_int():
    settings = ScanSettings(seed=np.int64(7))
    assert type(settings.seed) is int and settings.seed == 7
    assert settings.digest() == ScanSettings(seed=7).digest()


@pytest.mark.parametrize(("kwargs", "argument"), [({"base": None}, "base"), ({"tuned": 3}, "tuned")])
def test_audit_names_a_missing_path_argument(gpt2, kwargs, argument):
    model, _ = gpt2
    args = {"base": model, "tuned": model, **kwargs}
    with pytest.raises(ConfigError, match=rf"^{argument} must be a path"):
        plate_inspect.audit(**args)


def test_audit_names_a_bad_bundle_argument(gpt2):
    model, _ = gpt2
    with pytest.raises(ConfigError, match=r"^bundle must be a path"):
        plate_inspect.audit(model, model, bundle=3)


# --------------------------------------------------------------------------- verify
def test_verify_exact_needs_a_source(gpt2):
    """exact=True without a checkpoint checked nothing and said all was well; the CLI refused it, the API did not."""
    _, bundle = gpt2
    with pytest.raises(ConfigError, match=r"exact=True .* needs source"):
        plate_inspect.verify(bundle, exact=True)


@pytest.mark.parametrize("tol", [-1.0, math.nan, math.inf, "1e-3", True])
def test_verify_refuses_a_bad_orthonormality_tol(gpt2, tol):
    """A negative tol failed every module as 'not orthonormal'; NaN passed every one; a string raised a TypeError."""
    _, bundle = gpt2
    with pytest.raises(ConfigError, match=r"^orthonormality_tol must be a finite number >= 0"):
        plate_inspect.verify(bundle, orthonormality_tol=tol)


def test_verify_takes_a_good_orthonormality_tol(gpt2):
    model, bundle = gpt2
    report = plate_inspect.verify(bundle, model, orthonormality_tol=0.5)
    assert report.ok and report.modules_checked == len(bundle)
    strict = plate_inspect.verify(bundle, orthonormality_tol=0)  # float32 Q: Q^T Q - I is not exactly 0
    assert not strict.ok and all("not orthonormal" in p for p in strict.problems)


def test_verify_checks_its_progress_argument(gpt2):
    _, bundle = gpt2
    with pytest.raises(TypeError, match=r"^verify: progress must be a function"):
        plate_inspect.verify(bundle, progress=3)
    events = []
    plate_inspect.verify(bundle, progress=events.append)
    assert events[-1].done == events[-1].total == len(bundle)


def test_verify_names_a_bad_bundle_argument():
    with pytest.raises(ConfigError, match=r"^bundle must be a path"):
        plate_inspect.verify(None)


# --------------------------------------------------------------------------- Bundle
def test_bundle_q_refuses_a_dtype_that_is_not_a_torch_float_dtype(gpt2):
    """A string dtype reached Tensor.to, which took it for a device: 'Invalid device string: float16'."""
    _, bundle = gpt2
    name = bundle.modules[0]
    for dtype in ("float16", 3, torch.int64):
        with pytest.raises(ConfigError, match=r"^dtype must be a torch floating dtype"):
            bundle.q(name, dtype=dtype)
        with pytest.raises(ConfigError, match=r"^dtype must be a torch floating dtype"):
            bundle.plate(name, dtype=dtype)
    stored = bundle.q(name, dtype=None)
    assert torch.equal(bundle.q(name, dtype=torch.float64), stored.to(torch.float64))


def test_bundle_names_a_bad_module_name_or_kind(gpt2):
    _, bundle = gpt2
    with pytest.raises(ConfigError, match=r"^name must be a module name \(str\), got None"):
        bundle.b_idx(None)
    # an unknown kind is the caller's mistake, not a damaged part file (it said 'the part file is damaged')
    with pytest.raises(ConfigError, match=r"^kind must be one of plate_B_idx, plate_Q, redundancy, spectrum"):
        bundle.tensor(bundle.modules[0], "plate_A")


def test_bundle_load_names_a_bad_path_argument():
    with pytest.raises(ConfigError, match=r"^path must be a path"):
        plate_inspect.Bundle.load(None)


# --------------------------------------------------------------------------- Checkpoint.open
@pytest.mark.parametrize("source", [None, 3, ""])
def test_checkpoint_open_names_a_bad_source(source):
    """None and 3 raised a TypeError from Path; '' opened the working directory."""
    with pytest.raises(ConfigError, match=r"^source must be a path"):
        Checkpoint.open(source)


def test_checkpoint_open_names_a_bad_revision():
    with pytest.raises(ConfigError, match=r"^revision must be a branch, tag or commit"):
        Checkpoint.open("org/name", revision=3, offline=True)


# --------------------------------------------------------------------------- pure functions
def test_health_of_weight_takes_what_weight_spectrum_takes():
    """A nested list (a Spectrum-like input) reached weight.shape: AttributeError; a 1-D weight an IndexError."""
    rows = [[3.0, 0.0, 1.0], [0.0, 2.0, 0.0]]
    from_list = health_of_weight(rows)
    assert from_list == health_of_weight(torch.tensor(rows))
    assert from_list["shape"] == [2, 3]
    assert from_list["spectral_norm"] == pytest.approx(float(np.linalg.norm(np.array(rows), 2) ** 2))
    with pytest.raises(ValueError, match=r"weight must be a 2-D floating matrix"):
        health_of_weight(torch.ones(5))


def test_fit_marchenko_pastur_refuses_an_empty_shape():
    with pytest.raises(ValueError, match=r"n, m >= 1"):
        fit_marchenko_pastur(torch.rand(10), 0, 10)


def test_check_exactness_refuses_shapes_that_do_not_fit():
    w = torch.randn(8, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"q \[d_in, k\]"):
        check_exactness(w, torch.tensor([0]), torch.ones(6))
    with pytest.raises(ValueError, match=r"q \[d_in, k\]"):
        check_exactness(w, torch.tensor([0]), torch.ones(5, 2))
    with pytest.raises(ValueError, match=r"b_idx must index weight's 8 rows"):
        check_exactness(w, torch.tensor([9]), torch.eye(6)[:, :2])
    # the valid case still agrees with a hand-built oracle: Q = bottom-2 eigenvectors of W_f^T W_f
    wf = w[1:]
    values, vectors = torch.linalg.eigh(wf.T @ wf)
    check = check_exactness(w, torch.tensor([0]), vectors[:, :2])
    assert check.ok and check.optimum == pytest.approx(float(values[:2].sum()), rel=1e-12)


# --------------------------------------------------------------------------- targets
def test_target_selection_takes_one_string_as_one_pattern(gpt2):
    """select_targets / target_matches / check_target_patterns iterated a string: 'mlp.c_fc' was m, l, p, ..."""
    model, _ = gpt2
    chosen, note = select_targets(Checkpoint.open(model), "mlp.c_fc")
    assert [t.name for t in chosen] == ["h.0.mlp.c_fc", "h.1.mlp.c_fc"]
    assert note == "--target-modules mlp.c_fc"
    assert target_matches(chosen[0], "mlp.c_fc") and target_matches(chosen[0], ["mlp.c_fc"])
    assert not target_matches(chosen[0], "attn.c_attn")
    with pytest.raises(ConfigError, match=r"'a\[b' is not a valid regular expression"):
        check_target_patterns("a[b")


def test_parse_layers_names_a_spec_that_is_no_string():
    with pytest.raises(ConfigError, match=r"parse_layers takes a spec string"):
        parse_layers(3)
    assert parse_layers("0-2,decoder:1") == [0, 1, 2, "decoder:1"]


# --------------------------------------------------------------------------- damaged manifests
def _bundle_with_manifest(gpt2, tmp_path, content: bytes):
    _, bundle = gpt2
    copy = tmp_path / "bundle"
    shutil.copytree(bundle.path, copy)
    (copy / "manifest.json").write_bytes(content)
    return copy


def _manifest_with(gpt2, **changes) -> bytes:
    _, bundle = gpt2
    data = json.loads((bundle.path / "manifest.json").read_text())
    for key, value in changes.items():
        if key in ("r", "seed"):
            data["config"][key] = value
        else:
            data[key] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"[]", "corrupt manifest (not a JSON object)"),  # was AttributeError: 'list' object has no attribute 'get'
        (
            b'{"format": "plate-init-bundle", "format_version": 1, "source": {}, "config": [], "modules": {}, '
            b'"complete": true}',
            "corrupt manifest (AttributeError",
        ),  # fmt: skip
        (b'{"a": "\xff"}', "unreadable manifest"),  # invalid UTF-8: was a UnicodeDecodeError
    ],
)
def test_bundle_load_reports_a_damaged_manifest_as_a_bundle_error(gpt2, tmp_path, content, says):
    path = _bundle_with_manifest(gpt2, tmp_path, content)
    with pytest.raises(BundleError, match=re.escape(says)) as caught:
        plate_inspect.Bundle.load(path)
    assert "overwrite=True (CLI: --overwrite)" in str(caught.value)


@pytest.mark.parametrize(("changes", "says"), [({"r": 0}, "r must be"), ({"modules": []}, "AttributeError")])
def test_bundle_load_reports_nonsense_in_a_manifest_as_a_bundle_error(gpt2, tmp_path, changes, says):
    """A manifest edited to r=0 raised the ConfigError of a bad setting, as if the caller had given it."""
    path = _bundle_with_manifest(gpt2, tmp_path, _manifest_with(gpt2, **changes))
    with pytest.raises(BundleError, match=r"corrupt manifest \(.*" + says):
        plate_inspect.Bundle.load(path)


def test_scan_into_a_directory_with_a_damaged_manifest_is_refused_in_one_line(gpt2, tmp_path):
    model, _ = gpt2
    path = _bundle_with_manifest(gpt2, tmp_path, b"[]")
    with pytest.raises(BundleError, match=r"holds something that is not a matching bundle"):
        plate_inspect.scan(str(model), out=str(path), r=4)
    assert plate_inspect.scan(str(model), out=str(path), r=4, overwrite=True).manifest.complete


def test_checkpoint_helpers_name_a_bad_argument():
    with pytest.raises(ConfigError, match=r"^path must be a path"):
        parse_safetensors_header(None)
    with pytest.raises(TypeError, match=r"fingerprint_tensor takes a torch.Tensor, got list"):
        fingerprint_tensor([1.0, 2.0])
    t = torch.arange(6, dtype=torch.float32)
    assert fingerprint_tensor(t) == "sha256:" + hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("tau", ["0.5", "x", True, None])
def test_plate_settings_refuse_a_tau_that_is_no_real_number(tau):
    """tau is a real number in (0, 1): a string was read by float() ('0.5' passed, 'x' raised a bare ValueError)."""
    from plate_inspect.geometry import validate_settings

    with pytest.raises(ConfigError, match="tau must lie strictly between 0 and 1"):
        validate_settings(r=4, tau=tau, max_rank=8)


def test_plate_settings_take_numpy_floats_as_tau():
    from plate_inspect.geometry import validate_settings

    validate_settings(r=4, tau=np.float32(0.9), max_rank=8)
    validate_settings(r=4, tau=np.float64(0.5), max_rank=8)


def test_no_gpu_errors_name_the_keyword_in_python_and_the_flag_in_the_cli(tmp_path, monkeypatch):
    """QA: `plate_inspect.scan(..., devices="all")` on a machine without a GPU raised "--devices all: ... use --device
    cpu": CLI flags in a Python call. The message now names the keyword with its flag (the errors module's
    "keyword (CLI: --flag)" form); the CLI still prints just the flags. (No GPU is simulated: torch reports none.)"""
    import pytest
    import torch

    import plate_inspect
    from plate_inspect.errors import ConfigError
    from plate_inspect.testing.synthetic import write_llama_like

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ckpt = write_llama_like(tmp_path / "ckpt", layers=1).path
    with pytest.raises(ConfigError) as err:
        plate_inspect.scan(ckpt, tmp_path / "a", devices="all")
    assert str(err.value) == (
        'devices="all" (CLI: --devices all): no CUDA device is visible; use device="cpu" (CLI: --device cpu)'
    )
    with pytest.raises(ConfigError, match=r'^device="cuda" \(CLI: --device cuda\) was requested.*device="cpu"'):
        plate_inspect.scan(ckpt, tmp_path / "b", device="cuda")
    runner = CliRunner()
    for flags, said in (
        (["--devices", "all"], "error: --devices all: no CUDA device is visible; use --device cpu"),
        (["--device", "cuda"], "error: --device cuda was requested but no CUDA device is available; use --device cpu"),
    ):
        result = runner.invoke(cli, ["scan", str(ckpt), "--out", str(tmp_path / "c"), "-q", *flags])
        assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1] == said, result.output
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.parametrize("content", [[1, 2], 3, "plan", None])
def test_plan_file_that_is_not_a_json_object_is_a_config_error(digits_setup, tmp_path, content):
    """A plan file holding a JSON list/number/string/null was an AttributeError ('list' has no attribute 'get')."""
    _, ckpt, bundle = digits_setup
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match="not a plate-plan"):
        load_plan(path, bundle)
    with pytest.raises(ConfigError, match="not a plate-plan"):
        apply_bundle(helpers_train.load_digits(ckpt), bundle, plan=path)
    with pytest.raises(ConfigError, match="not a plate-plan"):
        get_peft_model(helpers_train.load_digits(ckpt), PlateConfig(bundle=str(bundle.path), plan=str(path)))


def test_plan_whose_bundle_entry_is_not_an_object_names_the_mismatch(digits_setup):
    """'bundle': "x" (hand-edited) was an AttributeError ('str' has no attribute 'get')."""
    _, _, bundle = digits_setup
    plan = {"format": "plate-plan", "format_version": 1, "bundle": "x", "modules": {"fc1": {"k": 1}}}
    with pytest.raises(ConfigError, match="the plan was made for bundle 'None'"):
        load_plan(plan, bundle)
    plan["bundle"] = {"identity": bundle.manifest.identity}  # the same plan with a proper entry applies
    assert load_plan(plan, bundle) == {"fc1": 1}


def test_one_target_module_string_is_one_pattern_not_its_characters():
    """target_modules="10" (a str is a Sequence[str]) selected layers '1' and '0', one pattern per character."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(11)])
    assert set(select_linear_modules(model, "10")) == {"10"}
    assert set(select_linear_modules(model, ["10"])) == {"10"}
    moments = collect_input_moments(model, [torch.randn(4, 3)], target_modules="10")
    assert set(moments) == {"10"}
    assert moments["10"].n == 4


def test_one_name_string_in_the_curvature_families_is_one_name():
    """full_family / lora_family took "10" as the names '1' and '0' (a silently different family)."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(11)])
    assert [b.param for b in full_family(model, "10.weight").blocks] == ["10.weight"]
    assert full_family(model, "10.weight").dim == 9
    assert [b.param for b in lora_family(model, "10", rank=1).blocks] == ["10.weight"]
    assert [b.param for b in lora_family(model, ["10"], rank=1).blocks] == ["10.weight"]


def test_one_module_string_in_plate_family_is_one_module(digits_setup):
    """plate_family(modules="fc2") looked for modules 'f', 'c' and '2' (CurvatureError)."""
    _, ckpt, bundle = digits_setup
    family = plate_family(helpers_train.load_digits(ckpt), bundle, modules="fc2")
    assert [b.param for b in family.blocks] == ["fc2.weight"]
    assert family.dim == bundle.record("fc2").r * bundle.record("fc2").k


@pytest.mark.parametrize("seeds", [True, 2.5, None])
def test_seeds_that_are_neither_a_count_nor_a_list_are_a_config_error(seeds):
    """seed_list(True) (a bool is an int to a type checker) was a TypeError: 'bool' object is not iterable."""
    with pytest.raises(ConfigError, match="seeds must be a count or a list of integers"):
        seed_list(seeds)


def test_seed_counts_and_lists_are_unchanged():
    assert seed_list(3) == [0, 1, 2]
    assert seed_list([4, 2]) == [4, 2]
    assert seed_list((7,)) == [7]
    with pytest.raises(ConfigError, match="at least 1"):
        seed_list(0)
    with pytest.raises(ConfigError, match="integers in"):
        seed_list([1, True])


def test_scan_with_one_target_module_string_scans_that_module(tmp_path):
    """scan(target_modules="q_proj") and ScanSettings(target_modules="q_proj") took each character as a pattern
    ('q', '_', 'p', ...): one string is one pattern, the same bundle as the list of it."""
    from plate_inspect.bundle import ScanSettings
    from plate_inspect.scanner import scan
    from plate_inspect.testing.synthetic import write_llama_like

    ckpt = write_llama_like(tmp_path / "ckpt", layers=1, hidden=32, intermediate=48, heads=4, kv_heads=2)
    assert ScanSettings(target_modules="q_proj").target_modules == ("q_proj",)
    one = scan(ckpt.path, tmp_path / "one", r=4, max_rank=8, anchors=8, target_modules="q_proj")
    listed = scan(ckpt.path, tmp_path / "list", r=4, max_rank=8, anchors=8, target_modules=["q_proj"])
    assert list(one.modules) == list(listed.modules) == ["model.layers.0.self_attn.q_proj"]
    assert one.manifest.identity == listed.manifest.identity
