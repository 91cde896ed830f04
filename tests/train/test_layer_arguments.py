"""The trainer side's argument checks: the public functions of ``plate_inspect.train.layer`` check their
arguments at the boundary (a ConfigError naming the argument, as scikit-learn does), not an AttributeError,
TypeError or RuntimeError from deep inside torch or safetensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_train import load_digits
from safetensors.torch import load_file
from torch import nn

from plate_inspect.analysis import alignment, curvature
from plate_inspect.bundle import Bundle
from plate_inspect.errors import AlignmentError, BundleError, ConfigError
from plate_inspect.train.layer import (
    PlateLinear,
    apply_bundle,
    load_adapter,
    merge_all,
    module_geometry,
    plate_layers,
    save_adapter,
    unload,
    unmerge_all,
)


# --------------------------------------------------------------------------- model argument
@pytest.mark.parametrize("model", [None, 3, "model.safetensors"])
@pytest.mark.parametrize(
    ("function", "call"),
    [
        ("apply_bundle", lambda m, b, a: apply_bundle(m, b)),
        ("load_adapter", lambda m, b, a: load_adapter(m, a)),
        ("save_adapter", lambda m, b, a: save_adapter(m, a)),
        ("unload", lambda m, b, a: unload(m)),
        ("merge_all", lambda m, b, a: merge_all(m)),
        ("unmerge_all", lambda m, b, a: unmerge_all(m)),
        ("plate_layers", lambda m, b, a: plate_layers(m)),
    ],
)
def test_a_model_that_is_no_module_is_named(digits_setup, tmp_path, model, function, call):
    """Each raised "'NoneType' object has no attribute 'named_modules'" from inside torch."""
    _, _, bundle = digits_setup
    with pytest.raises(ConfigError, match=rf"^{function}: model must be a torch.nn.Module, got {model!r}"):
        call(model, bundle, tmp_path / "a.safetensors")


# --------------------------------------------------------------------------- apply_bundle's settings
@pytest.mark.parametrize("q_dtype", ["float16", torch.int64, 16])
def test_apply_bundle_names_a_bad_q_dtype(digits_setup, q_dtype):
    """'float16' reached Tensor.to as a device name (RuntimeError: Invalid device string); torch.int64 was blamed on
    the bundle (BundleError: Q must be a floating tensor)."""
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    with pytest.raises(ConfigError, match=r"^q_dtype must be a torch floating dtype"):
        apply_bundle(model, bundle, q_dtype=q_dtype)
    assert not plate_layers(model) and all(p.requires_grad for p in model.parameters())  # nothing changed


def test_apply_bundle_takes_a_floating_q_dtype(digits_setup):
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle, q_dtype=torch.float64)
    layer = plate_layers(model)["fc1"]
    assert layer.plate_Q.dtype == torch.float64
    assert torch.equal(layer.plate_Q, Bundle.load(bundle.path).q("fc1", dtype=torch.float64))


def test_apply_bundle_refuses_an_empty_module_list(digits_setup):
    """modules=[] wrapped nothing and froze every parameter: a run that trains nothing, without a word."""
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    with pytest.raises(ConfigError, match=r"^modules is empty"):
        apply_bundle(model, bundle, modules=[])
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("flag", ["no", 0, None])
def test_apply_bundle_check_fingerprints_must_be_a_bool(digits_setup, flag):
    """'no' is truthy: the check ran although the caller meant to skip it."""
    _, ckpt, bundle = digits_setup
    with pytest.raises(ConfigError, match=r"^check_fingerprints must be True or False"):
        apply_bundle(load_digits(ckpt), bundle, check_fingerprints=flag)


@pytest.mark.parametrize("plan", [3, b"plan.json", ""])
def test_apply_bundle_names_a_bad_plan_argument(digits_setup, plan):
    """3 raised "TypeError: expected str, bytes or os.PathLike object, not int" from Path."""
    _, ckpt, bundle = digits_setup
    with pytest.raises(ConfigError, match=r"^plan must be a plate-plan \(a dict or a JSON file's path\) or None"):
        apply_bundle(load_digits(ckpt), bundle, plan=plan)


def test_apply_bundle_names_a_bad_references_argument(digits_setup):
    _, ckpt, bundle = digits_setup
    with pytest.raises(ConfigError, match=r"^references must be a dict"):
        apply_bundle(load_digits(ckpt), bundle, references=3)


@pytest.mark.parametrize("k", [0, -1, 10**6, 2.0, True])
def test_module_geometry_refuses_a_k_outside_the_bundle(digits_setup, k):
    """k=-1 gave Q[:, :-1] (k-1 columns), 0 an empty Q, 10**6 the whole Q, all without a word."""
    _, _, bundle = digits_setup
    top = bundle.record("fc1").k
    with pytest.raises(ConfigError, match=rf"^module 'fc1': k must be an integer in 1..{top}"):
        module_geometry(bundle, "fc1", k=k)
    b_idx, q = module_geometry(bundle, "fc1", k=3)
    assert torch.equal(q, bundle.q("fc1")[:, :3]) and torch.equal(b_idx, bundle.b_idx("fc1"))


# --------------------------------------------------------------------------- PlateLinear's geometry
def test_plate_linear_refuses_a_numpy_q():
    """A NumPy Q raised "'numpy.ndarray' object has no attribute 'is_floating_point'"."""
    with pytest.raises(ConfigError, match=r"^Linear: Q must be a torch tensor \[d_in, k\], got ndarray"):
        PlateLinear(nn.Linear(8, 6), torch.tensor([0, 1]), torch.randn(8, 2).numpy())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_plate_linear_refuses_a_non_finite_q(bad):
    """A NaN in Q was taken: the layer's output was the base's at init, then NaN in every row of B after one step."""
    q = torch.randn(8, 2)
    q[3, 1] = bad
    with pytest.raises(BundleError, match=r"^Linear: Q holds NaN or Inf entries"):
        PlateLinear(nn.Linear(8, 6), torch.tensor([0, 1]), q)


# --------------------------------------------------------------------------- adapter files
@pytest.mark.parametrize("path", [None, 3, ""])
def test_save_and_load_adapter_name_a_bad_path(digits_setup, path):
    """None raised "TypeError: expected str, bytes or os.PathLike object, not NoneType" from Path."""
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    with pytest.raises(ConfigError, match=r"^path must be a path \(str or os.PathLike\)"):
        save_adapter(model, path)
    with pytest.raises(ConfigError, match=r"^path must be a path \(str or os.PathLike\)"):
        load_adapter(load_digits(ckpt), path)


def test_save_adapter_to_a_directory_says_to_give_a_file(digits_setup, tmp_path):
    """It raised safetensors' "SafetensorError: Error while serializing: I/O error: Is a directory"."""
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: is a directory; give save_adapter a file path"):
        save_adapter(model, tmp_path)


