"""The continual-learning setup shared by the benchmark, the analyses and the tests: tasks, the MLP, the trainer.

Data: scikit-learn's digits (8x8 images, shipped with the package: no download) or Fashion-MNIST (28x28, read from
Debian's ``dataset-fashion-mnist`` files, :mod:`plate_inspect.experiments.fashion_mnist`); task 1 = classes 0-4,
task 2 = classes 5-9. Model: the paper's 3-layer ReLU MLP backbone (d_in -> 256 -> 256 -> 256, modules ``fc1``,
``fc2``, ``fc3``) with one 256 -> n_classes head per task (``head1``, ``head2``, ...). :func:`train` is the one
minibatch-Adam loop and :func:`train_stage1` the one stage-1 trainer every caller uses.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from plate_inspect.arguments import (
    describe,
    iterable_argument,
    non_negative_int,
    positive_int,
    positive_number,
    real_value,
    seed_argument,
)
from plate_inspect.errors import ConfigError
from plate_inspect.progress import ProgressCallback, ProgressCounter, as_callback

DATA_SETS = ("digits", "fashion-mnist")
BACKBONE = ("fc1", "fc2", "fc3")


@dataclass
class Task:
    """One task's tensors; labels are 0..n_classes-1 within the task."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def d_in(self) -> int:
        """Number of input features."""
        return int(self.x_train.shape[1])

    def steps_per_epoch(self, batch_size: int = 128) -> int:
        """Batches of ``batch_size`` in one pass over the training set (the last one may be short)."""
        return math.ceil(self.x_train.shape[0] / batch_size)


def load_digit_tasks(test_size: float = 0.25, split_seed: int = 0) -> tuple[Task, Task]:
    """(task 1: digits 0-4, task 2: digits 5-9), features scaled to [0, 1], float32."""
    x, y = _digits_arrays()
    return class_range_task(x, y, 0, 5, test_size, split_seed), class_range_task(x, y, 5, 10, test_size, split_seed)


def _digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target, dtype=torch.int64)


def class_range_task(
    x: torch.Tensor, y: torch.Tensor, lo: int, hi: int, test_size: float = 0.25, split_seed: int = 0
) -> Task:
    """Classes lo..hi-1 of (x, y) relabelled 0..hi-lo-1, with a fixed stratified train/test split."""
    from sklearn.model_selection import train_test_split

    x, y = _examples(x, y, "class_range_task")
    lo, hi = non_negative_int(lo, "class_range_task: lo"), positive_int(hi, "class_range_task: hi")
    if lo >= hi:
        raise ConfigError(f"class_range_task: lo ({lo}) must be below hi ({hi}): the classes lo..hi-1")
    test = real_value(test_size)
    if not 0 < test < 1:
        raise ConfigError(f"class_range_task: test_size must be a fraction in (0, 1), got {test_size!r:.80}")
    split_seed = seed_argument(split_seed)
    mask = (y >= lo) & (y < hi)
    xs, ys = x[mask].numpy(), (y[mask] - lo).numpy()
    xtr, xte, ytr, yte = train_test_split(xs, ys, test_size=test_size, random_state=split_seed, stratify=ys)
    return Task(torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte))


def _examples(x: object, y: object, function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) when x is a 2-D float tensor of inputs and y a 1-D integer tensor of as many labels, else ConfigError."""
    if not (isinstance(x, torch.Tensor) and x.ndim == 2 and x.is_floating_point()):
        raise ConfigError(f"{function}: x must be a 2-D float tensor [examples, features], got {describe(x)}")
    if not (isinstance(y, torch.Tensor) and y.ndim == 1 and not y.is_floating_point() and y.dtype != torch.bool):
        raise ConfigError(f"{function}: y must be a 1-D integer tensor of class labels, got {describe(y)}")
    if x.shape[0] != y.shape[0]:
        raise ConfigError(
            f"{function}: x has {x.shape[0]} examples but y has {y.shape[0]} labels; give one label per example"
        )
    return x, y


def load_tasks(data: str = "digits", root: str | None = None) -> tuple[Task, Task]:
    """The two-task split of ``data`` ("digits" or "fashion-mnist"): classes 0-4, then 5-9."""
    _check_root(root)
    if data == "digits":
        return load_digit_tasks()
    if data == "fashion-mnist":
        from plate_inspect.experiments.fashion_mnist import load_fashion_tasks

        return load_fashion_tasks(root)
    raise ConfigError(f"unknown data set '{data}'; choose one of {', '.join(DATA_SETS)}")


def load_pair_tasks(data: str = "digits", root: str | None = None) -> list[Task]:
    """The four binary tasks of the paper's sequential appendix: 2v3, 4v5, 6v7, 8v9 (labels 0/1)."""
    _check_root(root)
    if data == "digits":
        x, y = _digits_arrays()
        return [class_range_task(x, y, lo, lo + 2) for lo in (2, 4, 6, 8)]
    if data == "fashion-mnist":
        from plate_inspect.experiments.fashion_mnist import load_fashion_pair_tasks

        return load_fashion_pair_tasks(root)
    raise ConfigError(f"unknown data set '{data}'; choose one of {', '.join(DATA_SETS)}")


