"""Where a module's scan time goes: the floor and each step of plate_geometry, per Qwen2.5 module shape.

    python benchmarks/bench_geometry_steps.py --shape qwen2.5-1.5b            # CPU, best of 3 per module
    python benchmarks/bench_geometry_steps.py --shape qwen2.5-7b --repeat 1
    python benchmarks/bench_geometry_steps.py --shape qwen2.5-7b --device cuda
    python benchmarks/bench_geometry_steps.py --backend torch     # CUDA's code path (torch eigh), here on CPU

One bf16-stored weight per module kind (power-law spectrum sigma_i ~ i^-alpha, Gaussian factors, as in
bench_scan.py), in memory: no checkpoint, no reading, no hashing, no part files. The floor is what
bench_scan's floor computes per module: the float32 Gram matrix on the small side and its eigenvalues (NumPy +
SciPy on CPU, torch on CUDA). plate_geometry runs with the scan's settings (r=64, tau=0.9, max_rank=512) and
every step is timed exclusively (a step's time leaves out the steps it calls); the health metrics, which the
scan computes in its part-writer thread, are timed after it. Per layer: q, k, v, o, gate, up, down.
On CUDA every step synchronises the device before its clock stops, so the steps add up to the wall time.
Runs with the runtime settings of `plate-inspect scan` (set before torch loads, unless already set).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from contextlib import contextmanager

from plate_inspect.cli.main import SCAN_RUNTIME_ENV  # (imports neither torch nor numpy)

for _key, _value in SCAN_RUNTIME_ENV.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
from bench_scan import SHAPES  # noqa: E402  (this script's folder is on sys.path)

from plate_inspect import geometry  # noqa: E402
from plate_inspect.health import health_record  # noqa: E402
from plate_inspect.testing.synthetic import hard_spectrum_weight  # noqa: E402

#: (owner, attribute, label) of every timed step; floor-type steps first.
STEPS = (
    (geometry.FrozenRows, "input_gram", "Gram W_f^T W_f"),
    (geometry.FrozenRows, "output_gram", "Gram W W^T"),
    (geometry, "factor_symmetric", "factorise (sytrd / eigh)"),
    (geometry.TridiagonalEigen, "eigenvalues", "eigenvalues of T"),
    (geometry, "redundancy_scores", "redundancy"),
    (geometry.TridiagonalEigen, "tridiagonal_vectors", "T's bottom vectors (float64)"),
    (geometry, "apply_tridiagonal_reflectors", "back-transform"),
    (geometry, "orthonormalize", "CholeskyQR"),
    (geometry.FrozenRows, "times", "W_f S"),
    (geometry, "rayleigh_ritz", "Ritz (H = Y^T Y, eigh)"),
    (geometry, "symmetric_eigvalsh", "Ritz probe eigvalsh"),
    (geometry, "null_vectors", "null vectors (LU)"),
)
FLOOR_LIKE = {"Gram W_f^T W_f", "Gram W W^T", "factorise (sytrd / eigh)", "eigenvalues of T"}


class StepClock:
    """Exclusive wall time per step label: a wrapped call's time minus that of the wrapped calls inside it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # per open call: time spent in nested wrapped calls

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, fn, label: str):
        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            self._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                total = time.perf_counter() - start
                nested = self._stack.pop()
                self.times[label] += total - nested
                if self._stack:
                    self._stack[-1] += total

        return timed

    @contextmanager
    def installed(self):
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in STEPS]
        for owner, name, label in STEPS:
            setattr(owner, name, self.wrap(getattr(owner, name), label))
        try:
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)


def module_shapes(shape: dict) -> dict[str, tuple[tuple[int, int], int]]:
    """Module kind -> ((d_out, d_in), count per layer)."""
    h, i = shape["hidden"], shape["intermediate"]
    kv = shape["kv_heads"] * (h // shape["heads"])
    return {"q/o": ((h, h), 2), "k/v": ((kv, h), 2), "gate/up": ((i, h), 2), "down": ((h, i), 1)}


def floor_time(weight: torch.Tensor) -> float:
    """The floor's per-module compute: float32 Gram on the small side and its eigenvalues."""
    start = time.perf_counter()
    if weight.device.type == "cpu":
        import scipy.linalg

        w = weight.numpy()
        gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
        scipy.linalg.eigvalsh(gram, driver="evd", overwrite_a=True, check_finite=False)
    else:
        gram = weight.T @ weight if weight.shape[0] >= weight.shape[1] else weight @ weight.T
        torch.linalg.eigvalsh(gram)
        torch.cuda.synchronize(weight.device)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--alpha", type=float, default=0.5, help="power-law exponent of the weights' singular values")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3, help="runs per module; the fastest geometry run is shown")
    ap.add_argument("--backend", choices=("auto", "lapack", "torch"), default="auto", help="plate_geometry's backend")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"{args.shape}, alpha {args.alpha}, {device}, backend {args.backend}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"runtime: {' '.join(f'{k}={os.environ[k]}' for k in SCAN_RUNTIME_ENV)}")
    health_record([3.0, 2.0, 1.0], [3, 3])  # one-time imports (sklearn, scipy.optimize)
    per_layer = defaultdict(float)
    for kind, ((d_out, d_in), count) in module_shapes(SHAPES[args.shape]).items():
        gen = torch.Generator().manual_seed(d_out + d_in)
        stored = hard_spectrum_weight(d_out, d_in, gen, alpha=args.alpha, orthogonal=False).bfloat16()
        best = None
        for _ in range(args.repeat):
            weight = stored.to(device=device, dtype=torch.float32)
            floor = floor_time(weight)
            clock = StepClock(device)
            with clock.installed():
                start = time.perf_counter()
                geo = geometry.plate_geometry(weight, 64, 0.9, 512, overwrite_input=True, backend=args.backend)
                clock.sync()
                wall = time.perf_counter() - start
            start = time.perf_counter()
            health_record(geo.basis.spectrum, (d_out - int(geo.b_idx.numel()), d_in))
            health = time.perf_counter() - start
            if best is None or wall < best[1]:
                best = (floor, wall, health, dict(clock.times), geo.k)
        floor, wall, health, steps, k = best
        floor_like = sum(v for s, v in steps.items() if s in FLOOR_LIKE)
        print(
            f"\n{kind} {d_out}x{d_in} (k={k}, x{count} per layer): floor {floor:.3f} s, geometry {wall:.3f} s "
            f"({wall / floor:.2f}x), health {health:.3f} s; floor-type steps {floor_like:.3f} s, "
            f"the rest {wall - floor_like:.3f} s"
        )
        for label, seconds in sorted(steps.items(), key=lambda kv: -kv[1]):
            tag = "  (floor-type)" if label in FLOOR_LIKE else ""
            print(f"    {label:30s} {seconds:7.3f} s  {seconds / floor:5.2f} x floor{tag}")
        per_layer["floor"] += count * floor
        per_layer["geometry"] += count * wall
        per_layer["health"] += count * health
    f, g, h = per_layer["floor"], per_layer["geometry"], per_layer["health"]
    print(
        f"\nper layer (compute only): floor {f:.2f} s, geometry {g:.2f} s ({g / f:.2f}x), "
        f"+ health {h:.2f} s ({(g + h) / f:.2f}x)"
    )


if __name__ == "__main__":
    main()