def test_save_adapter_does_not_replace_the_model_weights(digits_setup, tmp_path):
    """save_adapter(model, "ckpt/model.safetensors") replaced the model's weights with the adapter, without a word."""
    _, ckpt, bundle = digits_setup
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(ckpt.read_bytes())
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    with pytest.raises(ConfigError, match=r"exists and is not a PLATE adapter .* choose another path"):
        save_adapter(model, weights)
    assert weights.read_bytes() == ckpt.read_bytes()
    # an earlier adapter is replaced (the usual save after each epoch)
    adapter = tmp_path / "adapter.safetensors"
    save_adapter(model, adapter)
    with torch.no_grad():
        plate_layers(model)["fc1"].plate_A.fill_(0.25)
    save_adapter(model, adapter)
    saved = load_file(str(adapter))["fc1.plate_A"]
    assert torch.equal(saved, torch.full_like(saved, 0.25))


# --------------------------------------------------------------------------- analysis.alignment
def _inputs(n=32, d=64, seed=0):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return [x[: n // 2], x[n // 2 :]]


@pytest.mark.parametrize(
    ("function", "call"),
    [
        ("weight_activation_alignment", lambda m: alignment.weight_activation_alignment(m, _inputs(), ks=[4])),
        ("collect_input_moments", lambda m: alignment.collect_input_moments(m, _inputs())),
        ("full_family", lambda m: curvature.full_family(m)),
        ("lora_family", lambda m: curvature.lora_family(m, ["fc1"], rank=2)),
        ("OldTaskProblem", lambda m: curvature.OldTaskProblem(m, F.cross_entropy, _old_task())),
        ("analyze_families", lambda m: curvature.analyze_families(m, F.cross_entropy, _old_task(), [])),
    ],
)
def test_analysis_names_a_model_that_is_no_module(function, call):
    """Each raised "'NoneType' object has no attribute 'named_modules'" (or 'named_parameters', 'training')."""
    with pytest.raises(ConfigError, match=rf"^{function}: model must be a torch.nn.Module, got None"):
        call(None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ks": 4}, r"^ks must be a list of positive integers"),  # TypeError: 'int' object is not iterable
        ({"ks": [2.5]}, r"^ks must be a list of positive integers"),  # was truncated to k=2 without a word
        ({"ks": [math.nan]}, r"^ks must be a list of positive integers"),  # ValueError from int()
        ({"ks": ["a"]}, r"^ks must be a list of positive integers"),
        ({"n_random": 0}, r"^n_random must be a positive integer"),  # ve_random was NaN in every record
        ({"n_random": -1}, r"^n_random must be a positive integer"),
        ({"seed": -1}, r"^seed must be a non-negative integer"),
        ({"seed": "a"}, r"^seed must be a non-negative integer"),  # TypeError: can only concatenate str
        ({"target_modules": 3}, r"^target_modules must be a list of module names"),  # 'int' object is not iterable
        ({"inputs": None}, r"^inputs must be an iterable of model inputs"),
    ],
)
def test_weight_activation_alignment_names_a_bad_argument(digits_setup, kwargs, message):
    _, ckpt, _ = digits_setup
    args = {"inputs": _inputs(), "ks": [4], **kwargs}
    with pytest.raises(ConfigError, match=message):
        alignment.weight_activation_alignment(load_digits(ckpt), **args)


def test_weight_activation_alignment_takes_numpy_integers(digits_setup):
    """The checks let NumPy integers through (a k from np.arange), with the same records as Python ints."""
    _, ckpt, _ = digits_setup
    model = load_digits(ckpt)
    as_numpy = alignment.weight_activation_alignment(model, _inputs(), ks=np.array([4]), n_random=np.int64(2))
    as_int = alignment.weight_activation_alignment(model, _inputs(), ks=[4], n_random=2)
    assert as_numpy == as_int and all(r.k == 4 for r in as_int)


def test_alignment_refuses_non_finite_inputs(digits_setup):
    """NaN inputs gave records of NaN (ve_weight=nan, ve_oracle=0.0) without a word."""
    _, ckpt, _ = digits_setup
    bad = [torch.full((4, 64), math.nan)]
    with pytest.raises(AlignmentError, match=r"^fc1: the activation moment holds NaN or Inf"):
        alignment.weight_activation_alignment(load_digits(ckpt), bad, ks=[4])


def test_alignment_names_inputs_of_the_wrong_width(digits_setup):
    """A 7-feature input for a 64-input layer raised "RuntimeError: shape '[-1, 64]' is invalid" from the hook."""
    _, ckpt, _ = digits_setup
    with pytest.raises(AlignmentError, match=r"^fc1: its input has 7 features .* the layer takes 64"):
        alignment.weight_activation_alignment(load_digits(ckpt), [torch.randn(4, 7)], ks=[4])


def test_alignment_from_moments_checks_its_arguments():
    w = torch.randn(5, 5, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"^m: sigma must be a torch tensor, got ndarray"):  # AttributeError
        alignment.alignment_from_moments("m", w, np.eye(5), [2])
    with pytest.raises(ConfigError, match=r"^ks must be a list of positive integers"):  # max() of an empty sequence
        alignment.alignment_from_moments("m", w, torch.eye(5), [])
    with pytest.raises(AlignmentError, match=r"^m: the activation moment holds NaN or Inf"):  # LinAlgError from eigh
        alignment.alignment_from_moments("m", w, torch.full((5, 5), math.nan), [2])
    # the oracle: with Sigma = I every 2-frame explains 2/5 of the variance
    (rec,) = alignment.alignment_from_moments("m", w, torch.eye(5, dtype=torch.float64), [2])
    assert rec.ve_weight == pytest.approx(0.4) and rec.ve_random == pytest.approx(0.4)


def test_hf_text_alignment_and_read_text_name_a_bad_path():
    """None raised "TypeError: expected str, bytes or os.PathLike object, not NoneType" from Path."""
    with pytest.raises(ConfigError, match=r"^model_dir must be a path"):
        alignment.hf_text_alignment(None, "some text", ks=[2])
    with pytest.raises(ConfigError, match=r"^path must be a path"):
        alignment.read_text(None)
    with pytest.raises(ConfigError, match=r"^seq_len must be a positive integer"):  # '<' not supported
        alignment.hf_text_alignment("model", "some text", ks=[2], seq_len="256")
    with pytest.raises(ConfigError, match=r"^max_tokens must be a positive integer"):
        alignment.hf_text_alignment("model", "some text", ks=[2], max_tokens=0)


# --------------------------------------------------------------------------- analysis.curvature
def _old_task(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return curvature.batches(torch.randn(n, 64, generator=g), torch.randint(0, 5, (n,), generator=g), batch_size=16)


@pytest.fixture(scope="module")
def problem(digits_setup):
    _, ckpt, _ = digits_setup
    model = load_digits(ckpt)
    return model, curvature.OldTaskProblem(model, F.cross_entropy, _old_task())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_probes": -1}, r"^n_probes must be an integer >= 0"),  # ran, as if 0
        ({"n_probes": 2.5}, r"^n_probes must be an integer >= 0"),  # TypeError from range()
        ({"rhos": [math.nan]}, r"^rhos must be a list of finite numbers"),  # ran: F(nan) = nan
        ({"rhos": 0.5}, r"^rhos must be a list of finite numbers"),  # TypeError: 'float' object is not iterable
        ({"rhos": ["0.5"]}, r"^rhos must be a list of finite numbers"),
        ({"seed": 1.5}, r"^seed must be a non-negative integer"),  # TypeError from numpy's SeedSequence
        ({"seed": "0"}, r"^seed must be a non-negative integer"),
        ({"families": []}, r"^families must be a non-empty list of UpdateFamily"),  # returned [] without a word
        ({"families": "full"}, r"^families must be a non-empty list of UpdateFamily"),
        ({"families": [None]}, r"^families: each must be an UpdateFamily"),
    ],
)
def test_analyze_families_names_a_bad_argument(problem, kwargs, message):
    model, _ = problem
    args = {"families": [curvature.lora_family(model, ["fc1"], rank=2)], "n_probes": 2, **kwargs}
    with pytest.raises(ConfigError, match=message):
        curvature.analyze_families(model, F.cross_entropy, _old_task(), **args)


