"""Experts solved one by one (plate_geometry) vs together (batched_plate_geometry): wall time, same B and k.

    python benchmarks/bench_experts.py [--experts 64] [--d-out 256] [--d-in 512] [--device cpu|cuda]

Prints both times and their ratio, measured in the same run. On CPU the scanner keeps the per-module path
(memory bounded by one module); the batched path is what it uses on CUDA.
"""

from __future__ import annotations

import argparse
import time

import torch

from plate_inspect.batched import batched_plate_geometry
from plate_inspect.geometry import plate_geometry
from plate_inspect.testing.synthetic import structured_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--d-out", type=int, default=256)
    ap.add_argument("--d-in", type=int, default=512)
    ap.add_argument("--r", type=int, default=32)
    ap.add_argument("--max-rank", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = torch.stack([structured_weight(args.d_out, args.d_in, gen)[0] for _ in range(args.experts)])
    weights = weights.to(args.device)
    seeds = list(range(args.experts))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    one = [plate_geometry(w.clone(), args.r, 0.9, args.max_rank, seed=s) for w, s in zip(weights, seeds, strict=True)]
    sync()
    t1 = time.perf_counter()
    batched = batched_plate_geometry(weights, args.r, 0.9, args.max_rank, seeds=seeds)
    sync()
    t2 = time.perf_counter()
    same_b = all(a.b_idx.tolist() == b.b_idx.tolist() for a, b in zip(one, batched, strict=True))
    same_k = all(a.k == b.k for a, b in zip(one, batched, strict=True))
    print(f"{args.experts} experts [{args.d_out} x {args.d_in}] on {args.device}, r={args.r}, max_rank={args.max_rank}")
    print(f"  one by one (plate_geometry, float32): {t1 - t0:.3f} s")
    print(f"  batched (one float64 eigh):           {t2 - t1:.3f} s   ratio one/batched = {(t1 - t0) / (t2 - t1):.2f}")
    print(f"  same B: {same_b}, same k: {same_k}")


if __name__ == "__main__":
    main()
