"""Training cost of PLATE on fused MoE experts (apply_bundle) against peft LoRA's ``target_parameters``.

A Qwen3-MoE model (transformers ``Qwen3MoeForCausalLM``, random init, saved with save_pretrained and scanned) has
its experts held as 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).
Both methods adapt only those experts and both materialize the adapted parameter once per forward (PLATE:
W + rho B A Q^T per expert via ``torch.func.functional_call``; LoRA's ParamWrapper: W + B A per expert through a
parametrization), so the expert forward also computes the weight gradient of every routed expert's full matrix.
Methods: ``plate``; ``lora`` at the same r; ``lora-matched`` at the rank whose trainable count is closest to
PLATE's; ``frozen``: the same step with no adapter and only the embedding trainable (what a step costs without
any expert weight gradient).

Step time: process CPU time of forward + backward + AdamW step, median over interleaved repetitions (one step of
each method in turn; ratios are of those medians). ``--memory``: peak RSS growth over two steps in a fresh process
per method (VmHWM reset after the model is built; glibc's mmap threshold lowered so freed tensors leave the RSS).
No figure here is asserted anywhere: the printout is the result.

    python benchmarks/bench_train_experts.py --reps 5 --memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_train import child_peak_bytes, peak_rss_growth  # this script's folder is on sys.path

METHODS = ("plate", "lora", "lora-matched", "frozen")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--r", type=int, default=16, help="PLATE's r and LoRA's rank")
    p.add_argument("--max-rank", type=int, default=128, help="the scan's max_rank (PLATE's k)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory", action="store_true", help="also measure peak RSS growth per method (fresh processes)")
    p.add_argument("--workdir", default="/tmp/bench_train_experts", help="model and bundle are kept here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args()


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    """The saved model and its bundle (experts only) under the workdir, rebuilt when the settings differ."""
    import transformers

    import plate_inspect

    root = Path(args.workdir)
    settings = {k: getattr(args, k) for k in ("hidden", "moe_intermediate", "experts", "top_k", "layers", "vocab")}
    settings |= {"r": args.r, "max_rank": args.max_rank}
    ckpt, bundle = root / "model", root / "bundle"
    stamp = root / "settings.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings and (bundle / "manifest.json").exists():
        return ckpt, bundle
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
    plate_inspect.scan(
        str(ckpt), out=str(bundle), r=args.r, tau=0.9, max_rank=args.max_rank, overwrite=True,
        target_modules=["mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    stamp.write_text(json.dumps(settings))
    return ckpt, bundle


def lora_trainable(rank: int, args: argparse.Namespace) -> int:
    """LoRA's trainable count on both fused parameters of every layer: E r (d_in + d_out) per parameter."""
    h, i, e = args.hidden, args.moe_intermediate, args.experts
    return args.layers * e * rank * ((h + 2 * i) + (i + h))


def build(method: str, args: argparse.Namespace, ckpt: Path, bundle: Path, plate_count: int = 0):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    if method == "plate":
        from plate_inspect.train.layer import apply_bundle

        params = apply_bundle(model, str(bundle), rho=0.5)
    elif method.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        rank = args.r
        if method == "lora-matched":
            rank = min(range(1, args.r + 1), key=lambda q: abs(lora_trainable(q, args) - plate_count))
        config = LoraConfig(
            r=rank, lora_alpha=rank, target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )  # fmt: skip
        model = get_peft_model(model, config)
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        emb = model.get_input_embeddings().weight
        emb.requires_grad_(True)
        params = [emb]
    model.train()
    return model, torch.optim.AdamW(params, lr=1e-4), sum(p.numel() for p in params)


def batch(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def step(model, opt, ids: torch.Tensor) -> float:
    """One forward + backward + optimizer step; returns its process CPU time in seconds."""
    t0 = time.process_time()
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.process_time() - t0


def run_child(args: argparse.Namespace) -> None:
    """Peak RSS growth over two steps of one method, after its model is built."""
    method, ckpt, bundle, plate_count = json.loads(args.child)
    model, opt, _ = build(method, args, Path(ckpt), Path(bundle), plate_count)
    ids = batch(args)
    print(peak_rss_growth(lambda: [step(model, opt, ids) for _ in range(2)]))


def memory(method: str, args: argparse.Namespace, ckpt: Path, bundle: Path, plate_count: int) -> int:
    child = json.dumps([method, str(ckpt), str(bundle), plate_count])
    return child_peak_bytes([sys.executable, __file__, "--child", child, *[a for a in sys.argv[1:] if a != "--memory"]])


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    if args.child:
        run_child(args)
        return
    ckpt, bundle = prepare(args)
    built = {"plate": build("plate", args, ckpt, bundle)}
    plate_count = built["plate"][2]
    for m in METHODS[1:]:
        built[m] = build(m, args, ckpt, bundle, plate_count)
    ids = batch(args)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep in range(args.warmup + args.reps):
        for m in METHODS:
            t = step(built[m][0], built[m][1], ids)
            if rep >= args.warmup:
                times[m].append(t)
    fused = sum(p.numel() * p.element_size() for n, p in built["frozen"][0].named_parameters() if p.ndim == 3)
    print(
        f"Qwen3-MoE: hidden {args.hidden}, expert intermediate {args.moe_intermediate}, {args.experts} experts "
        f"(top-{args.top_k}), {args.layers} layers, vocab {args.vocab}, batch {args.batch} x {args.seq}, r {args.r}, "
        f"float32, {args.threads} threads; fused expert parameters {fused / 2**20:.1f} MiB (each adapted method "
        "materializes a copy of those per forward)"
    )
    peaks = {m: memory(m, args, ckpt, bundle, plate_count) for m in METHODS} if args.memory else {}
    plate = statistics.median(times["plate"])
    print("| method | trainable | step CPU time (ms) | PLATE/method | peak RSS growth (MiB) | PLATE/method |")
    print("|---|---|---|---|---|---|")
    for m in METHODS:
        med = statistics.median(times[m])
        mem = f"{peaks[m] / 2**20:.0f} | {peaks['plate'] / peaks[m]:.2f}" if peaks else "- | -"
        name = m if m != "lora-matched" else f"lora-matched (r={built[m][0].peft_config['default'].r})"
        print(f"| {name} | {built[m][2]:,} | {1000 * med:.1f} | {plate / med:.3f} | {mem} |")


if __name__ == "__main__":
    main()