def test_analyze_families_refuses_one_family_not_in_a_list(problem):
    """One UpdateFamily raised "TypeError: object of type 'UpdateFamily' has no len()"."""
    model, _ = problem
    family = curvature.lora_family(model, ["fc1"], rank=2)
    with pytest.raises(ConfigError, match=r"^families must be a non-empty list of UpdateFamily objects"):
        curvature.analyze_families(model, F.cross_entropy, _old_task(), family, n_probes=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tol": -1}, r"^tol must be a finite number >= 0"),  # ran
        ({"beta": math.nan}, r"^beta must be a finite number >= 0"),  # ran: the bound was NaN
        ({"beta": "1"}, r"^beta must be a finite number >= 0"),  # ValueError from float()
        ({"family": None}, r"^family: each must be an UpdateFamily"),  # AttributeError: no attribute 'dim'
        ({"problem": None}, r"^problem must be an OldTaskProblem"),
    ],
)
def test_analyze_family_names_a_bad_argument(problem, kwargs, message):
    model, prob = problem
    args = {"problem": prob, "family": curvature.lora_family(model, ["fc1"], rank=2), "n_probes": 2, **kwargs}
    with pytest.raises(ConfigError, match=message):
        curvature.analyze_family(**args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_fn": None}, r"^loss_fn must be a function"),  # TypeError at the first loss
        ({"data": None}, r"^data must be an iterable of \(x, y\) batches"),
        ({"data": [torch.randn(4, 64)]}, r"^data must hold \(x, y\) batches .* batch 0 is Tensor"),  # unpack error
        ({"forward": 3}, r"^forward must be a function"),
    ],
)
def test_old_task_problem_names_a_bad_argument(digits_setup, kwargs, message):
    _, ckpt, _ = digits_setup
    args = {"model": load_digits(ckpt), "loss_fn": F.cross_entropy, "data": _old_task(), **kwargs}
    with pytest.raises(ConfigError, match=message):
        curvature.OldTaskProblem(**args)


