"""Reading every module's tensors from a MoE-sized bundle: a fresh part-file open per read (what Bundle.tensor did
before session 22) against Bundle's kept handles, and plan_budget end to end (it reads every module's spectrum).

python benchmarks/bench_bundle_reads.py [--layers 2] [--experts 256]

The bundle is written by the test suite's fake-bundle writer (DeepSeek-V3-shaped names: 8 attention/shared modules
and ``experts`` x 3 expert modules per layer, one part file per layer), in a temporary directory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's fake-bundle writer

from plate_inspect.bundle import Bundle  # noqa: E402
from plate_inspect.plan import plan_budget  # noqa: E402
from tests.helpers_reports import write_fake_bundle  # noqa: E402

DENSE = {
    "self_attn.q_a_proj": (48, 64),
    "self_attn.q_b_proj": (96, 48),
    "self_attn.kv_a_proj_with_mqa": (40, 64),
    "self_attn.kv_b_proj": (128, 32),
    "self_attn.o_proj": (64, 96),
    "mlp.shared_experts.gate_proj": (32, 64),
    "mlp.shared_experts.up_proj": (32, 64),
    "mlp.shared_experts.down_proj": (64, 32),
}
EXPERTS = {"gate_proj": (16, 64), "up_proj": (16, 64), "down_proj": (64, 16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_fake_bundle(Path(tmp) / "b", args.layers, DENSE, experts=EXPERTS, n_experts=args.experts)
        bundle = Bundle.load(path)
        records = list(bundle)

        t = time.perf_counter()
        for rec in records:  # the old read: one safe_open (a whole header parse) per tensor
            with safe_open(str(path / rec.file), framework="pt") as f:
                f.get_tensor(f"{rec.name}.spectrum")
        fresh = time.perf_counter() - t

        t = time.perf_counter()
        for rec in records:
            bundle.spectrum(rec.name)
        kept = time.perf_counter() - t

        t = time.perf_counter()
        plan_budget(Bundle.load(path), "1%")
        plan = time.perf_counter() - t
    n = len(records)
    print(
        f"{n} modules in {len({r.file for r in records})} part files: spectrum reads {fresh * 1e3 / n:.3f} ms/module "
        f"with a fresh open each, {kept * 1e3 / n:.3f} ms/module through Bundle (ratio {fresh / kept:.1f}x); "
        f"plan_budget(bundle, '1%') {plan:.2f} s"
    )


if __name__ == "__main__":
    main()
