"""The digits continual-learning setup shared by the benchmark and the analyses.

scikit-learn's digits (8x8 images, shipped with the package: no download), task 1 = digits 0-4, task 2 =
digits 5-9, a fixed stratified train/test split, and the paper's 3-layer ReLU MLP backbone
(64 -> 256 -> 256 -> 256, modules ``fc1``, ``fc2``, ``fc3``) with one 256 -> 5 head per task.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Task:
    """One task's tensors; labels are 0..4 within the task."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digit_tasks(test_size: float = 0.25, split_seed: int = 0) -> tuple[Task, Task]:
    """(task 1: digits 0-4, task 2: digits 5-9), features scaled to [0, 1], float32."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    tasks = []
    for lo in (0, 5):
        mask = (y >= lo) & (y < lo + 5)
        xs, ys = x[mask].numpy(), (y[mask] - lo).numpy()
        xtr, xte, ytr, yte = train_test_split(xs, ys, test_size=test_size, random_state=split_seed, stratify=ys)
        tasks.append(Task(torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte)))
    return tasks[0], tasks[1]


class DigitsMLP(nn.Module):
    """3-layer ReLU backbone (fc1, fc2, fc3) and two task heads (head1, head2)."""

    def __init__(self, d_in: int = 64, hidden: int = 256, n_classes: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.head1 = nn.Linear(hidden, n_classes)
        self.head2 = nn.Linear(hidden, n_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return torch.relu(self.fc3(x))

    def forward(self, x: torch.Tensor, task: int = 1) -> torch.Tensor:
        h = self.features(x)
        return self.head1(h) if task == 1 else self.head2(h)


def train(
    model: nn.Module,
    params: list[torch.nn.Parameter],
    task: Task,
    task_id: int,
    epochs: int,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
) -> None:
    """Adam on cross-entropy over ``params`` only; deterministic minibatch order for a seed."""
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    n = task.x_train.shape[0]
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            idx = order[i : i + batch_size]
            loss = nn.functional.cross_entropy(model(task.x_train[idx], task=task_id), task.y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task_id: int) -> float:
    model.eval()
    return float((model(x, task=task_id).argmax(dim=1) == y).float().mean())
