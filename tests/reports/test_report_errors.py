"""``plate-inspect report`` and ``audit`` as a user meets them: damaged bundles are one error line, not drawn
or used (or a traceback)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

import plate_inspect
from plate_inspect.auditing import audit
from plate_inspect.cli.main import cli
from plate_inspect.errors import BundleError
from plate_inspect.reports import report_data, write_report
from plate_inspect.testing.synthetic import write_family


def flip_bit(part: Path, key: str, byte: int, mask: int = 0x80) -> None:
    """Flip bits of byte ``byte`` of tensor ``key``'s data in a safetensors file (header parsed by hand)."""
    raw = bytearray(part.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start = json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]
    raw[8 + n + start + byte] ^= mask
    part.write_bytes(bytes(raw))


def part_of(bundle_dir: Path, name: str) -> Path:
    return bundle_dir / json.loads((bundle_dir / "manifest.json").read_text())["modules"][name]["file"]


def test_a_damaged_score_is_refused_not_drawn_and_a_rescan_repairs_it(qwen_ckpt, tmp_path):
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=8, layers=[0])
    name = "model.layers.0.mlp.up_proj"
    flip_bit(part_of(out, name), f"{name}.redundancy", 3)  # the sign of the first score (float32, little-endian)
    page = tmp_path / "r.html"
    with pytest.raises(BundleError, match=rf"module '{name}': its stored redundancy scores or spectrum do not match"):
        write_report([plate_inspect.Bundle.load(out)], page)
    assert not page.exists()
    res = CliRunner().invoke(cli, ["report", str(out), "-o", str(page), "-q"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    (line,) = res.output.strip().splitlines()
    assert line.startswith(f"error: {part_of(out, name)}: module '{name}'") and "rerun" in line
    plate_inspect.scan(qwen_ckpt.path, out, r=8, layers=[0])  # what the message says to do
    assert write_report([plate_inspect.Bundle.load(out)], page).exists()


def test_a_damaged_expert_spectrum_is_refused(tmp_path):
    ckpt = write_family(tmp_path / "mixtral", "mixtral")
    out = tmp_path / "moe"
    plate_inspect.scan(ckpt.path, out, r=4, max_rank=16)
    name = next(n for n in json.loads((out / "manifest.json").read_text())["modules"] if ".experts.1." in n)
    flip_bit(part_of(out, name), f"{name}.spectrum", 0, mask=0x01)  # the lowest bit of the top eigenvalue
    with pytest.raises(BundleError, match=rf"module '{name}': its stored redundancy scores or spectrum"):
        report_data([plate_inspect.Bundle.load(out)])


@pytest.mark.parametrize("command", ["report", "audit"])
def test_an_output_name_too_long_is_one_line(qwen_ckpt, tmp_path, command):
    """QA: ``-o <300 characters>.html`` ended in an OSError traceback from Path.is_dir (ENAMETOOLONG)."""
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=8, layers=[0])
    long = tmp_path / ("a" * 300 + ".html")
    args = ["report", str(out), "-o", str(long)] if command == "report" else ["audit", *[str(qwen_ckpt.path)] * 2]
    res = CliRunner().invoke(cli, [*args, "--report", str(long)] if command == "audit" else args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    (line,) = res.output.strip().splitlines()
    assert line == f"error: {long}: cannot write the report (File name too long); choose another " + (
        "-o" if command == "report" else "--report"
    )


def shift_first_b_index(part: Path, name: str, d_out: int) -> None:
    """Move one B index to a row outside B, keeping B sorted and in range (damage no structure check sees)."""
    raw = bytearray(part.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8 : 8 + n])[f"{name}.plate_B_idx"]["data_offsets"]
    b = list(struct.unpack(f"<{(end - start) // 8}q", raw[8 + n + start : 8 + n + end]))
    if b[0] > 0:
        b[0] -= 1
    else:
        assert b[-1] + 1 < d_out
        b[-1] += 1
    raw[8 + n + start : 8 + n + end] = struct.pack(f"<{len(b)}q", *b)
    part.write_bytes(bytes(raw))


def test_damaged_b_indices_are_one_line_in_report_and_audit(qwen_ckpt, tmp_path):
    """QA: a flipped high bit in a stored B index crashed report and audit --bundle with an IndexError traceback;
    a B moved to another valid row was used silently by audit (it now checks B and Q against the scan's digest)."""
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=8, layers=[0])
    name = "model.layers.0.self_attn.q_proj"
    part = part_of(out, name)
    pristine = part.read_bytes()
    flip_bit(part, f"{name}.plate_B_idx", 5, mask=0x01)  # index + 2^40
    report = ["report", str(out), "-o", str(tmp_path / "r.html")]
    for args in (report, ["audit", str(qwen_ckpt.path), str(qwen_ckpt.path), "--bundle", str(out)]):
        res = CliRunner().invoke(cli, [*args, "-q"])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        (line,) = res.output.strip().splitlines()
        assert line == (
            f"error: {part}: module '{name}': B indices out of range [0, {qwen_ckpt.config['hidden_size']}); rerun "
            f"the scan that made this bundle (same model and settings) into {out}: missing or damaged part files are "
            f"recomputed, the others kept (plate-inspect verify {out} lists the damage)"
        )
    part.write_bytes(pristine)
    shift_first_b_index(part, name, qwen_ckpt.config["hidden_size"])
    with pytest.raises(BundleError, match=rf"module '{name}': its B or Q do not match the digest the scan recorded"):
        audit(qwen_ckpt.path, qwen_ckpt.path, out)


