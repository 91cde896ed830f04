"""GN share |q_GN|/|q_H| on the digits MLP: the definition the curvature command uses, and the alternatives tried.

For random unit probes v in each family (full backbone, LoRA r=8 tangent, PLATE r=8 tau=0.98, Random-B), with
q_H = v^T H0 v and q_GN = v^T J^T (d2l/df2) J v on task-1 training data, prints per family:
  median |q_GN|/|q_H| (the definition used), sum|q_GN|/sum|q_H| (ratio of totals), median |q_GN|/(|q_GN|+|q_R|),
for theta0 trained 1, 30 and 400 epochs (400 epochs of digits = 2,400 steps: the paper's stage-1 length), and with
P0 replaced by task-2 inputs scored by head 1 (a theta0 far from a minimum of that loss).
Usage: .venv/bin/python benchmarks/arena_gn_share.py [--probes 30]
"""

from __future__ import annotations

import tempfile

import click
import numpy as np
import torch
import torch.nn.functional as F

from plate_inspect.analysis.curvature import (
    OldTaskProblem,
    batches,
    digits_stage1,
    full_family,
    gn_decomposition,
    lora_family,
    plate_family,
)
from plate_inspect.experiments import digits


def shares(q_h: np.ndarray, q_gn: np.ndarray) -> tuple[float, float, float]:
    q_r = q_h - q_gn
    return (
        float(np.median(np.abs(q_gn) / np.abs(q_h))),
        float(np.abs(q_gn).sum() / np.abs(q_h).sum()),
        float(np.median(np.abs(q_gn) / (np.abs(q_gn) + np.abs(q_r)))),
    )


@click.command(help=__doc__.split("\n")[0])
@click.option(
    "--probes", type=click.IntRange(min=1), default=30, show_default=True, help="Random unit probes per family."
)
def main(probes: int) -> None:
    torch.set_num_threads(1)
    _, task2 = digits.load_digit_tasks()
    backbone = ["fc1", "fc2", "fc3"]
    print("setting | family | median |qGN|/|qH| | sum|qGN|/sum|qH| | median |qGN|/(|qGN|+|qR|) | train loss")
    for epochs in (1, 30, 400):
        with tempfile.TemporaryDirectory() as tmp:
            setup = digits_stage1(tmp, epochs=epochs, seed=0, r=8, tau=0.98)
            model = setup.model
            fams = [
                full_family(model, [f"{m}.{p}" for m in backbone for p in ("weight", "bias")], name="full_backbone"),
                lora_family(model, backbone, 8, seed=0),
                plate_family(model, setup.bundle, variant="plate", seed=0, modules=backbone),
                plate_family(model, setup.bundle, variant="random_b", seed=0, modules=backbone),
            ]
            data_sets = {"P0 = task-1 train": batches(setup.task1.x_train, setup.task1.y_train)}
            if epochs == 30:
                data_sets["task-2 inputs, head 1"] = batches(task2.x_train, task2.y_train)
            for label, data in data_sets.items():
                problem = OldTaskProblem(model, F.cross_entropy, data)
                loss = problem.loss()
                for fam in fams:
                    q_h, q_gn, _ = gn_decomposition(problem, fam, n_probes=probes, seed=0)
                    a, b, c = shares(q_h, q_gn)
                    row = f"{epochs} epochs, {label} | {fam.name} | {a:.3f} | {b:.3f} | {c:.3f} | {loss:.2e}"
                    print(row, flush=True)


if __name__ == "__main__":
    main()
