"""An ablation bundle given as the audit's bundle is refused in one line naming the PLATE bundle it was made from:
with a Random-B bundle the audit scored the update against random rows as if they were PLATE's B (other shares, no
word about it), and `plan` already refuses ablation bundles the same way."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers_audit import audit_json
from helpers_cli import assert_user_error
from safetensors.torch import load_file, save_file

import plate_inspect
from plate_inspect.auditing import audit
from plate_inspect.errors import ConfigError
from plate_inspect.train.variants import make_variant


@pytest.fixture(scope="module")
def setup(qwen_ckpt, tmp_path_factory):
    """BASE, a TUNED copy with one layer moved, BASE's bundle and its Random-B ablation."""
    root = tmp_path_factory.mktemp("ablation_audit")
    base = qwen_ckpt.path
    tuned = root / "tuned"
    tuned.mkdir()
    gen = torch.Generator().manual_seed(3)
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tuned / f.name)
            continue
        tensors = load_file(f)
        for name, t in tensors.items():
            if ".layers.0." in name and name.endswith("proj.weight"):
                tensors[name] = (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        save_file(tensors, tuned / f.name, metadata={"format": "pt"})
    bundle = root / "bundle"
    plate_inspect.scan(base, bundle, r=8)
    random_b = root / "random_b"
    make_variant(bundle, base, "random_b", random_b)
    return base, tuned, bundle, random_b


def test_random_b_bundle_is_refused_naming_its_plate_bundle(setup):
    base, tuned, bundle, random_b = setup
    with pytest.raises(ConfigError, match="random_b ablation bundle") as err:
        audit(base, tuned, bundle=random_b)
    assert f"of {bundle.resolve()};" in str(err.value)  # the bundle it was made from, as the ablation records it
    out = assert_user_error(["audit", base, tuned, "--bundle", random_b, "-q"], "random_b ablation bundle", "--bundle")
    assert "Traceback" not in out


def test_the_plate_bundle_it_names_audits(setup):
    """The refusal's advice works, and the two bundles do give other numbers (what the refusal prevents)."""
    base, tuned, bundle, random_b = setup
    plate = {r["module"]: r for r in audit_json(base, tuned, "--bundle", bundle)}
    assert any(r["delta_norm"] > 0 for r in plate.values())
    plate_b = plate_inspect.Bundle.load(bundle)
    ablation_b = plate_inspect.Bundle.load(random_b)
    differs = [n for n in plate_b.modules if not torch.equal(plate_b.b_idx(n), ablation_b.b_idx(n))]
    assert differs  # random rows: another B, so frozen-row shares would have differed silently
