"""sequential_step checks every scan setting of its rescan before the merge writes: tau=5, r=0, target modules or
layers the model lacks, a too large sketch dim, device='tpu', expert_group=0, devices=3 and progress=3 were refused
only after the merged checkpoint had been written (by the scan, with the same checks and messages as now)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from plate_inspect import scan
from plate_inspect.errors import ConfigError
from plate_inspect.train import sequential

BAD = [
    ({"tau": 5}, ConfigError, r"^tau must lie strictly between 0 and 1, got 5"),
    ({"r": 0}, ConfigError, r"^r must be a positive integer, got 0"),
    ({"tau_grid": (0.5, 2.0)}, ConfigError, r"^tau grid values must lie strictly between 0 and 1"),
    ({"target_modules": ["nope"]}, ConfigError, r"^no target modules matched \(--target-modules nope\)"),
    ({"layers": [99]}, ConfigError, r"^no target modules matched .*layers \[99\]"),
    ({"sketch_dim": 1000}, ConfigError, r"^sketch dim 1000 is larger than d_in=64"),
    ({"device": "tpu"}, ConfigError, r"^device must be cpu, cuda or cuda:N, got 'tpu'"),
    ({"expert_group": 0}, ConfigError, r"^expert_group must be a positive integer, got 0"),
    ({"devices": 3}, ConfigError, r"^devices \(CLI: --devices\) must be a name or a list of names, got 3"),
    ({"progress": 3}, TypeError, r"^rescan: progress must be a function of one ProgressEvent, got int"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), BAD)
def test_sequential_step_refuses_a_bad_scan_setting_before_merging(digits_adapter, tmp_path, overrides, error, message):
    ckpt, _, adapter = digits_adapter
    with pytest.raises(error, match=message):
        sequential.sequential_step(ckpt, adapter, tmp_path / "merged", bundle_out=tmp_path / "re", **overrides)
    assert list(tmp_path.iterdir()) == []  # no merged checkpoint, no bundle, no temporary directory


@pytest.mark.parametrize(("overrides", "error", "message"), BAD)
def test_rescan_refuses_a_bad_scan_setting_before_scanning(digits_adapter, tmp_path, overrides, error, message):
    ckpt, bundle, _ = digits_adapter
    with pytest.raises(error, match=message):
        sequential.rescan(ckpt, bundle, tmp_path / "re", **overrides)
    assert list(tmp_path.iterdir()) == []


def test_the_rescan_is_a_scan_of_the_merged_checkpoint_with_the_overrides(digits_adapter, tmp_path):
    """The oracle: scan() of the merged checkpoint with the previous bundle's settings and tau=0.7, run by hand; an
    old-style progress is adapted once (one deprecation warning, not one per check)."""
    ckpt, bundle, adapter = digits_adapter
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = sequential.sequential_step(
            ckpt, adapter, tmp_path / "merged", tau=0.7, progress=lambda done, total, name: calls.append(done)
        )
    assert [str(w.message).split(":")[0] for w in caught if w.category is DeprecationWarning] == ["rescan"]
    assert calls == [1, 2, 3]  # one per module of fc1, fc2, fc3
    settings = dataclasses.replace(bundle.settings, tau=0.7)
    assert result.bundle.settings == settings
    expected = scan(result.out, tmp_path / "by-hand", **{k: getattr(settings, k) for k in ("r", "tau", "max_rank")},
                    target_modules=list(settings.target_modules))  # fmt: skip
    for name in ("fc1", "fc2", "fc3"):
        assert result.bundle.record(name).geometry_digest == expected.record(name).geometry_digest
        assert result.bundle.record(name).k == expected.record(name).k
