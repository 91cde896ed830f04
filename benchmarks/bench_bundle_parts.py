"""Bundle.mixed_up over every part file of a DeepSeek-V3-sized manifest (no tensors, no disk): what ``info``,
``health``, ``plan`` and ``verify`` pay per bundle for the part-file check (Bundle.check_parts), less the reads.

python benchmarks/bench_bundle_parts.py [--layers 61] [--experts 256] [--experts-per-part 16]

A manifest of ``layers`` layers, each with 7 attention/shared modules in its layer part and ``experts`` x 3 expert
modules in parts of ``experts-per-part`` experts (the defaults: 61 x (7 + 768) = 47,275 modules in 1,037 part files;
``--experts 80`` gives about 15k). Every part holds exactly its modules' tensors, so each call takes the common path
(nothing lacking); one part swapped by hand is timed too (the diagnosis path).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from plate_inspect.bundle import TENSOR_KINDS, Bundle, Manifest, ModuleRecord, ScanSettings

ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_up", "shared_down")


def record(name: str, layer: int, file: str) -> ModuleRecord:
    """A manifest record with made-up numbers: mixed_up reads only name and file."""
    return ModuleRecord(name, "Linear", layer, [8, 8], "linear", "BF16", 4, 4, 1.0, 2.0, 0.5, {}, "sha256:0", file)


def synthetic_bundle(layers: int, experts: int, per_part: int) -> Bundle:
    """A bundle whose manifest alone exists (nothing on disk)."""
    records = []
    for layer in range(layers):
        part = f"layer-{layer:05d}.safetensors"
        records += [record(f"model.layers.{layer}.{m}", layer, part) for m in ATTENTION]
        for e in range(experts):
            part = f"layer-{layer:05d}-experts-{e // per_part:04d}.safetensors"
            records += [
                record(f"model.layers.{layer}.mlp.experts.{e}.{p}", layer, part)
                for p in ("gate_proj", "up_proj", "down_proj")
            ]
    modules = {r.name: r for r in records}
    manifest = Manifest({"kind": "local", "id": "synthetic"}, ScanSettings(), modules, complete=True)
    return Bundle(Path("/nonexistent-bundle"), manifest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--experts-per-part", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    bundle = synthetic_bundle(args.layers, args.experts, args.experts_per_part)
    keys: dict[str, list[str]] = {}
    for rec in bundle:
        keys.setdefault(rec.file, []).extend(f"{rec.name}.{kind}" for kind in TENSOR_KINDS)
    files = sorted(keys)

    best = float("inf")
    for _ in range(args.repeats):
        t = time.perf_counter()
        problems = [bundle.mixed_up(f, keys[f]) for f in files]
        best = min(best, time.perf_counter() - t)
    assert not any(problems), "an intact part was called mixed up"
    a, b = files[1], files[2]  # two parts swapped by hand: each holds the other's tensors
    t = time.perf_counter()
    swapped = bundle.mixed_up(a, keys[b])
    diagnosis = time.perf_counter() - t
    assert swapped.startswith("holds "), swapped
    print(
        f"{len(bundle)} modules in {len(files)} part files: mixed_up over every part {best * 1e3:.1f} ms "
        f"(best of {args.repeats}); one swapped part diagnosed in {diagnosis * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
