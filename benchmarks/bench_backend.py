"""Why CPU math goes through NumPy/SciPy: Gram products and eigh, torch vs NumPy/SciPy, same run.

python benchmarks/bench_backend.py [--n 3584] [--rows 18944]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.linalg
import torch


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3584, help="Gram side (d_in of a tall module)")
    ap.add_argument("--rows", type=int, default=18944, help="rows of the weight (d_out)")
    args = ap.parse_args()
    w = torch.randn(args.rows, args.n)
    gram = (w.T @ w).contiguous()
    wn, gn = w.numpy(), gram.numpy()
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"numpy {np.__version__}, scipy {scipy.__version__}"
    )
    rows = [
        ("gram W^T W", best_of(lambda: w.T @ w), best_of(lambda: wn.T @ wn)),
        (
            "eigh (values+vectors)",
            best_of(lambda: torch.linalg.eigh(gram), 2),
            best_of(lambda: scipy.linalg.eigh(gn, driver="evd", check_finite=False), 2),
        ),
    ]
    for name, t_torch, t_np in rows:
        print(
            f"{name:24s} [{args.rows}x{args.n}] torch {t_torch:7.2f} s   numpy/scipy {t_np:7.2f} s   "
            f"ratio {t_torch / t_np:5.2f}x"
        )


if __name__ == "__main__":
    main()