def test_lora_family_names_a_non_integer_rank(digits_setup):
    """rank=2.5 raised torch.randn's "received an invalid combination of arguments"."""
    _, ckpt, _ = digits_setup
    with pytest.raises(ConfigError, match=r"^rank must be a positive integer, got 2.5"):
        curvature.lora_family(load_digits(ckpt), ["fc1"], rank=2.5)
    with pytest.raises(ConfigError, match=r"^modules must be a list of names"):
        curvature.lora_family(load_digits(ckpt), 3, rank=2)


def test_plate_family_takes_a_bundle_path_as_apply_bundle_does(digits_setup):
    """A path raised "'str' object has no attribute 'modules'"; the family equals the one of the loaded bundle."""
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    by_path = curvature.plate_family(model, str(bundle.path))
    loaded = curvature.plate_family(model, bundle)
    c = torch.randn(by_path.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert by_path.dim == loaded.dim == sum(bundle.record(m).r * bundle.record(m).k for m in bundle.modules)
    for name, delta in by_path.embed(c).items():
        assert torch.equal(delta, loaded.embed(c)[name])
    with pytest.raises(ConfigError, match=r"^path must be a path"):
        curvature.plate_family(model, None)


def test_batches_checks_its_arguments():
    x, y = torch.randn(10, 3), torch.arange(10)
    for size in (0, -1, 2.0):  # 0: range() arg 3 must not be zero; -1: an empty list (no data)
        with pytest.raises(ConfigError, match=r"^batch_size must be a positive integer"):
            curvature.batches(x, y, batch_size=size)
    with pytest.raises(ConfigError, match=r"^x and y must be tensors with one row each per sample"):
        curvature.batches(x, y[:5])  # the last batches had x rows without targets
    assert [len(b[1]) for b in curvature.batches(x, y, batch_size=4)] == [4, 4, 2]


# --------------------------------------------------------------------------- the plate PEFT method's config
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bundle": 3}, r"^bundle must be a path \(str or os.PathLike\), got 3"),  # TypeError from Path
        ({"plan": 3}, r"^plan must be a plate-plan \(a dict or a JSON file's path\) or None, got 3"),  # TypeError
        ({"check_fingerprints": "no"}, r"^check_fingerprints must be True or False, got 'no'"),  # truthy: checked
        ({"carry_geometry": "yes"}, r"^carry_geometry must be True or False, got 'yes'"),
    ],
)
def test_plate_config_names_a_bad_argument(digits_setup, kwargs, message):
    pytest.importorskip("peft")
    from plate_inspect.train.peft import PlateConfig

    _, _, bundle = digits_setup
    with pytest.raises(ConfigError, match=message):
        PlateConfig(**{"bundle": str(bundle.path), **kwargs})
    good = PlateConfig(bundle=str(bundle.path), check_fingerprints=False, carry_geometry=True)
    assert good.check_fingerprints is False and good.carry_geometry is True


