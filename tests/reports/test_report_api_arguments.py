"""The report API as a notebook meets it: the bundles argument checked where it enters, and a one-line ReportData."""

from __future__ import annotations

import pytest
from helpers_reports import MOE_DENSE, MOE_EXPERTS, SMALL_TYPES, write_fake_bundle

from plate_inspect.bundle import Bundle
from plate_inspect.errors import ConfigError
from plate_inspect.reports import report_data, write_report


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Bundle:
    return Bundle.load(write_fake_bundle(tmp_path_factory.mktemp("b") / "small", 3, SMALL_TYPES))


def test_one_bundle_instead_of_a_list_is_named(bundle, tmp_path):
    """write_report(bundle, ...) iterated the bundle's records: "expected a plate_inspect.Bundle, got ModuleRecord"."""
    with pytest.raises(ConfigError, match=r"^bundles must be a list of plate_inspect.Bundle, got one Bundle; pass \["):
        write_report(bundle, tmp_path / "r.html")  # type: ignore[arg-type]
    assert not (tmp_path / "r.html").exists()


def test_a_path_instead_of_a_list_is_named(bundle, tmp_path):
    with pytest.raises(
        ConfigError, match=rf"^bundles must be a list of plate_inspect.Bundle, got the path '{bundle.path}'"
    ):
        report_data(str(bundle.path))  # type: ignore[arg-type]


def test_a_path_in_the_list_is_named_by_its_position(bundle):
    with pytest.raises(ConfigError, match=r"^bundles\[1\] must be a plate_inspect.Bundle, got 'x' \(use Bundle.load"):
        report_data([bundle, "x"])  # type: ignore[list-item]


def test_report_data_repr_is_one_line(bundle, tmp_path):
    rd = report_data([bundle, bundle], labels=["a", "b"])
    text = repr(rd)
    assert "\n" not in text and len(text) < 300, len(text)  # the dataclass repr held every plot's data
    assert text == f"ReportData(labels=['a', 'b'], modules={len(bundle)}, spectra={len(bundle)})"
    moe = Bundle.load(write_fake_bundle(tmp_path / "moe", 2, MOE_DENSE, experts=MOE_EXPERTS, n_experts=4, max_rank=16))
    experts = sum(1 for rec in moe if ".experts." in rec.name)
    rd = report_data([moe])
    groups = 2 * len(MOE_EXPERTS)  # one per (layer, expert type)
    tail = f"spectra={len(moe) - experts}, expert_groups={groups} ({experts} experts))"
    assert repr(rd).endswith(tail)
