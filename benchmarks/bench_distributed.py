"""Distributed scan benchmark: N torchrun ranks against one process, 1 thread per process in both, same run.

    python benchmarks/bench_distributed.py                      # 2 ranks vs 1 on a generated 8-layer checkpoint
    python benchmarks/bench_distributed.py --ranks 2 --layers 8 --hidden 1024 --intermediate 2816
    python benchmarks/bench_distributed.py --project-only       # per-module cost fit and projections only

Prints the wall time of each run (whole command, startup included, and the scan itself from scan_stats.json),
the ratio 1-process / N-ranks, and checks that the two bundles are byte-identical. Then it times
``plate_geometry`` on quarter-scale copies of the target shapes with one thread, fits
seconds = a * s^2 * l + b * s^3 + c * s * l * 512 (s, l: small and large side of a weight), and projects
single-thread and N-rank times for Qwen2.5-72B and DeepSeek-V3 (a projection:
extrapolated from these shapes on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# [d_out, d_in] and count per model, default PLATE targets (attention + MLP / experts; no router, no embeddings)
QWEN25_7B = {"q/o": ((3584, 3584), 2 * 28), "k/v": ((512, 3584), 2 * 28), "gate/up": ((18944, 3584), 2 * 28),
             "down": ((3584, 18944), 28)}  # fmt: skip
QWEN25_72B = {"q/o": ((8192, 8192), 2 * 80), "k/v": ((1024, 8192), 2 * 80), "gate/up": ((29568, 8192), 2 * 80),
              "down": ((8192, 29568), 80)}  # fmt: skip
DEEPSEEK_V3 = {
    "q_a_proj": ((1536, 7168), 61),
    "q_b_proj": ((24576, 1536), 61),
    "kv_a_proj_with_mqa": ((576, 7168), 61),
    "kv_b_proj": ((32768, 512), 61),
    "o_proj": ((7168, 16384), 61),
    "dense gate/up (3 layers)": ((18432, 7168), 2 * 3),
    "dense down (3 layers)": ((7168, 18432), 3),
    "expert gate/up (58 x 257)": ((2048, 7168), 2 * 58 * 257),
    "expert down (58 x 257)": ((7168, 2048), 58 * 257),
}
# Quarter-scale copies of the target shapes above (same aspect ratios), plus squares: what the fit is made of.
FIT_SHAPES = [(2048, 2048), (256, 2048), (7392, 2048), (2048, 7392), (384, 1792), (6144, 384), (1792, 4096),
              (512, 1792), (1792, 512), (1024, 1024), (3072, 3072)]  # fmt: skip

_GEOMETRY_TIMES = """
import json, sys, time, torch
from plate_inspect.geometry import plate_geometry
from plate_inspect.testing.synthetic import structured_weight
torch.set_num_threads(1)
out = []
for d_out, d_in in json.loads(sys.argv[1]):
    w, _ = structured_weight(d_out, d_in, torch.Generator().manual_seed(0), planted=d_out // 10)
    best = float("inf")
    for _ in range(2):
        x = w.clone()
        t = time.perf_counter()
        plate_geometry(x, 64, 0.9, 512, overwrite_input=True)
        best = min(best, time.perf_counter() - t)
    out.append([d_out, d_in, best])
print(json.dumps(out))
"""


def env_one_thread() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return {**env, **ONE_THREAD}


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env_one_thread(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def same_bundle(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.name != "scan_stats.json")
    return names == sorted(p.name for p in b.iterdir() if p.name != "scan_stats.json") and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def compare(args: argparse.Namespace) -> None:
    from plate_inspect.testing.synthetic import write_llama_like

    work = Path(args.workdir)
    ckpt = work / f"ckpt-{args.layers}x{args.hidden}x{args.intermediate}"
    if not ckpt.exists():
        write_llama_like(ckpt, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                         heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256), max_shard_bytes=200 << 20,
                         planted_fraction=0.05)  # fmt: skip
    exe = shutil.which("plate-inspect", path=str(Path(sys.executable).parent)) or "plate-inspect"
    single, multi = work / "single", work / f"ranks{args.ranks}"
    common = ["scan", str(ckpt), "--r", "64", "--quiet", "--overwrite"]
    t1 = timed([exe, *common, "--out", str(single)])
    tn = timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
                "--no-python", "--", exe, *common, "--out", str(multi)])  # fmt: skip
    s1 = json.loads((single / "scan_stats.json").read_text())
    sn = json.loads((multi / "scan_stats.json").read_text())
    print(f"checkpoint: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{s1['modules_scanned']} modules, 1 thread per process")  # fmt: skip
    print(f"{'run':<28}{'command wall s':>16}{'scan wall s':>14}")
    print(f"{'1 process':<28}{t1:>16.1f}{s1['wall_seconds']:>14.1f}")
    print(f"{f'{args.ranks} torchrun ranks':<28}{tn:>16.1f}{sn['wall_seconds']:>14.1f}")
    scan_ratio = s1["wall_seconds"] / sn["wall_seconds"]
    print(f"ratio 1 process / {args.ranks} ranks: command {t1 / tn:.2f}x, scan {scan_ratio:.2f}x")
    loads = [r["wall_seconds"] for r in sn["ranks"]]
    print(f"per-rank scan seconds: {', '.join(f'{x:.1f}' for x in loads)}; bundles byte-identical: "
          f"{same_bundle(single, multi)}")  # fmt: skip


def features(d_out: int, d_in: int) -> list[float]:
    """Per-module work terms: the Gram matrix on the small side, its eigensolve, products with a 512-wide basis."""
    small, large = min(d_out, d_in), max(d_out, d_in)
    return [float(small) ** 2 * large, float(small) ** 3, float(small) * large * 512]


def project(args: argparse.Namespace) -> None:
    import numpy as np
    from scipy.optimize import nnls

    proc = subprocess.run([sys.executable, "-c", _GEOMETRY_TIMES, json.dumps(FIT_SHAPES)], env=env_one_thread(),
                          capture_output=True, text=True, check=True)  # fmt: skip
    rows = json.loads(proc.stdout)
    feats = np.array([features(o, i) for o, i, _ in rows])
    secs = np.array([t for *_, t in rows])
    coef, _ = nnls(feats / secs[:, None], np.ones(len(rows)))  # non-negative, fit on relative error
    print("\nper-module plate_geometry, 1 thread (this machine):")
    for (o, i, t), f in zip(rows, feats, strict=True):
        print(f"  {o:>5} x {i:<5} {t:7.2f} s   fit {float(coef @ f):7.2f} s")
    print(f"fit: seconds = {coef[0]:.3e} * s^2*l + {coef[1]:.3e} * s^3 + {coef[2]:.3e} * s*l*512")

    def fitted_seconds(model: dict) -> float:
        return sum(n * float(coef @ features(*s)) for s, n in model.values())

    seven_b = fitted_seconds(QWEN25_7B)
    print(f"CHECK Qwen2.5-7B: 196 modules, {seven_b / 3600:.2f} single-thread CPU hours by the fit (compare a measured"
          " 7B scan)")  # fmt: skip
    for name, model in (("Qwen2.5-72B", QWEN25_72B), ("DeepSeek-V3 (bf16-dequantized)", DEEPSEEK_V3)):
        total = fitted_seconds(model)
        modules = sum(n for _, n in model.values())
        print(f"PROJECTION {name}: {modules} modules, {total / 3600:.1f} single-thread CPU hours; "
              f"{total / 3600 / args.project_ranks:.2f} h on {args.project_ranks} one-thread ranks; "
              f"{total / seven_b:.1f}x Qwen2.5-7B's work")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--workdir", default="/tmp/plate-bench-distributed")
    p.add_argument("--project-only", action="store_true")
    p.add_argument("--project-ranks", type=int, default=64, help="Ranks assumed in the projection.")
    args = p.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if not args.project_only:
        compare(args)
    project(args)


if __name__ == "__main__":
    main()
