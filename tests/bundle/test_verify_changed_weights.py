"""verify against other weights (a fine-tune: every module's fingerprint differs) reads each part file's header
once to tell an edited manifest from changed weights; it read the module's part header once per module (~750
modules to a part in a MoE bundle: a header parse each)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

import plate_inspect
from plate_inspect import verification
from plate_inspect.testing.synthetic import write_llama_like


def test_verify_against_changed_weights_reads_each_part_header_once(monkeypatch, tmp_path):
    base = write_llama_like(tmp_path / "base", layers=2, dtype=torch.float32, seed=0)
    tuned = write_llama_like(tmp_path / "tuned", layers=2, dtype=torch.float32, seed=1)  # same names and shapes
    bundle = plate_inspect.scan(str(base.path), tmp_path / "b", r=4, max_rank=8, target_modules=["q_proj", "up_proj"])
    reads: Counter = Counter()
    original = verification.part_records

    def counted(path, settings, variant):
        reads[Path(path).name] += 1
        return original(path, settings, variant)

    monkeypatch.setattr(verification, "part_records", counted)
    report = verification.verify(bundle, tuned.path)
    modules = bundle.modules
    assert len(modules) == 4 and sorted(report.changed) == sorted(modules)  # every weight differs
    assert all("weight fingerprint differs" in p for p in report.problems) and len(report.problems) == 4
    parts = {bundle.record(n).file for n in modules}
    assert reads == {part: 1 for part in parts}  # before: one read per module (2 a part)
