"""What spectral health costs inside a scan: W's own spectrum (an extra small-side Gram + eigvalsh) and the metrics.

Per module shape: the scan's geometry (``plate_geometry``, r=64, tau=0.9, max_rank=512) as the baseline, then
W's spectrum (``matmul`` + ``symmetric_eigvalsh`` on the small side) and ``health_record`` on it, as ratios of the
baseline, in the SAME run. Shapes: MiniLM's (384x384, 1536x384, 384x1536) and 7B-shaped (3584x3584, 18944x3584).

    .venv/bin/python benchmarks/health_cost.py [--skip-7b] [--minilm]

``--minilm`` also times the embedded MiniLM scan as it is (health from W_frozen's spectrum, which the scan already
has) and with W's own health (``plate_inspect.health.health_of_weight``: one more small-side Gram, eigvalsh and the
metrics) computed per module besides, twice each alternately, and prints the wall times and the best-of-two ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

from plate_inspect.geometry import plate_geometry
from plate_inspect.health import health_of_weight, health_record, weight_spectrum
from plate_inspect.testing.synthetic import structured_weight


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@contextmanager
def w_health_per_module() -> Iterator[list[dict]]:
    """Inside: every scan also computes W's own health per module (``health_of_weight`` on the upcast weight, before
    the geometry consumes it), as a scan recording W's health would; yields the list the records are appended to."""
    from plate_inspect import scanner

    compute_weight = scanner._compute_weight
    records: list[dict] = []

    def with_w_health(*args, **kwargs):
        weight = compute_weight(*args, **kwargs)
        records.append(health_of_weight(weight))
        return weight

    with mock.patch.object(scanner, "_compute_weight", with_w_health):
        yield records


def scan_with_and_without_w_health(model, rounds: int = 2, **scan_kwargs) -> dict[str, float]:
    """Best wall time of ``rounds`` scans of ``model`` without and with W's own health per module (alternating, same
    process; ``scan_kwargs`` go to ``scan``), printed as it goes; returns {"without": s, "with": s, "modules": n}."""
    from plate_inspect import scan

    best = {"without": float("inf"), "with": float("inf")}
    modules = 0
    for i in range(rounds):
        for label in ("without", "with"):
            with tempfile.TemporaryDirectory() as out, contextlib.ExitStack() as stack:
                records = stack.enter_context(w_health_per_module()) if label == "with" else []
                t0 = time.perf_counter()
                bundle = scan(model, out, **scan_kwargs)
                seconds = time.perf_counter() - t0
            modules = len(bundle.modules)
            if label == "with" and len(records) != modules:
                raise RuntimeError(f"W's health was computed for {len(records)} of {modules} modules")
            best[label] = min(best[label], seconds)
            print(f"scan {label} W's health, round {i + 1}: {seconds:.2f} s ({modules} modules)")
    print(
        f"scan: {best['without']:.2f} s without, {best['with']:.2f} s with W's health per module "
        f"({100 * (best['with'] / best['without'] - 1):+.1f}%, best of {rounds} each)"
    )
    return {**best, "modules": modules}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument(
        "--minilm", action="store_true", help="also time a MiniLM scan without and with W's own health per module"
    )
    args = ap.parse_args()
    if args.minilm:
        from plate_inspect.embedded import default_model_path

        print("MiniLM (embedded):")
        scan_with_and_without_w_health(default_model_path())
    shapes = [(384, 384), (1536, 384), (384, 1536)] + ([] if args.skip_7b else [(3584, 3584), (18944, 3584)])
    print(f"torch threads {torch.get_num_threads()}")
    print(f"{'shape':>14} {'geometry s':>11} {'W spectrum s':>13} {'ratio':>7} {'metrics s':>10} {'ratio':>7}")
    for d_out, d_in in shapes:
        w, _ = structured_weight(d_out, d_in, torch.Generator().manual_seed(0))
        reps = 3 if d_out * d_in < 1e6 else 1
        t_geo = timed(lambda w=w: plate_geometry(w.clone(), 64, 0.9, 512), reps)
        t_spec = timed(lambda w=w: weight_spectrum(w), reps)
        spec = weight_spectrum(w)
        t_health = timed(lambda spec=spec, w=w: health_record(spec, w.shape, "W"), reps)
        print(
            f"{d_out:>6}x{d_in:<7} {t_geo:>11.3f} {t_spec:>13.3f} {t_spec / t_geo:>7.2f} {t_health:>10.3f} "
            f"{t_health / t_geo:>7.2f}"
        )


if __name__ == "__main__":
    main()
