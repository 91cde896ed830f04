"""Scan benchmark on generated checkpoints with real Qwen2.5 shapes (bf16, sharded, power-law spectra).

    python benchmarks/bench_scan.py --shape qwen2.5-7b            # streaming scan: wall time, peak RSS, GB read
    python benchmarks/bench_scan.py --shape qwen2.5-1.5b --gen-layers 2 --floor
                                                                  # + the floor, same layers, same run
    python benchmarks/bench_scan.py --shape qwen2.5-7b --gen-layers 2 --floor --repeat 5
                                                                  # + 5 alternating scan/floor pairs: median ratio
    python benchmarks/bench_scan.py --shape qwen2.5-1.5b --baseline-layers 2
                                                                  # + naive baseline in the same run

The floor is the least any exact scan must do per module: read the weight (with its fingerprint, which
every bundle records), form its Gram matrix on the small side in float32 and take its eigenvalues
(scipy eigvalsh). It reads one module ahead in a thread, as the scan does: where the checkpoint comes from
disk rather than the page cache, a floor that read in line would wait on the disk and flatter the ratio.
``--floor`` runs it on the scanned layers in a separate process and prints scan/floor.
Both clocks start after the one-time library imports (torch, scipy; the scan's health metrics import
sklearn on first use, warmed up before the clock and printed separately).

The checkpoint is generated once under --workdir (reused if present). Each measured run is a separate
process, so peak RSS belongs to that run alone. The naive baseline loads the whole state dict and runs a
full d_in x d_in eigh per module (on the first --baseline-layers layers, since it is slow); the streaming
scan is timed on the same layers and on the whole model.
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
from statistics import median

from plate_inspect.cli.main import SCAN_RUNTIME_ENV

SHAPES = {
    # Qwen2.5 configs: hidden, intermediate, layers, q heads, kv heads
    "qwen2.5-7b": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4),
    "qwen2.5-1.5b": dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2),
    "qwen2.5-0.5b": dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2),
    # not a real model: the dry run of scripts/device_checks.sh (SMALL=1) runs the benchmarks' code paths on it
    "tiny": dict(hidden=256, intermediate=704, layers=2, heads=4, kv_heads=2, vocab=1024),
}

_SCAN = """
import json, sys, time
import plate_inspect
from plate_inspect.scanner import peak_rss_bytes
from plate_inspect.health import health_record
src, out, layers, device = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
layers = None if layers == "all" else list(range(int(layers)))
t = time.perf_counter()
health_record([3.0, 2.0, 1.0], [3, 3])  # one-time library imports (sklearn, scipy.optimize), as the floor's are
imports = time.perf_counter() - t
t = time.perf_counter()
b = plate_inspect.scan(src, out, r=64, tau=0.9, max_rank=512, layers=layers, overwrite=True, device=device)
wall = time.perf_counter() - t
s = b.stats()
print(json.dumps({"wall_s": wall, "peak_rss": peak_rss_bytes(), "bytes_read": s["bytes_read"], "modules": len(b),
                  "mean_k": sum(r.k for r in b) / len(b), "imports_s": imports}))
"""

_FLOOR = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np, scipy.linalg
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.scanner import peak_rss_bytes
from plate_inspect.targets import load_target, select_targets
src, layers = sys.argv[1], sys.argv[2]
layers = None if layers == "all" else list(range(int(layers)))
t = time.perf_counter()
ckpt = Checkpoint.open(src)
targets, _ = select_targets(ckpt, None, layers)
with ThreadPoolExecutor(max_workers=1) as reader:  # read (+ fingerprint) one module ahead, as the scan does
    upcoming = reader.submit(load_target, ckpt, targets[0])
    for i in range(len(targets)):  # Gram on the small side, its eigenvalues: nothing else
        w = upcoming.result()[0]
        upcoming = reader.submit(load_target, ckpt, targets[i + 1]) if i + 1 < len(targets) else None
        w = w.float().numpy()
        gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
        scipy.linalg.eigvalsh(gram, driver="evd", overwrite_a=True, check_finite=False)
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "peak_rss": peak_rss_bytes(), "bytes_read": ckpt.bytes_read,
                  "modules": len(targets)}))
"""

_BASELINE = """
import json, sys, time, torch
from pathlib import Path
from safetensors.torch import load_file
from plate_inspect.scanner import peak_rss_bytes
src, n_layers = Path(sys.argv[1]), int(sys.argv[2])
t = time.perf_counter()
state = {}
for f in sorted(src.glob("*.safetensors")):
    state.update(load_file(str(f)))
load_s = time.perf_counter() - t
names = [n for n in state if n.endswith("proj.weight") and int(n.split(".")[2]) < n_layers]
for n in names:   # naive: whole matrix in float32, exact cosines over all rows, full d_in x d_in eigh
    w = state[n].float()
    u = w / w.norm(dim=1, keepdim=True)
    scores = (u @ u[:: max(1, w.shape[0] // 256)].T).abs().mean(1)
    b = scores.topk(min(64, int(0.9 * w.shape[0]))).indices
    keep = torch.ones(w.shape[0], dtype=torch.bool); keep[b] = False
    wf = w[keep]
    evals, evecs = torch.linalg.eigh(wf.T @ wf)
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "load_s": load_s, "peak_rss": peak_rss_bytes(), "modules": len(names),
                  "bytes_read": sum(t.numel() * t.element_size() for t in state.values())}))
"""


