"""Each part file's header is read once: by a rescan of a finished bundle (the records the baseline was counted from
are the records reusable() keeps modules by; it read every header a second time), and by verify against other
weights (a fine-tune: every fingerprint differs), which read the module's part header once per module to tell an
edited manifest from changed weights (~750 modules to a part in a MoE bundle: a header parse each)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from helpers_reports import write_fake_bundle

import plate_inspect
from plate_inspect import bundle_parts, bundle_writer, verification
from plate_inspect.bundle import MANIFEST, Manifest
from plate_inspect.bundle_writer import BundleWriter
from plate_inspect.testing.synthetic import write_llama_like


def _counting(monkeypatch, *modules) -> Counter:
    """Header reads (part_records calls) per part file name, through each of ``modules``' own name for it."""
    reads: Counter = Counter()
    original = bundle_parts.part_records

    def counted(path, settings, variant):
        reads[Path(path).name] += 1
        return original(path, settings, variant)

    for module in modules:
        monkeypatch.setattr(module, "part_records", counted)
    return reads


def test_rescan_reads_each_part_header_once_and_keeps_every_intact_module(monkeypatch, tmp_path):
    path = write_fake_bundle(tmp_path / "b", layers=3, types={"self_attn.q_proj": (24, 16), "mlp.up_proj": (32, 16)})
    old = Manifest.from_json(json.loads((path / MANIFEST).read_text()), path / MANIFEST)
    parts = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(parts) == 3
    reads = _counting(monkeypatch, bundle_parts, bundle_writer)
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
    reads = _counting(monkeypatch, bundle_parts, bundle_writer)
    writer = BundleWriter(path, Manifest.from_json(old.to_json(), path / MANIFEST))
    writer.open()
    first, second = writer.reusable("layer-00000.safetensors"), writer.reusable("layer-00000.safetensors")
    writer.close()
    assert first == second == old.modules and reads == {"layer-00000.safetensors": 2}


def test_verify_against_changed_weights_reads_each_part_header_once(monkeypatch, tmp_path):
    base = write_llama_like(tmp_path / "base", layers=2, dtype=torch.float32, seed=0)
    tuned = write_llama_like(tmp_path / "tuned", layers=2, dtype=torch.float32, seed=1)  # same names and shapes
    bundle = plate_inspect.scan(str(base.path), tmp_path / "b", r=4, max_rank=8, target_modules=["q_proj", "up_proj"])
    reads = _counting(monkeypatch, verification)
    report = verification.verify(bundle, tuned.path)
    modules = bundle.modules
    assert len(modules) == 4 and sorted(report.changed) == sorted(modules)  # every weight differs
    assert all("weight fingerprint differs" in p for p in report.problems) and len(report.problems) == 4
    parts = {bundle.record(n).file for n in modules}
    assert reads == {part: 1 for part in parts}  # before: one read per module (2 a part)