# --------------------------------------------------------------------------- experiments
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": math.nan}, r"^lr must be a positive finite number"),  # trained to NaN, then summarised
        ({"lr": -1e-3}, r"^lr must be a positive finite number"),
        ({"lr": "1e-3"}, r"^lr must be a positive finite number"),  # TypeError from Adam, after stage 1
        ({"batch_size": 0}, r"^batch_size must be an integer >= 1"),
        ({"batch_size": 2.5}, r"^batch_size must be an integer >= 1"),
        ({"max_rank": 0}, r"^max_rank must be an integer >= 1"),  # the first PLATE scan failed, mid-run
        ({"budgets": 3}, r"^budgets must map method names to lists of Budget"),  # AttributeError: no 'get'
        ({"budgets": {"plate": 3}}, r"^budgets must map method names to lists of Budget"),  # 'int' not iterable
    ],
)
def test_continual_settings_validate_checks_every_setting(kwargs, message):
    from plate_inspect.experiments.continual import ContinualSettings

    with pytest.raises(ConfigError, match=message):
        ContinualSettings(**kwargs).validate()


@pytest.mark.parametrize(
    ("method", "budget", "message"),
    [
        ("plate", ("r0", {"r": 0, "tau": 0.9}), r"^plate: budget 'r0': r must be an integer >= 1, got 0"),
        ("plate", ("t", {"r": 8, "tau": 1.5}), r"^plate: budget 't': tau must be a number strictly between 0 and 1"),
        ("lora", ("r", {"rank": 2.5}), r"^lora: budget 'r': rank must be an integer >= 1, got 2.5"),
        ("l2_init", ("l", {"lam": math.nan}), r"^l2_init: budget 'l': lam must be a finite number >= 0"),
        ("osf", ("n", {"n_low": 0}), r"^osf: budget 'n': n_low must be an integer >= 1, got 0"),
    ],
)
def test_a_budget_value_is_checked_before_anything_trains(method, budget, message):
    """The keys were checked up front, the values only when the run started (r=0: after hours of other runs)."""
    from plate_inspect.experiments.continual import ContinualSettings
    from plate_inspect.experiments.methods import Budget

    with pytest.raises(ConfigError, match=message):
        ContinualSettings(budgets={method: [Budget(*budget)]}).validate()


