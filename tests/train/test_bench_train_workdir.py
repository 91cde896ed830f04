"""benchmarks/bench_train.py --workdir: a workdir made with other sizes or scan settings is rebuilt.

It reused whatever model and bundles the workdir held: ``--hidden 32`` after a run with ``--hidden 64`` measured the
hidden-64 model under a header saying 32 (trainable counts of the old model, LoRA's matched rank computed for the
new one). Oracle: the saved model's config and the bundle's manifest against the arguments given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from plate_inspect.bundle import Bundle

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(**kw) -> argparse.Namespace:
    base = {"hidden": 32, "intermediate": 48, "layers": 1, "vocab": 64, "seq": 8, "tau": 0.8, "max_rank": 8}
    return argparse.Namespace(ranks=[2], **{**base, **kw})


def _made_for(root: Path, bundle: str) -> tuple[int, float, int]:
    config = json.loads((root / "model" / "config.json").read_text())
    settings = Bundle.load(bundle).manifest.settings
    return config["hidden_size"], settings.tau, settings.max_rank


def test_workdir_follows_the_arguments(tmp_path):
    bench = _bench()
    assert _made_for(tmp_path, bench.prepare(_args(), tmp_path)[2]) == (32, 0.8, 8)
    assert _made_for(tmp_path, bench.prepare(_args(hidden=48), tmp_path)[2]) == (48, 0.8, 8)
    assert _made_for(tmp_path, bench.prepare(_args(hidden=48, tau=0.7), tmp_path)[2]) == (48, 0.7, 8)
    # same settings: kept as they are (no rescan)
    manifest = tmp_path / "bundle_r2" / "manifest.json"
    before = manifest.stat().st_mtime_ns
    bench.prepare(_args(hidden=48, tau=0.7), tmp_path)
    assert manifest.stat().st_mtime_ns == before
