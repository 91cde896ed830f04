"""A manifest's repr is one line (the dataclass repr printed every module record: ~10 MB for a 15k-module bundle)."""

from __future__ import annotations

from helpers_reports import MOE_DENSE, MOE_EXPERTS, write_fake_bundle

from plate_inspect.bundle import Bundle


def test_manifest_repr_is_one_short_line(tmp_path):
    bundle = Bundle.load(write_fake_bundle(tmp_path / "b", 2, MOE_DENSE, experts=MOE_EXPERTS, n_experts=16))
    text = repr(bundle.manifest)
    assert "\n" not in text and len(text) < 300
    assert f"modules={len(bundle)}" in text and "complete" in text
    assert f"r={bundle.settings.r}" in text