def test_damaged_expert_b_indices_are_refused_in_a_comparison(tmp_path):
    ckpt = write_family(tmp_path / "mixtral", "mixtral")
    a, b = tmp_path / "a", tmp_path / "b"
    plate_inspect.scan(ckpt.path, a, r=4, max_rank=16)
    plate_inspect.scan(ckpt.path, b, r=4, max_rank=16, tau=0.5)
    name = next(n for n in json.loads((b / "manifest.json").read_text())["modules"] if ".experts.1." in n)
    flip_bit(part_of(b, name), f"{name}.plate_B_idx", 7, mask=0x80)  # a negative index
    with pytest.raises(BundleError, match=rf"module '{name}': B indices out of range"):
        report_data([plate_inspect.Bundle.load(a), plate_inspect.Bundle.load(b)])


def test_a_report_never_replaces_a_file_that_is_not_an_html_page(qwen_ckpt, tmp_path):
    """QA: ``audit --bundle B --report B/manifest.json`` replaced the bundle's manifest with the page, and
    ``--report MODEL/model.safetensors`` would replace the weights: an existing file that is not an HTML page (by
    name or content) is refused, before the audit runs; an earlier report is replaced as before."""
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=8, layers=[0])
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    weights = next(qwen_ckpt.path.glob("*.safetensors"))
    audit_cmd = ["audit", str(qwen_ckpt.path), str(qwen_ckpt.path), "--bundle", str(out), "-q", "--report"]
    for args, victim, option in (
        ([*audit_cmd, str(out / "manifest.json")], out / "manifest.json", "--report"),
        ([*audit_cmd, str(weights)], weights, "--report"),
        (["report", str(out), "-q", "-o", str(notes)], notes, "-o"),
    ):
        before = victim.read_bytes()
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        (line,) = res.output.strip().splitlines()
        assert line.startswith(f"error: {victim}: exists and is not an HTML page")
        assert f"choose another {option}" in line
        assert victim.read_bytes() == before
    page = tmp_path / "page"  # no suffix: replaced again, since it holds a report
    for _ in range(2):
        res = CliRunner().invoke(cli, ["report", str(out), "-q", "-o", str(page)])
        assert res.exit_code == 0, res.output
    assert page.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize(
    "stats", ["[1, 2]", '{"wall_seconds": "x", "bytes_read": -5, "device": 3, "peak_rss_bytes": true}', '"text"']
)
def test_a_foreign_scan_stats_file_reads_as_not_recorded(qwen_ckpt, tmp_path, stats):
    """QA: a scan_stats.json holding a list (or wrongly typed fields) ended the report in an AttributeError or
    ValueError traceback; the header now says the scan time is not recorded."""
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=8, layers=[0])
    (out / "scan_stats.json").write_text(stats)
    res = CliRunner().invoke(cli, ["report", str(out), "-q", "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    assert "scan time</th><td><span class='dim'>not recorded</span>" in (tmp_path / "r.html").read_text()
