"""The tables of continual.html (ablations, step sensitivity) are drawn tall enough for every row: their height was
120 + 24 px a row while plotly kept its default margins (100 px above, 80 below) and 20 px rows under a 28 px header,
so the 6-row ablation table of a `--quick` run showed 3 rows and hid the rest behind a scroll bar. Checked on the
figure specs plotly receives, against plotly's own defaults where a spec leaves a value unset."""

from __future__ import annotations

import pytest

from plate_inspect.experiments.continual_report import ABLATION_HEADERS, table_figure

PLOTLY_DEFAULT_MARGIN = {"t": 100, "b": 80}  # plotly.js layout.margin defaults
PLOTLY_DEFAULT_HEADER_PX, PLOTLY_DEFAULT_ROW_PX = 28, 20  # plotly.js table header.height, cells.height


def room_needed(fig) -> tuple[float, float]:
    """(the figure's height, what its margins, header and rows take), plotly defaults for what the spec leaves out."""
    layout, table = fig.layout, fig.data[0]
    top = layout.margin.t if layout.margin.t is not None else PLOTLY_DEFAULT_MARGIN["t"]
    bottom = layout.margin.b if layout.margin.b is not None else PLOTLY_DEFAULT_MARGIN["b"]
    header = table.header.height if table.header.height is not None else PLOTLY_DEFAULT_HEADER_PX
    row = table.cells.height if table.cells.height is not None else PLOTLY_DEFAULT_ROW_PX
    rows = len(table.cells.values[0]) if table.cells.values else 0
    return layout.height, top + bottom + header + rows * row


@pytest.mark.parametrize("rows", [0, 1, 6, 18, 60])
def test_every_row_of_a_table_fits_its_figure(rows):
    body = [
        ["r8_tau0.98", f"method{i}", "1,384", "0.00 ± n/a", "62.05 ± n/a", "0.0000 ± n/a", "1.00"] for i in range(rows)
    ]
    fig = table_figure(ABLATION_HEADERS, body, "Matched-capacity ablations (60 steps)")
    height, needed = room_needed(fig)
    assert height >= needed
    assert list(fig.data[0].cells.values[1]) == [f"method{i}" for i in range(rows)]  # every row is in the table
