"""What spectral health costs inside a scan: W's own spectrum (an extra small-side Gram + eigvalsh) and the metrics.

Per module shape: the scan's geometry (``plate_geometry``, r=64, tau=0.9, max_rank=512) as the baseline, then
W's spectrum (``matmul`` + ``symmetric_eigvalsh`` on the small side) and ``health_record`` on it, as ratios of the
baseline, in the SAME run. Shapes: MiniLM's (384x384, 1536x384, 384x1536) and 7B-shaped (3584x3584, 18944x3584).

    .venv/bin/python benchmarks/health_cost.py [--skip-7b] [--minilm]

``--minilm`` also scans the embedded MiniLM twice, with the scanner's health call and with it replaced by a no-op,
and prints both wall times and their ratio.
"""

from __future__ import annotations

import argparse
import time

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


def minilm_scan_with_and_without_health() -> None:
    """Wall time of the embedded MiniLM scan with the health call and with it patched out, same process."""
    import tempfile
    from unittest import mock

    from plate_inspect import scan
    from plate_inspect.embedded import default_model_path

    times = {}
    for label in ("without health", "with health", "without health (again)", "with health (again)"):
        with tempfile.TemporaryDirectory() as out:
            patch = mock.patch("plate_inspect.scanner.health_of_weight", lambda w: None) if "without" in label else None
            if patch:
                patch.start()
            try:
                t0 = time.perf_counter()
                scan(default_model_path(), out)
                times[label] = time.perf_counter() - t0
            finally:
                if patch:
                    patch.stop()
        print(f"MiniLM scan {label}: {times[label]:.1f} s")
    off = min(times["without health"], times["without health (again)"])
    on = min(times["with health"], times["with health (again)"])
    print(f"MiniLM scan: health adds {100 * (on / off - 1):.1f}% (best of two each)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--minilm", action="store_true", help="also time a MiniLM scan with and without health")
    args = ap.parse_args()
    if args.minilm:
        minilm_scan_with_and_without_health()
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
    health_of_weight(w)  # the scanner's one call: spectrum + metrics


if __name__ == "__main__":
    main()
