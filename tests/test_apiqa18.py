"""Session 18 API QA of the trainer side: the public functions of ``plate_inspect.train.layer`` check their
arguments at the boundary (a ConfigError naming the argument, as scikit-learn does), not an AttributeError,
TypeError or RuntimeError from deep inside torch or safetensors."""

from __future__ import annotations

import math

import helpers_train
import pytest
import torch
from helpers_train import load_digits
from safetensors.torch import load_file
from torch import nn

from plate_inspect.bundle import Bundle
from plate_inspect.errors import BundleError, ConfigError
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


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return helpers_train.digits_setup(tmp_path_factory.mktemp("apiqa18"))


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
def test_a_model_that_is_no_module_is_named(setup, tmp_path, model, function, call):
    """Each raised "'NoneType' object has no attribute 'named_modules'" from inside torch."""
    _, _, bundle = setup
    with pytest.raises(ConfigError, match=rf"^{function}: model must be a torch.nn.Module, got {model!r}"):
        call(model, bundle, tmp_path / "a.safetensors")


# --------------------------------------------------------------------------- apply_bundle's settings
@pytest.mark.parametrize("q_dtype", ["float16", torch.int64, 16])
def test_apply_bundle_names_a_bad_q_dtype(setup, q_dtype):
    """'float16' reached Tensor.to as a device name (RuntimeError: Invalid device string); torch.int64 was blamed on
    the bundle (BundleError: Q must be a floating tensor)."""
    _, ckpt, bundle = setup
    model = load_digits(ckpt)
    with pytest.raises(ConfigError, match=r"^q_dtype must be a torch floating dtype"):
        apply_bundle(model, bundle, q_dtype=q_dtype)
    assert not plate_layers(model) and all(p.requires_grad for p in model.parameters())  # nothing changed


def test_apply_bundle_takes_a_floating_q_dtype(setup):
    _, ckpt, bundle = setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle, q_dtype=torch.float64)
    layer = plate_layers(model)["fc1"]
    assert layer.plate_Q.dtype == torch.float64
    assert torch.equal(layer.plate_Q, Bundle.load(bundle.path).q("fc1", dtype=torch.float64))


def test_apply_bundle_refuses_an_empty_module_list(setup):
    """modules=[] wrapped nothing and froze every parameter: a run that trains nothing, without a word."""
    _, ckpt, bundle = setup
    model = load_digits(ckpt)
    with pytest.raises(ConfigError, match=r"^modules is empty"):
        apply_bundle(model, bundle, modules=[])
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("flag", ["no", 0, None])
def test_apply_bundle_check_fingerprints_must_be_a_bool(setup, flag):
    """'no' is truthy: the check ran although the caller meant to skip it."""
    _, ckpt, bundle = setup
    with pytest.raises(ConfigError, match=r"^check_fingerprints must be True or False"):
        apply_bundle(load_digits(ckpt), bundle, check_fingerprints=flag)


@pytest.mark.parametrize("plan", [3, b"plan.json", ""])
def test_apply_bundle_names_a_bad_plan_argument(setup, plan):
    """3 raised "TypeError: expected str, bytes or os.PathLike object, not int" from Path."""
    _, ckpt, bundle = setup
    with pytest.raises(ConfigError, match=r"^plan must be a plate-plan \(a dict or a JSON file's path\) or None"):
        apply_bundle(load_digits(ckpt), bundle, plan=plan)


def test_apply_bundle_names_a_bad_references_argument(setup):
    _, ckpt, bundle = setup
    with pytest.raises(ConfigError, match=r"^references must be a dict"):
        apply_bundle(load_digits(ckpt), bundle, references=3)


@pytest.mark.parametrize("k", [0, -1, 10**6, 2.0, True])
def test_module_geometry_refuses_a_k_outside_the_bundle(setup, k):
    """k=-1 gave Q[:, :-1] (k-1 columns), 0 an empty Q, 10**6 the whole Q, all without a word."""
    _, _, bundle = setup
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
def test_save_and_load_adapter_name_a_bad_path(setup, path):
    """None raised "TypeError: expected str, bytes or os.PathLike object, not NoneType" from Path."""
    _, ckpt, bundle = setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    with pytest.raises(ConfigError, match=r"^path must be a path \(str or os.PathLike\)"):
        save_adapter(model, path)
    with pytest.raises(ConfigError, match=r"^path must be a path \(str or os.PathLike\)"):
        load_adapter(load_digits(ckpt), path)


def test_save_adapter_to_a_directory_says_to_give_a_file(setup, tmp_path):
    """It raised safetensors' "SafetensorError: Error while serializing: I/O error: Is a directory"."""
    _, ckpt, bundle = setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: is a directory; give save_adapter a file path"):
        save_adapter(model, tmp_path)


def test_save_adapter_does_not_replace_the_model_weights(setup, tmp_path):
    """save_adapter(model, "ckpt/model.safetensors") replaced the model's weights with the adapter, without a word."""
    _, ckpt, bundle = setup
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
