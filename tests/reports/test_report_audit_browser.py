"""The audit page (`plate-inspect audit --report`) in headless Chromium, as the redundancy report is checked: it
signals readiness, draws every plot, has no console errors and no network requests. It had no readiness signal, so
reports.browser.open_report could not check it (ready False, no plot seen)."""

from __future__ import annotations

import pytest

from plate_inspect.auditing import AuditRecord
from plate_inspect.reports.audit import write_audit_report
from plate_inspect.reports.browser import find_chromium, open_report

pytestmark = pytest.mark.browser


def _record(layer: int, kind: str, changed: bool) -> AuditRecord:
    """A hand-made audit record of a 64 x 32 module; its update (changed) or none (unchanged)."""
    share, norm = (0.25 + 0.1 * layer, 0.5) if changed else (0.0, 0.0)
    return AuditRecord(
        module=f"model.layers.{layer}.{kind}",
        protected_input_share=share,
        frozen_row_share=0.8 if changed else 0.0,
        delta_norm=norm,
        relative_delta=norm / 10,
        shape=(64, 32),
        m=12,
        r=8,
        weight_norm=10.0,
        protected_norm=norm * share**0.5,
    )


def test_audit_page_renders_in_chromium(tmp_path):
    chromium = find_chromium()
    assert chromium is not None, "chromium is required (scripts/ensure_chromium.sh installs it)"
    records = [_record(i, kind, changed=(i, kind) != (2, "mlp.up_proj")) for i in range(3) for kind in
               ("self_attn.q_proj", "mlp.up_proj")]  # fmt: skip
    html = write_audit_report(records, tmp_path / "audit.html", title="audit: base vs <ft>")
    check = open_report(html, timeout=60)
    assert check.ready and check.report_error is None
    assert check.console_errors == [] and check.exceptions == [] and check.network_requests == []
    assert set(check.plots) == {"audit-bars", "audit-scatter", "audit-heatmap"}, check.plots
    assert all(n > 0 for n in check.plots.values()), check.plots
    assert check.title == "audit: base vs <ft>"
