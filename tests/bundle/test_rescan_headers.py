"""A rescan of a finished bundle reads each part file's header once: the records the baseline was counted from are
the records reusable() keeps modules by (it read every header a second time)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from plate_inspect import bundle_parts, bundle_writer
from plate_inspect.bundle import MANIFEST, Manifest
from plate_inspect.bundle_writer import BundleWriter
from tests.helpers_reports import write_fake_bundle


def _counting(monkeypatch) -> Counter:
    reads: Counter = Counter()
    original = bundle_parts.part_records

    def counted(path, settings, variant):
        reads[Path(path).name] += 1
        return original(path, settings, variant)

    monkeypatch.setattr(bundle_parts, "part_records", counted)
    monkeypatch.setattr(bundle_writer, "part_records", counted)
    return reads


def test_rescan_reads_each_part_header_once_and_keeps_every_intact_module(monkeypatch, tmp_path):
    path = write_fake_bundle(tmp_path / "b", layers=3, types={"self_attn.q_proj": (24, 16), "mlp.up_proj": (32, 16)})
    old = Manifest.from_json(json.loads((path / MANIFEST).read_text()), path / MANIFEST)
    parts = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(parts) == 3
    reads = _counting(monkeypatch)
    writer = BundleWriter(path, Manifest.from_json(old.to_json(), path / MANIFEST))
    writer.open()
    assert writer.manifest_disagrees == [] and set(writer.manifest.baseline or {}) == set(old.modules)
    kept = {part: writer.reusable(part) for part in parts}
    writer.close()
    assert reads == {part: 1 for part in parts}  # before: 2 each (rescan_baseline, then reusable)
    for part, records in kept.items():
        assert records == {n: rec for n, rec in old.modules.items() if rec.file == part}


def test_a_part_asked_for_again_is_read_again(monkeypatch, tmp_path):
    """The kept records serve the first reusable() of a part only: a second call (after the part may have been
    rewritten) reads the header afresh."""
    path = write_fake_bundle(tmp_path / "b", layers=1, types={"mlp.up_proj": (32, 16)})
    old = Manifest.from_json(json.loads((path / MANIFEST).read_text()), path / MANIFEST)
    reads = _counting(monkeypatch)
    writer = BundleWriter(path, Manifest.from_json(old.to_json(), path / MANIFEST))
    writer.open()
    first, second = writer.reusable("layer-00000.safetensors"), writer.reusable("layer-00000.safetensors")
    writer.close()
    assert first == second == old.modules and reads == {"layer-00000.safetensors": 2}