#: Every measured process runs as `plate-inspect scan` runs: with the runtime settings the CLI makes before torch
#: loads (passive OpenMP waiting, short OpenBLAS spinning, huge pages for torch tensors), unless set in this
#: environment. The floor gets them too: its upcast is a torch tensor and its Gram and eigvalsh run in NumPy's and
#: SciPy's OpenBLAS, and these settings speed it up as they speed up the scan.
RUN_ENV = {key: os.environ.get(key, value) for key, value in SCAN_RUNTIME_ENV.items()}


def run_py(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(res: dict) -> str:
    return (
        f"{res['wall_s']:8.1f} s  peak RSS {res['peak_rss'] / 2**30:6.2f} GiB  read {res['bytes_read'] / 1e9:6.2f} GB"
        f"  modules {res['modules']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--workdir", type=Path, default=Path(".bench"))
    ap.add_argument("--baseline-layers", type=int, default=0, help="also run the naive baseline on N layers")
    ap.add_argument("--scan-layers", default="all", help="'all' or N: scan only the first N layers")
    ap.add_argument("--gen-layers", type=int, default=None, help="generate only N layers of the shape")
    ap.add_argument("--alpha", type=float, default=0.5, help="power-law exponent of the weights' singular values")
    ap.add_argument("--floor", action="store_true", help="also measure the floor on the scanned layers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=1, help="N > 1: N more scan/floor pairs, alternating; median ratio")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = ap.parse_args()

    from plate_inspect.testing.synthetic import write_llama_like

    shape = {"vocab": 152064} | SHAPES[args.shape] | ({"layers": args.gen_layers} if args.gen_layers else {})
    ckpt_dir = args.workdir / f"{args.shape}-{shape['layers']}l-a{args.alpha:g}"
    if not (ckpt_dir / "model.safetensors.index.json").exists():
        t = time.perf_counter()
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        write_llama_like(
            ckpt_dir,
            model_type="qwen2",
            max_shard_bytes=4 * 10**9,
            spectrum_alpha=args.alpha,
            **shape,
        )
        print(f"generated {args.shape} checkpoint in {time.perf_counter() - t:.0f} s -> {ckpt_dir}")
    size = sum(f.stat().st_size for f in ckpt_dir.glob("*.safetensors"))
    print(f"checkpoint: {args.shape}, {size / 1e9:.2f} GB on disk, {len(list(ckpt_dir.glob('*.safetensors')))} shards")

    if args.baseline_layers:
        n = str(args.baseline_layers)
        base = run_py(_BASELINE, str(ckpt_dir), n, env=RUN_ENV)
        stream = run_py(_SCAN, str(ckpt_dir), str(args.workdir / "bundle-subset"), n, args.device, env=RUN_ENV)
        print(f"naive baseline, {n} layers (whole state dict loaded in {base['load_s']:.1f} s): {fmt(base)}")
        print(f"streaming scan, {n} layers:                                 {fmt(stream)}")
        print(
            f"ratio baseline/streaming: time {base['wall_s'] / stream['wall_s']:.2f}x, "
            f"peak RSS {base['peak_rss'] / stream['peak_rss']:.2f}x"
        )
    scan_args = (str(ckpt_dir), str(args.workdir / "bundle"), args.scan_layers, args.device)
    floor_args = (str(ckpt_dir), args.scan_layers)
    if args.repeat > 1:  # scan and floor alternate, so that drifts of the machine hit both alike
        walls = {"scan": [], "floor": []}
        for _ in range(args.repeat):
            walls["scan"].append(run_py(_SCAN, *scan_args, env=RUN_ENV)["wall_s"])
            walls["floor"].append(run_py(_FLOOR, *floor_args, env=RUN_ENV)["wall_s"])
        ratios = sorted(s / f for s, f in zip(walls["scan"], walls["floor"], strict=True))
        for name, values in walls.items():
            runs = " ".join(f"{v:.1f}" for v in values)
            print(f"{name:5s} x{args.repeat}: {runs} s (median {median(values):.1f})")
        print(f"scan / floor per pair: {' '.join(f'{r:.2f}' for r in ratios)}x; median {median(ratios):.2f}x")
    full = run_py(_SCAN, *scan_args, env=RUN_ENV)
    n_layers = shape["layers"] if args.scan_layers == "all" else int(args.scan_layers)
    print(f"streaming scan, {args.scan_layers} layers: {fmt(full)}  mean k {full['mean_k']:.1f}")
    print(f"  (one-time library imports before the clock: {full['imports_s']:.1f} s, left out as for the floor)")
    print(f"  (every run with {' '.join(f'{k}={v}' for k, v in RUN_ENV.items())}, as `plate-inspect scan` sets them)")
    print(f"  per layer: {full['wall_s'] / n_layers:.2f} s")
    if args.floor:
        floor = run_py(_FLOOR, *floor_args, env=RUN_ENV)
        print(f"floor (read + small-side Gram + eigvalsh), same layers: {fmt(floor)}")
        ratio = full["wall_s"] / floor["wall_s"]
        print(f"  per layer: {floor['wall_s'] / n_layers:.2f} s;  scan / floor = {ratio:.2f}x")
    if not args.keep:
        shutil.rmtree(ckpt_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
