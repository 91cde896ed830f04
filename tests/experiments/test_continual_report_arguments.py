"""The continual benchmark's report builders (markdown_report, markdown_table, rich_table, main_steps, write_html)
name rows that are not continual.summarize rows in one ConfigError: None was a TypeError, [] "max() arg is an
empty sequence", a row of other keys a KeyError."""

from __future__ import annotations

import pytest

from plate_inspect.errors import ConfigError
from plate_inspect.experiments import continual_report
from plate_inspect.experiments.continual import RunRecord, summarize


def _rows(steps=(60, 120)):
    return summarize(
        [
            RunRecord("plate", "r8", {}, seed, "digits", st, 180, False, 100, 1.0, 0.9, 0.8, 0.7, 0.01)
            for st in steps
            for seed in (0, 1)
        ]  # fmt: skip
    )


BUILDERS = [
    ("markdown_report", lambda rows: continual_report.markdown_report(rows)),
    ("markdown_table", lambda rows: continual_report.markdown_table(rows)),
    ("rich_table", lambda rows: continual_report.rich_table(rows, "t")),
    ("main_steps", lambda rows: continual_report.main_steps(rows)),
]


@pytest.mark.parametrize(("name", "build"), BUILDERS)
@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (None, r"rows must be an iterable of summary rows \(continual.summarize gives them\), got None"),
        ([], r"rows is empty; give the rows continual.summarize makes of at least one run"),
        ([{"steps": 60}], r"rows must be continual.summarize rows; \{'steps': 60\} lacks data, method, budget"),
        ([3], r"rows must be continual.summarize rows; 3 lacks data, steps, method"),
    ],
)
def test_report_builders_name_rows_that_are_no_summary(name, build, rows, message):
    with pytest.raises(ConfigError, match=rf"^{name}: {message}"):
        build(rows)


def test_write_html_names_its_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^path must be a path \(str or os.PathLike\), got None"):
        continual_report.write_html(_rows(), None, "t")
    with pytest.raises(ConfigError, match=r"^write_html: rows is empty"):
        continual_report.write_html([], tmp_path / "c.html", "t")
    assert list(tmp_path.iterdir()) == []


def test_summary_rows_pass_through():
    rows = _rows()
    assert continual_report.main_steps(rows) == 120  # the largest step count run
    # one row per step count, forgetting 10 points (0.9 - 0.8), in the order of the steps
    lines = [line for line in continual_report.markdown_table(rows).splitlines() if line.startswith("| 60 ")
             or line.startswith("| 120 ")]  # fmt: skip
    assert [line.split(" | ")[7] for line in lines] == ["10.00 ± 0.00", "10.00 ± 0.00"]
