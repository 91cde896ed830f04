"""make_variant / make_variants check every argument before any work: out=None raised a BundleError or TypeError
from deep inside, seed=b'x' was written into the manifest, variants=None raised "'NoneType' object is not
iterable", and variants=['random_b', 'bogus'] wrote random_b before refusing bogus."""

from __future__ import annotations

import pytest
import torch
from helpers_train import digits_setup

from plate_inspect.errors import ConfigError
from plate_inspect.train.variants import make_variant, make_variants


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root, ckpt, bundle = digits_setup(tmp_path_factory.mktemp("variant-args"), r=8, tau=0.8)
    return ckpt, bundle


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"out": None}, r"^out must be a path \(str or os.PathLike\), got None"),
        ({"out": "  "}, r"^out must be a path \(str or os.PathLike\), got '  '"),
        ({"seed": b"x"}, r"^seed must be a non-negative integer below 2\^63, got b'x'"),
        ({"seed": -1}, r"^seed must be a non-negative integer below 2\^63, got -1"),
        ({"seed": 1.0}, r"^seed must be a non-negative integer below 2\^63, got 1.0"),
        ({"overwrite": "no"}, r"^overwrite must be True or False, got 'no'"),
        ({"variant": None}, r"^unknown variant None; choose one of random_b, "),
    ],
)
def test_make_variant_names_a_bad_argument(setup, tmp_path, monkeypatch, kwargs, message):
    ckpt, bundle = setup
    monkeypatch.chdir(tmp_path)  # out='  ' wrote the ablation into a directory of spaces here
    arguments = {"bundle": bundle, "checkpoint": ckpt, "variant": "random_b", "out": tmp_path / "v", **kwargs}
    with pytest.raises(ConfigError, match=message):
        make_variant(**arguments)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variants": None}, r"^variants must be a name or a list of names, got None"),
        ({"variants": [1]}, r"^variants must be a name or a list of names, got \[1\]"),
        ({"variants": ["random_b", "bogus"]}, r"^unknown variant 'bogus'; choose one of random_b, "),
        ({"variants": ["random_q", "random_q"]}, r"^variants lists 'random_q' twice; give each variant once"),
        ({"out_root": None}, r"^out_root must be a path \(str or os.PathLike\), got None"),
        ({"seed": None}, r"^seed must be a non-negative integer below 2\^63, got None"),
        ({"overwrite": 1}, r"^overwrite must be True or False, got 1"),
    ],
)
def test_make_variants_checks_everything_before_the_first_ablation(setup, tmp_path, kwargs, message):
    ckpt, bundle = setup
    with pytest.raises(ConfigError, match=message):
        make_variants(bundle, ckpt, **{"out_root": tmp_path / "v", "variants": ("random_b",), **kwargs})
    assert list(tmp_path.iterdir()) == []  # random_b was written before 'bogus' was refused


def test_one_variant_name_is_one_variant(setup, tmp_path):
    """One string is one variant (as for methods and modules), and the same ablation make_variant writes."""
    ckpt, bundle = setup
    made = make_variants(bundle, ckpt, tmp_path / "all", variants="random_q", seed=3)
    alone = make_variant(bundle, ckpt, "random_q", tmp_path / "one", seed=3)
    assert list(made) == ["random_q"]
    for name in ("fc1", "fc2", "fc3"):
        assert torch.equal(made["random_q"].q(name), alone.q(name))
        assert torch.equal(made["random_q"].b_idx(name), bundle.b_idx(name))  # random_q keeps PLATE's B
