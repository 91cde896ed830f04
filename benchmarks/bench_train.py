"""Training step time and peak memory: PEFT ``plate`` (bundle-backed) vs PEFT LoRA on a Qwen2-architecture model.

A randomly initialised transformers Qwen2ForCausalLM (hidden 1024, intermediate 2816, 4 layers, 16 heads, 2 KV heads,
vocab 8192 by default), saved and scanned (tau 0.9, max_rank 512) at r = 16 and 64. Adapters on all seven
projections; AdamW; batch 4 x 256 tokens. Methods: PLATE at r, LoRA at the same r, and LoRA at the rank whose
trainable parameter count matches PLATE's. Step times are medians over interleaved repetitions (one step of each
method in turn), so ratios are measured in the same run under the same load. Peak memory: on CUDA
``max_memory_allocated`` per method; on CPU the peak RSS growth of a fresh subprocess per method over its state
after building the model (training memory: activations, gradients, optimizer state).

CPU:  python benchmarks/bench_train.py
GPU:  python benchmarks/bench_train.py --device cuda --dtype bfloat16 --reps 20
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def qwen2(args: argparse.Namespace):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def workdir_settings(args: argparse.Namespace) -> dict[str, object]:
    """What the model and bundles in a workdir are made from (``--workdir`` reuses them only while it holds)."""
    model = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab", "seq")}
    return {"model": model, "tau": args.tau, "max_rank": args.max_rank}


def prepare(args: argparse.Namespace, root: Path) -> dict[int, str]:
    """Save the model once and scan a bundle per r; returns {r: bundle path}.

    A workdir made with other sizes or scan settings is rebuilt (its model and bundles were reused as they were:
    ``--hidden 32`` measured the earlier run's hidden-1024 model under a header saying 32).
    """
    from plate_inspect import scan

    model_dir = root / "model"
    stamp = root / "settings.json"
    want = workdir_settings(args)
    have = json.loads(stamp.read_text()) if stamp.exists() else {}
    new_model = have.get("model") != want["model"] or not (model_dir / "config.json").exists()
    new_bundles = new_model or have.get("tau") != want["tau"] or have.get("max_rank") != want["max_rank"]
    if new_model:
        stamp.unlink(missing_ok=True)  # a run stopped half way leaves no stamp: the next one rebuilds
        qwen2(args).save_pretrained(model_dir, safe_serialization=True)
    bundles = {}
    for r in args.ranks:
        out = root / f"bundle_r{r}"
        if new_bundles or not (out / "manifest.json").exists():
            scan(model_dir, out, r=r, tau=args.tau, max_rank=args.max_rank, overwrite=True)
        bundles[r] = str(out)
    stamp.write_text(json.dumps(want))
    return bundles


PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(method: str, r: int, bundle: str, args: argparse.Namespace, root: Path):
    """(peft model, optimizer, trainable count) for ``plate`` or ``lora`` at rank r."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from plate_inspect.train.peft import PlateConfig

    dtype = torch.bfloat16 if (args.dtype == "bfloat16" and args.device == "cpu" and args.bf16_weights) else None
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=dtype or torch.float32)
    if method == "plate":
        cfg = PlateConfig(bundle=bundle, rho=0.5, task_type="CAUSAL_LM")
    else:
        cfg = LoraConfig(r=r, lora_alpha=r, lora_dropout=0.0, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    pm = get_peft_model(model, cfg).to(args.device)
    params = [p for p in pm.parameters() if p.requires_grad]
    if method == "plate":  # A starts at zero; a nonzero A makes the step do the same work it does later
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.01)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return pm, opt, sum(p.numel() for p in params)


def batch(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)


def step(pm, opt, ids: torch.Tensor, args: argparse.Namespace) -> float:
    """One AdamW step; returns its time in seconds: wall time on CUDA, CPU time of this process on CPU.

    On a CPU shared with other jobs, the process's CPU time (all torch threads) is far steadier than wall time.
    """
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    clock = time.perf_counter if args.device == "cuda" else time.process_time
    sync()
    t = clock()
    if args.dtype == "bfloat16":
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = pm(input_ids=ids, labels=ids).loss
    else:
        loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return clock() - t


def matched_lora_rank(trainable: int, args: argparse.Namespace) -> int:
    """The LoRA rank whose trainable parameter count is closest to ``trainable`` on the same projections."""
    h, i, kv = args.hidden, args.intermediate, args.hidden // 16 * 2
    per_rank = args.layers * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))
    return max(1, round(trainable / per_rank))


#: glibc serves allocations of at least this many bytes with their own mmap and unmaps them when freed, so the
#: child's peak RSS is the peak of live tensors. With glibc's default (adaptive) threshold freed blocks stay in the
#: heap and the figure depends on fragmentation: PLATE's r=16 peak read 368-613 MiB across runs, and 467 MiB in
#: every run with this setting (session 12). A value already in the environment is kept.
MMAP_THRESHOLD = "131072"


