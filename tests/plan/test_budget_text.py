"""--budget as people type it: commas group thousands and nothing else. Before, every comma was dropped, so a decimal
comma ('1,5e6', 1.5 million in many locales) planned 15 million parameters, and '1,00' planned 100, without a word."""

from __future__ import annotations

import pytest

from plate_inspect.bundle import ModuleRecord
from plate_inspect.errors import ConfigError
from plate_inspect.plan import parse_budget


def record(d_out: int, d_in: int) -> ModuleRecord:
    return ModuleRecord(
        name="m",
        module_type="t",
        layer=0,
        shape=[d_out, d_in],
        layout="linear",
        dtype="F32",
        r=4,
        k=8,
        captured_energy=0.0,
        total_energy=1.0,
        mean_redundancy=0.0,
        k_by_tau={},
        fingerprint="sha256:0",
        file="f",
    )


@pytest.mark.parametrize(
    ("text", "count"),
    [("2,000,000", 2_000_000), ("1,000", 1000), ("12,345", 12345), ("2e6", 2_000_000), ("2_000_000", 2_000_000)],
)
def test_thousands_groups_and_plain_numbers_are_read(text, count):
    assert parse_budget(text, [record(64, 64)]).params == count


@pytest.mark.parametrize("text", ["1,5e6", "1,00", "1,0000", ",1000", "1000,", "1,,000", "2,5"])
def test_a_comma_that_does_not_group_thousands_is_refused(text):
    with pytest.raises(ConfigError, match="not a budget"):
        parse_budget(text, [record(64, 64)])
