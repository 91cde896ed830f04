"""Why Random-B drifts less than PLATE on the digits MLP: dead ReLU units in B (a check, with an intervention).

Per seed: stage 1 as in the continual benchmark (2,400 steps), PLATE bundles at (r=8, tau=0.98) and (r=32, tau=0.9)
and their Random-B / Least-redundant-B variants (same Q). A unit (output row of fc1/fc2/fc3) is *dead* when its ReLU
output is 0 on every task-1 training input. Printed: the fraction of dead units in each B. Intervention: with
PLATE's Q fixed, train the adapter + head 2 for 2,400 steps on task 2 with B = PLATE's rows, B = r random rows,
B = r random *live* rows and B = r random *dead* rows (when there are r), and measure the task-1 KL and task-2 accuracy.
Also printed: of each B's rows dead on task 1, the fraction live on task-2 training inputs, pooled over fc1-fc3 and
the seeds (rows, not a mean of per-module fractions; a module or seed whose B has no dead row adds nothing to it).
A unit dead on task 1 but live on task 2 can be updated without touching task-1 outputs and still serve task 2.
Usage: .venv/bin/python benchmarks/arena_dead_units.py [--seeds 3] [--steps 2400] [--data digits|fashion-mnist]
(``--steps 1`` gives the dead-row fractions alone, without the long stage 2: they do not depend on it).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import click
import torch

from plate_inspect.bundle import Bundle
from plate_inspect.cli.experiment import data_option
from plate_inspect.experiments import digits
from plate_inspect.experiments.continual import symmetric_kl
from plate_inspect.experiments.methods import BACKBONE, StageOne
from plate_inspect.train.layer import PlateLinear


@torch.no_grad()
def live_units(model: digits.DigitsMLP, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per backbone module, a bool mask of units with a positive ReLU output on some input."""
    out, h = {}, x
    for m in BACKBONE:
        h = torch.relu(getattr(model, m)(h))
        out[m] = (h > 0).any(0)
    return out


def dead_and_revived(
    live1: dict[str, torch.Tensor], live2: dict[str, torch.Tensor], b_rows: dict[str, torch.Tensor]
) -> tuple[int, int]:
    """(rows of B dead on task 1, of those the rows live on task 2), summed over the modules of ``b_rows``."""
    dead = sum(int((~live1[m][b]).sum()) for m, b in b_rows.items())
    revived = sum(int((live2[m][b] & ~live1[m][b]).sum()) for m, b in b_rows.items())
    return dead, revived


def train_with_b(ckpt: Path, bundle: Bundle, b_rows: dict[str, torch.Tensor], task2, steps: int, seed: int):
    model = digits.load_model(ckpt)
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = []
    for m in BACKBONE:
        layer = PlateLinear(getattr(model, m), b_rows[m], bundle.q(m, dtype=torch.float32), rho=0.5)
        setattr(model, m, layer)
        adapter.append(layer.plate_A)
    head = list(model.head2.parameters())
    for p in head:
        p.requires_grad_(True)
    digits.train(model, adapter + head, task2, 2, steps=steps, seed=seed)
    return model


@click.command(help=__doc__.split("\n")[0])
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Seeds 0..K-1 (stage 1: 2,400 steps each).",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=2400, show_default=True, help="Stage-2 steps of the intervention."
)
@data_option
def main(seeds: int, steps: int, data: str) -> None:
    torch.set_num_threads(1)
    task1, task2 = digits.load_tasks(data)
    rows: dict[tuple, list[tuple[float, float, float]]] = {}
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            model = digits.train_stage1(task1, seed, steps=2400)
            ckpt = Path(tmp) / "stage1.safetensors"
            digits.save_model(model, ckpt)
            before = model(task1.x_test, task=1).detach()
            live = live_units(model, task1.x_train)
            live2 = live_units(model, task2.x_train)
            init = digits.initial_model(task1.d_in, seed).state_dict()
            s1 = StageOne(seed, Path(tmp), ckpt, task1, init)
            for r, tau in ((8, 0.98), (32, 0.9)):
                plate = Bundle.load(s1.bundle(r, tau))
                g = torch.Generator().manual_seed(1000 + seed)
                choices: dict[str, dict[str, torch.Tensor] | None] = {"plate": {}, "random": {}, "random_live": {}}
                choices["random_dead"] = {}
                for m in BACKBONE:
                    mask = live[m]
                    choices["plate"][m] = plate.b_idx(m)
                    choices["random"][m] = torch.randperm(mask.numel(), generator=g)[:r]
                    alive, dead = mask.nonzero().flatten(), (~mask).nonzero().flatten()
                    choices["random_live"][m] = alive[torch.randperm(alive.numel(), generator=g)[:r]]
                    if dead.numel() >= r and choices["random_dead"] is not None:
                        choices["random_dead"][m] = dead[torch.randperm(dead.numel(), generator=g)[:r]]
                    else:
                        choices["random_dead"] = None
                for variant in ("random_b", "least_redundant_b"):
                    vb = Bundle.load(s1.bundle(r, tau, variant))
                    dead_frac = statistics.fmean(float((~live[m][vb.b_idx(m)]).float().mean()) for m in BACKBONE)
                    dead, revived = dead_and_revived(live, live2, {m: vb.b_idx(m) for m in BACKBONE})
                    rows.setdefault((r, tau, f"{variant} (variant bundle)", "dead"), []).append(
                        (dead_frac, dead, revived)
                    )
                for name, b_rows in choices.items():
                    if b_rows is None:
                        continue
                    dead_frac = statistics.fmean(float((~live[m][b_rows[m]]).float().mean()) for m in BACKBONE)
                    adapted = train_with_b(ckpt, plate, b_rows, task2, steps, seed)
                    with torch.no_grad():
                        kl = symmetric_kl(before, adapted(task1.x_test, task=1))
                    acc2 = digits.accuracy(adapted, task2.x_test, task2.y_test, 2)
                    rows.setdefault((r, tau, name, "run"), []).append((dead_frac, kl, acc2))
                    print(f"seed {seed} r={r} tau={tau} B={name}: dead {dead_frac:.3f} KL {kl:.4f} task-2 {acc2:.4f}")
            overall = statistics.fmean(float((~live[m]).float().mean()) for m in BACKBONE)
            print(f"seed {seed}: dead units overall {overall:.3f}", flush=True)
    print("\n| r, tau | B | seeds | dead fraction of B | sym. KL | task-2 acc |\n|---|---|---|---|---|---|")
    for (r, tau, name, kind), vals in rows.items():
        dead = statistics.fmean(v[0] for v in vals)
        if kind == "dead":  # rows dead on task 1 and, of those, live on task 2: pooled over modules and seeds
            n_dead, n_revived = sum(v[1] for v in vals), sum(v[2] for v in vals)
            share = f"{n_revived / n_dead:.2f} = {n_revived}/{n_dead} rows" if n_dead else "n/a: no dead row"
            print(f"| {r}, {tau} | {name} | {len(vals)} | {dead:.3f} (live on task 2: {share}) | | |")
        else:
            kl = statistics.fmean(v[1] for v in vals)
            acc = statistics.fmean(v[2] for v in vals)
            print(f"| {r}, {tau} | {name} | {len(vals)} | {dead:.3f} | {kl:.4f} | {100 * acc:.2f} |")


if __name__ == "__main__":
    main()