def _check_root(root: object) -> None:
    """ConfigError for a ``root`` that is neither None nor a path (3 was a TypeError from Path)."""
    if root is not None:
        from plate_inspect.atomic import path_argument

        path_argument(root, "root (CLI: --data-root)")


class DigitsMLP(nn.Module):
    """3-layer ReLU backbone (fc1, fc2, fc3) and one head per task (head1, head2, ...)."""

    def __init__(self, d_in: int = 64, hidden: int = 256, n_classes: int = 5, n_tasks: int = 2) -> None:
        super().__init__()
        d_in, hidden = positive_int(d_in, "DigitsMLP: d_in"), positive_int(hidden, "DigitsMLP: hidden")
        n_classes = positive_int(n_classes, "DigitsMLP: n_classes")
        n_tasks = positive_int(n_tasks, "DigitsMLP: n_tasks")
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        for t in range(1, n_tasks + 1):
            self.add_module(f"head{t}", nn.Linear(hidden, n_classes))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The shared backbone's output (fc1-fc3 with ReLU), before any task head."""
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return torch.relu(self.fc3(x))

    def forward(self, x: torch.Tensor, task: int = 1) -> torch.Tensor:
        """Logits of task ``task``'s head; a task number the model has no head for is a ConfigError."""
        head = getattr(self, f"head{task}", None) if isinstance(task, int) and not isinstance(task, bool) else None
        if not isinstance(head, nn.Module):  # was AttributeError: 'DigitsMLP' object has no attribute 'head3'
            n = sum(1 for name, _ in self.named_children() if name.startswith("head"))
            raise ConfigError(f"task must be a task number 1..{n} (this model has {n} heads), got {task!r:.80}")
        return head(self.features(x))


def train(
    model: nn.Module,
    params: list[torch.nn.Parameter],
    task: Task,
    task_id: int,
    epochs: int | None = None,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
    steps: int | None = None,
    penalty: Callable[[], torch.Tensor] | None = None,
    progress: ProgressCallback | None = None,
) -> int:
    """Adam on cross-entropy (+ ``penalty()``) over ``params`` for ``steps`` minibatches or ``epochs`` epochs.

    The minibatch order is a fresh seeded permutation per epoch; ``epochs=E`` equals ``steps=E*steps_per_epoch``.
    ``progress`` gets one event per Adam step (unit "steps", labelled with the epoch). Returns the number of steps
    taken.
    """
    from plate_inspect.train.layer import model_argument

    model_argument(model, "train")
    params = list(iterable_argument(params, "train: params", "parameters (list(model.parameters()))"))
    if not params or not all(isinstance(p, torch.Tensor) for p in params):
        raise ConfigError(f"train: params must be a non-empty list of parameters, got {params!r:.80}")
    if not isinstance(task, Task):
        raise ConfigError(f"train: task must be a Task (load_tasks gives them), got {task!r:.80}")
    positive_int(task_id, "train: task_id")
    batch_size = positive_int(batch_size, "train: batch_size")  # -1 was an endless loop (range(0, n, -1) is empty)
    lr = positive_number(lr, "train: lr")
    seed = seed_argument(seed)
    progress = as_callback(progress, "train")
    if penalty is not None and not callable(penalty):
        raise ConfigError(f"train: penalty must be a function returning a loss term, or None, got {penalty!r:.80}")
    if steps is not None and epochs is None:
        total = non_negative_int(steps, "train: steps")
    elif epochs is not None and steps is None:
        total = non_negative_int(epochs, "train: epochs") * task.steps_per_epoch(batch_size)
    else:
        raise ConfigError("train: give exactly one of epochs and steps")
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    n = task.x_train.shape[0]
    counter = ProgressCounter(progress, total, "steps")
    counter.start()
    model.train()
    done = 0
    while done < total:
        order = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            if done == total:
                break
            idx = order[i : i + batch_size]
            loss = nn.functional.cross_entropy(model(task.x_train[idx], task=task_id), task.y_train[idx])
            if penalty is not None:
                loss = loss + penalty()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            counter.step(f"task {task_id}, epoch {(done - 1) // task.steps_per_epoch(batch_size) + 1}")
    model.eval()
    return done