def memory_child(args: argparse.Namespace, method: str, r: int, bundle: str, root: Path) -> int:
    """Peak training memory of one method in bytes (CPU: RSS growth in a fresh process)."""
    cmd = [sys.executable, __file__, "--child", json.dumps([method, r, bundle, str(root)]), *sys.argv[1:]]
    return child_peak_bytes([c for c in cmd if c != "--memory"])


def child_peak_bytes(cmd: list[str]) -> int:
    """Run a benchmark's child process (with :data:`MMAP_THRESHOLD`) and read the byte count its last line prints."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rss_growth(work: Callable[[], object]) -> int:
    """Bytes this process's peak resident set grows by while ``work()`` runs (VmHWM reset via /proc/self/clear_refs)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident set size (VmHWM) to the current one
    base = _status_kib("VmRSS")
    work()
    return (_status_kib("VmHWM") - base) * 1024


def run_child(args: argparse.Namespace) -> None:
    """Peak RSS growth over two training steps, after the model is built."""
    method, r, bundle, root = json.loads(args.child)
    pm, opt, _ = build(method, r, bundle, args, Path(root))
    ids = batch(args)
    print(peak_rss_growth(lambda: [step(pm, opt, ids, args) for _ in range(2)]))


def saved_activation_bytes(pm, ids: torch.Tensor, args: argparse.Namespace) -> int:
    """Bytes of distinct tensors autograd saves for backward during one forward (activation memory, exact).

    Parameters and buffers (weights, Q, B) are not counted: they are in memory whether or not autograd saves them.
    """
    seen: dict[tuple[int, int], int] = {}
    resident = {t.untyped_storage().data_ptr() for t in [*pm.parameters(), *pm.buffers()]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if t.device.type != "meta" and st.data_ptr() not in resident:
            seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if args.dtype == "bfloat16":
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = pm(input_ids=ids, labels=ids).loss
        else:
            loss = pm(input_ids=ids, labels=ids).loss
    del loss
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    ap.add_argument("--bf16-weights", action="store_true", help="CPU bf16: also load the base weights in bf16")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--max-rank", type=int, default=512)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--reps", type=int, default=5, help="timed steps per method (0: memory only)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per method first")
    ap.add_argument("--memory", action="store_true", help="also measure peak memory (CPU: one subprocess per method)")
    ap.add_argument("--workdir", default=None, help="keep the model and bundles here between runs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(args)
        return
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_train_"))
    root.mkdir(parents=True, exist_ok=True)
    bundles = prepare(args, root)
    print(
        f"torch {torch.__version__}, device {args.device}, dtype {args.dtype}, threads {torch.get_num_threads()}; "
        f"Qwen2 hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}; "
        f"batch {args.batch} x {args.seq}; tau {args.tau}, max_rank {args.max_rank}"
    )
    ids = batch(args)
    for r in args.ranks:
        plate = build("plate", r, bundles[r], args, root)
        r_match = matched_lora_rank(plate[2], args)
        methods = {"plate": plate, "lora": build("lora", r, bundles[r], args, root)}
        methods[f"lora_r{r_match}"] = build("lora", r_match, bundles[r], args, root)
        times: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.warmup if args.reps or args.device == "cuda" else 0):
            for pm, opt, _ in methods.values():
                step(pm, opt, ids, args)
        for _ in range(args.reps):
            for name, (pm, opt, _) in methods.items():
                times[name].append(step(pm, opt, ids, args))
        med = {m: statistics.median(t) for m, t in times.items() if t}
        saved = {name: saved_activation_bytes(pm, ids, args) for name, (pm, _, _) in methods.items()}
        mem = {}
        if args.memory:
            for name, (pm, opt, _) in methods.items():
                rank = r if name in ("plate", "lora") else r_match
                method = "plate" if name == "plate" else "lora"
                if args.device == "cuda":  # optimizer state exists after the warm-up: this is the step's own peak
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    step(pm, opt, ids, args)
                    mem[name] = torch.cuda.max_memory_allocated() - before
                else:
                    mem[name] = memory_child(args, method, rank, bundles[r], root)
        print(
            f"\nr = {r}: trainable PLATE {plate[2]:,}, LoRA {methods['lora'][2]:,}, LoRA r={r_match} (matched) "
            f"{methods[f'lora_r{r_match}'][2]:,}"
        )
        for name in methods:
            line = f"  {name:10s}"
            if args.reps:
                t = med[name]
                clock = "wall" if args.device == "cuda" else "CPU"
                line += f" step {t * 1000:8.1f} ms {clock} (median of {args.reps})  PLATE/this {med['plate'] / t:5.3f}"
            line += (
                f"  saved activations {saved[name] / 2**20:7.1f} MiB  PLATE/this {saved['plate'] / saved[name]:5.3f}"
            )
            if mem:
                ratio = mem["plate"] / max(mem[name], 1)
                line += f"  peak training memory {mem[name] / 2**20:8.1f} MiB  PLATE/this {ratio:5.3f}"
            print(line)
        del methods, plate


if __name__ == "__main__":
    main()
