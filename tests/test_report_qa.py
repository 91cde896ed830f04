"""QA of ``plate-inspect report`` as a user meets it: damaged bundles are refused with one line, not drawn."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

import plate_inspect
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