def train_stage1(
    task1: Task,
    seed: int = 0,
    epochs: int | None = None,
    steps: int | None = None,
    lr: float = 1e-3,
    batch_size: int = 128,
    n_tasks: int = 2,
    progress: ProgressCallback | None = None,
) -> DigitsMLP:
    """Stage 1: a fresh seeded MLP with backbone + head 1 trained on task 1 (the one stage-1 trainer); ``progress``:
    one event per Adam step."""
    if not isinstance(task1, Task):  # was AttributeError: 'NoneType' object has no attribute 'd_in'
        raise ConfigError(f"task1 must be a Task (load_tasks gives them), got {task1!r:.80}")
    seed = seed_argument(seed)
    n_tasks = positive_int(n_tasks, "train_stage1: n_tasks")
    torch.manual_seed(seed)
    model = DigitsMLP(d_in=task1.d_in, n_classes=int(task1.y_train.max()) + 1, n_tasks=n_tasks)
    params = [p for n, p in model.named_parameters() if n.split(".")[0] in (*BACKBONE, "head1")]
    train(
        model, params, task1, 1, epochs=epochs, steps=steps, lr=lr, batch_size=batch_size, seed=seed, progress=progress
    )
    return model


def initial_model(d_in: int, seed: int, n_classes: int = 5, n_tasks: int = 2) -> DigitsMLP:
    """The untrained MLP that :func:`train_stage1` starts from for ``seed`` (its initialisation W0)."""
    d_in = positive_int(d_in, "initial_model: d_in")
    seed = seed_argument(seed)
    n_classes = positive_int(n_classes, "initial_model: n_classes")
    n_tasks = positive_int(n_tasks, "initial_model: n_tasks")
    torch.manual_seed(seed)
    return DigitsMLP(d_in=d_in, n_classes=n_classes, n_tasks=n_tasks)


def save_model(model: nn.Module, path: str | os.PathLike) -> None:
    """The model's state dict as one safetensors file, written atomically (a crash leaves the old file or none, never
    half of one; a full disk raises OSError instead of safetensors' own error)."""
    from safetensors.torch import save

    from plate_inspect.atomic import atomic_write, path_argument
    from plate_inspect.train.layer import model_argument

    path = path_argument(path, "path")
    model_argument(model, "save_model")
    atomic_write(path, save({k: v.detach().contiguous() for k, v in model.state_dict().items()}))


def load_model(path: str | os.PathLike) -> DigitsMLP:
    """A DigitsMLP with the weights of a safetensors file written by :func:`save_model` (shapes from the file); any
    other file is a ConfigError naming it (another model's safetensors raised KeyError: 'head1.weight')."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from plate_inspect.atomic import path_argument

    path = path_argument(path, "path")
    advice = "give a file written by digits.save_model"
    try:
        state = load_file(str(path))
    except SafetensorError as e:
        raise ConfigError(f"{path}: is not a safetensors file ({e}); {advice}") from None
    n_tasks = sum(1 for k in state if k.startswith("head") and k.endswith(".weight"))
    try:
        n_classes, hidden = state["head1.weight"].shape
        model = DigitsMLP(d_in=state["fc1.weight"].shape[1], hidden=hidden, n_classes=n_classes, n_tasks=n_tasks)
        model.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError) as e:  # missing or extra tensors, other shapes
        names = ", ".join(sorted(state)[:4]) + (", ..." if len(state) > 4 else "")
        reason = f"no tensor {e}" if isinstance(e, KeyError) else str(e).strip().splitlines()[-1].strip()
        raise ConfigError(
            f"{path}: is not a digits model ({reason}; it holds {names or 'no tensors'}); {advice}"
        ) from None
    return model


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task_id: int) -> float:
    """Top-1 accuracy of task `task_id`'s head on (x, y), in eval mode."""
    from plate_inspect.train.layer import model_argument

    model_argument(model, "accuracy")
    x, y = _examples(x, y, "accuracy")
    if not len(y):
        raise ConfigError("accuracy: x and y hold no examples; an accuracy of none is undefined")
    model.eval()
    return float((model(x, task=task_id).argmax(dim=1) == y).float().mean())