def test_continual_settings_take_one_method_and_one_step_count():
    """methods="plate" was iterated (unknown method 'p'); steps=60 raised "Value after * must be an iterable"."""
    from plate_inspect.experiments.continual import ContinualSettings

    s = ContinualSettings(methods="plate", steps=60)
    assert s.methods == ("plate",) and s.steps == (60,)
    s.validate()
    ContinualSettings().validate()  # the defaults stay valid


def test_experiments_name_a_bad_out_argument():
    """None raised "TypeError: expected str, bytes or os.PathLike object, not NoneType" from Path."""
    from plate_inspect.experiments.continual import ContinualSettings, records_from_dir, run_continual
    from plate_inspect.experiments.sequential_tasks import report_sequential, run_sequential

    with pytest.raises(ConfigError, match=r"^out_dir must be a path"):
        run_continual(None, seeds=1, settings=ContinualSettings.quick())
    with pytest.raises(ConfigError, match=r"^settings must be a ContinualSettings or None, got 3"):  # AttributeError
        run_continual("out", seeds=1, settings=3)
    calls = (lambda: run_sequential(None, seeds=1), lambda: report_sequential(None), lambda: records_from_dir(None))
    for call in calls:
        with pytest.raises(ConfigError, match=r"^out must be a path"):
            call()


def test_run_sequential_takes_one_method_as_a_string(tmp_path):
    """methods="plate" was iterated: "unknown method 'p'". Now it is one method; the next check (lora_rank) speaks."""
    from plate_inspect.experiments.sequential_tasks import run_sequential

    with pytest.raises(ConfigError, match=r"^lora_rank must be an integer >= 1, got 0"):
        run_sequential(tmp_path / "out", methods="plate", seeds=1, steps=2, lora_rank=0)
    with pytest.raises(ConfigError, match=r"^unknown method 'plat'"):
        run_sequential(tmp_path / "out", methods="plat", seeds=1, steps=2)


# --------------------------------------------------------------------------- merging into a checkpoint
def test_merge_checkpoint_names_a_bad_argument(digits_setup, tmp_path):
    """out=None raised a TypeError from Path; overwrite="no" (truthy) would replace OUT; progress=3 failed mid-merge."""
    from plate_inspect.train.sequential import finish_interrupted_merge, merge_checkpoint, sequential_step

    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    out = tmp_path / "merged"
    with pytest.raises(ConfigError, match=r"^out must be a path"):
        merge_checkpoint(ckpt, adapter, None)
    with pytest.raises(ConfigError, match=r"^adapter must be a path"):
        merge_checkpoint(ckpt, None, out)
    with pytest.raises(ConfigError, match=r"^overwrite must be True or False, got 'no'"):
        merge_checkpoint(ckpt, adapter, out, overwrite="no")
    with pytest.raises(TypeError, match=r"^merge_checkpoint: progress must be a function, got int"):
        merge_checkpoint(ckpt, adapter, out, progress=3)
    assert not out.exists()  # refused before anything was written
    with pytest.raises(ConfigError, match=r"^out must be a path"):
        sequential_step(ckpt, adapter, None)
    with pytest.raises(ConfigError, match=r"^out must be a path"):
        finish_interrupted_merge(None)
    events = []
    result = merge_checkpoint(ckpt, adapter, out, progress=events.append)
    assert result.out == out and events[-1].done == events[-1].total
    assert torch.equal(load_file(str(out / ckpt.name))["fc1.weight"], load_file(str(ckpt))["fc1.weight"])  # A = 0


def test_digits_helpers_name_a_bad_argument():
    """accuracy(..., task_id=3) of a two-head model raised "'DigitsMLP' object has no attribute 'head3'";
    train_stage1(None) "'NoneType' object has no attribute 'd_in'"; load_model(None) "No such file: None"."""
    from plate_inspect.experiments import digits

    model = digits.initial_model(64, seed=0)
    x, y = torch.randn(6, 64), torch.zeros(6, dtype=torch.int64)
    for task in (3, 0, "1", True):
        with pytest.raises(ConfigError, match=r"^task must be a task number 1..2 \(this model has 2 heads\)"):
            digits.accuracy(model, x, y, task_id=task)
    assert torch.equal(model(x, task=2), model.head2(model.features(x)))
    with pytest.raises(ConfigError, match=r"^task1 must be a Task"):
        digits.train_stage1(None, epochs=1)
    with pytest.raises(ConfigError, match=r"^path must be a path"):
        digits.load_model(None)
