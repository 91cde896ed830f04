"""Stage 1 of ``plate-inspect curvature``: the digits MLP trained on task 1 (P0), saved, and scanned into a bundle."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from plate_inspect.atomic import make_dirs
from plate_inspect.progress import ProgressCallback

if TYPE_CHECKING:
    from plate_inspect.bundle import Bundle
    from plate_inspect.experiments.digits import Task


@dataclass
class DigitsSetup:
    """Stage 1 of the digits benchmark: the trained model, its checkpoint, its bundle and task 1 data."""

    model: nn.Module
    checkpoint: Path
    bundle: Bundle
    task1: Task
    task1_test_accuracy: float


#: The stage-1 checkpoint digits_stage1 saves in its output directory (its own: a rerun may replace it).
STAGE1_CHECKPOINT = "digits_task1.safetensors"


def digits_stage1(
    out_dir: str | os.PathLike,
    epochs: int = 30,
    seed: int = 0,
    r: int = 8,
    tau: float = 0.98,
    max_rank: int = 256,
    progress: ProgressCallback | None = None,
) -> DigitsSetup:
    """Train the digits MLP on task 1, save it as safetensors, scan fc1/fc2/fc3 into a PLATE bundle.

    The scan settings are checked first: a bad ``tau`` is refused before the training, not after it. ``progress``
    gets one event per Adam step of the training (unit "steps"; the scan of three modules is instant)."""
    from plate_inspect.experiments import digits
    from plate_inspect.experiments.continual import check_own_directory
    from plate_inspect.geometry import validate_settings
    from plate_inspect.scanner import scan

    validate_settings(r=r, tau=tau, max_rank=max_rank)
    check_own_directory(out_dir, ours=(STAGE1_CHECKPOINT,))  # not a model's or a bundle's directory

    out_dir = make_dirs(out_dir, "the output directory")
    task1, _ = digits.load_digit_tasks()
    model = digits.train_stage1(task1, seed=seed, epochs=epochs, progress=progress)
    ckpt = out_dir / STAGE1_CHECKPOINT
    digits.save_model(model, ckpt)
    bundle = scan(
        ckpt, out_dir / "bundle", r=r, tau=tau, max_rank=max_rank, target_modules=list(digits.BACKBONE), overwrite=True
    )
    acc = digits.accuracy(model, task1.x_test, task1.y_test, task_id=1)
    return DigitsSetup(model, ckpt, bundle, task1, acc)
