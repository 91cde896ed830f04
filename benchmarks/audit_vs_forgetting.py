"""Does the audit's model-level score track measured forgetting? Digits 0-4 -> 5-9, many methods and budgets.

Per seed: stage 1 trains the digits MLP on task 1 and saves it (the base); every stage-2 method of the continual
benchmark (Full FT, LoRA r in 1..64, PLATE r x tau, the five matched-capacity ablations) trains on task 2; the
tuned model is merged (LoRA merge_and_unload, PLATE unload) and its weights saved as safetensors; then
``plate_inspect.audit(base, tuned)`` scores it with the DEFAULT settings (B chosen as the scan does, r=64,
tau=0.9: one yardstick for every method, independent of the method's own bundle). Forgetting = task-1 test
accuracy before minus after (points); also the symmetrised task-1 KL.

The model-level score declared before running: ``risk`` = sqrt(sum ||dW P||^2 / sum ||W||^2) over fc1..fc3. Also
printed for comparison: the energy-weighted protected share and frozen-row share (scale-free), and
||dW||/||W|| (the update's size alone, a baseline the score should beat to be worth anything).

    .venv/bin/python benchmarks/audit_vs_forgetting.py --seeds 5 --out /tmp/avf
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from scipy.stats import spearmanr

from plate_inspect.auditing import audit, summarize
from plate_inspect.experiments import continual, digits
from plate_inspect.scanner import scan
from plate_inspect.train.variants import make_variant


def merged_state(method: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tuned model's weights with the adapter merged in, under the base checkpoint's tensor names."""
    if method == "lora":
        model = model.merge_and_unload()
    elif method.startswith("plate"):
        from plate_inspect.train.layer import unload

        model = unload(model, merge=True)
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}


def run(out: Path, seeds: list[int], s: continual.ContinualSettings) -> list[dict]:
    tasks = digits.load_digit_tasks()
    task1, task2 = tasks
    rows = []
    torch.set_num_threads(1)
    for seed in seeds:
        seed_dir = out / f"seed{seed}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        ckpt, acc_before, logits_before = continual.stage1(seed_dir, seed, s, task1)
        for r, t in sorted({(r, t) for r in s.plate_rs for t in s.plate_taus} | {s.ablation}):
            scan(ckpt, seed_dir / f"bundle_r{r}_tau{t:g}", r=r, tau=t, max_rank=s.max_rank, seed=seed,
                 target_modules=list(continual.BACKBONE), overwrite=True)  # fmt: skip
        base_bundle = seed_dir / f"bundle_r{s.ablation[0]}_tau{s.ablation[1]:g}"
        for v in s.variants:
            make_variant(base_bundle, ckpt, v, seed_dir / f"variant_{v}", seed=seed, overwrite=True)
        for method, config in continual.plan_runs(s):
            bundle_path = None
            if method == "plate":
                bundle_path = seed_dir / f"bundle_r{config['r']}_tau{config['tau']:g}"
            elif method.startswith("plate_"):
                bundle_path = seed_dir / f"variant_{config['variant']}"
            model, params, n_train = continual.prepare_method(method, config, ckpt, bundle_path, s)
            digits.train(model, params, task2, 2, s.epochs2, lr=s.lr, batch_size=s.batch_size, seed=seed)
            acc_after = digits.accuracy(model, task1.x_test, task1.y_test, 1)
            kl = continual.symmetric_kl(logits_before, continual.task1_logits(model, task1.x_test))
            tuned = seed_dir / "tuned.safetensors"
            save_file(merged_state(method, model), str(tuned))
            summary = summarize(audit(ckpt, tuned))  # defaults: B as scan chooses (r=64), tau=0.9
            rows.append(
                {
                    "seed": seed,
                    "method": method,
                    "config": continual._config_label(method, config),
                    "trainable_params": n_train,
                    "forgetting": 100 * (acc_before - acc_after),
                    "kl_task1": kl,
                    "risk": summary.risk,
                    "protected_share": summary.protected_input_share,
                    "frozen_row_share": summary.frozen_row_share,
                    "relative_delta": summary.relative_delta,
                }
            )
            tuned.unlink()
    return rows


def correlations(rows: list[dict], target: str) -> dict[str, float]:
    return {
        score: float(spearmanr([r[score] for r in rows], [r[target] for r in rows]).statistic)
        for score in ("risk", "protected_share", "frozen_row_share", "relative_delta")
    }


def group_means(rows: list[dict]) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["config"]), []).append(r)
    keys = ("forgetting", "kl_task1", "risk", "protected_share", "frozen_row_share", "relative_delta")
    return [
        {"method": m, "config": c, **{k: sum(r[k] for r in g) / len(g) for k in keys}} for (m, c), g in groups.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("/tmp/audit_vs_forgetting"))
    ap.add_argument("--quick", action="store_true", help="one config per method, 10/10 epochs")
    args = ap.parse_args()
    s = continual.ContinualSettings.quick() if args.quick else continual.ContinualSettings()
    started = time.perf_counter()
    rows = run(args.out, list(range(args.seeds)), s)
    means = group_means(rows)
    result = {
        "runs": len(rows),
        "groups": len(means),
        "seconds": round(time.perf_counter() - started, 1),
        "spearman_runs_forgetting": correlations(rows, "forgetting"),
        "spearman_runs_kl": correlations(rows, "kl_task1"),
        "spearman_groups_forgetting": correlations(means, "forgetting"),
        "spearman_groups_kl": correlations(means, "kl_task1"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'method':<26}{'config':<16}{'forgetting':>11}{'KL':>9}{'risk':>11}{'prot.share':>11}{'frozen':>8}{'|dW|/|W|':>10}"
    )
    for g in sorted(means, key=lambda g: g["risk"]):
        print(
            f"{g['method']:<26}{g['config']:<16}{g['forgetting']:>11.2f}{g['kl_task1']:>9.4f}{g['risk']:>11.4e}"
            f"{g['protected_share']:>11.4f}{g['frozen_row_share']:>8.3f}{g['relative_delta']:>10.4f}"
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
