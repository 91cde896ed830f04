"""How much the paper's random-projection redundancy score changes B, on the real MiniLM.

    python benchmarks/sketch_overlap.py [--sketch-dim 128] [--r 64] [--seeds 3]

Prints the overlap of the top-r set of the sketched score with the exact one, over all 36 target modules.
"""

from __future__ import annotations

import argparse
import statistics

from plate_inspect.checkpoint import Checkpoint
from plate_inspect.embedded import default_model_path
from plate_inspect.geometry import redundancy_scores, select_redundant_rows
from plate_inspect.targets import select_targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sketch-dim", type=int, default=128)
    ap.add_argument("--r", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    ckpt = Checkpoint.open(default_model_path())
    targets, _ = select_targets(ckpt)
    overlaps = []
    for target in targets:
        w = ckpt.read(target.tensor.name)[0].float()
        exact = set(select_redundant_rows(redundancy_scores(w), args.r).tolist())
        for seed in range(args.seeds):
            sketched = redundancy_scores(w, sketch_dim=args.sketch_dim, seed=seed)
            overlaps.append(len(exact & set(select_redundant_rows(sketched, args.r).tolist())) / args.r)
    print(
        f"MiniLM, {len(targets)} modules x {args.seeds} seeds, r={args.r}: top-r overlap of the d'={args.sketch_dim} "
        f"sketch with the exact score: mean {statistics.mean(overlaps):.3f}, min {min(overlaps):.3f}, "
        f"max {max(overlaps):.3f}"
    )


if __name__ == "__main__":
    main()
