"""Bundle keeps part files open between tensor reads (a fresh open parses the whole header: 150x slower per read on a
MoE layer's part, benchmarks/bench_bundle_reads.py); a kept handle must never outlive the file it was opened on."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from helpers_reports import SMALL_TYPES, write_fake_bundle
from safetensors.torch import load_file

from plate_inspect.bundle import Bundle
from plate_inspect.bundle_reader import OPEN_PARTS
from plate_inspect.errors import BundleError


def stored(path, rec, kind):
    """The tensor as written on disk, read on its own (the oracle)."""
    return load_file(str(path / rec.file))[f"{rec.name}.{kind}"]


def test_a_replaced_part_file_is_read_anew(tmp_path):
    old = write_fake_bundle(tmp_path / "old", 2, SMALL_TYPES, seed=0)
    new = write_fake_bundle(tmp_path / "new", 2, SMALL_TYPES, seed=1)
    bundle = Bundle.load(old)
    rec = next(iter(bundle))
    first = bundle.spectrum(rec.name)
    assert torch.equal(first, stored(old, rec, "spectrum"))
    os.replace(new / rec.file, old / rec.file)  # as a rescan replaces a part: by rename
    again = bundle.spectrum(rec.name)
    assert torch.equal(again, stored(old, rec, "spectrum"))
    assert not torch.equal(again, first)


def test_a_part_truncated_after_a_read_is_reported_damaged(tmp_path):
    path = write_fake_bundle(tmp_path / "b", 1, SMALL_TYPES)
    bundle = Bundle.load(path)
    rec = next(iter(bundle))
    bundle.q(rec.name)
    size = (path / rec.file).stat().st_size
    with open(path / rec.file, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(BundleError, match="damaged|truncated|part file"):
        bundle.q(rec.name)


def test_open_parts_stay_bounded_and_every_read_is_right(tmp_path):
    path = write_fake_bundle(tmp_path / "b", OPEN_PARTS + 3, SMALL_TYPES)
    bundle = Bundle.load(path)
    records = list(bundle)
    assert len({r.file for r in records}) > OPEN_PARTS
    for rec in records + records[::-1]:
        assert torch.equal(bundle.redundancy(rec.name), stored(path, rec, "redundancy"))
        assert len(bundle._open_parts) <= OPEN_PARTS


def test_a_bundle_with_open_parts_copies_and_pickles(tmp_path):
    path = write_fake_bundle(tmp_path / "b", 2, SMALL_TYPES)
    bundle = Bundle.load(path)
    rec = next(iter(bundle))
    bundle.spectrum(rec.name)
    for twin in (copy.deepcopy(bundle), pickle.loads(pickle.dumps(bundle))):
        assert torch.equal(twin.spectrum(rec.name), stored(path, rec, "spectrum"))
