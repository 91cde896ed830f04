"""digits.train / train_stage1 check their arguments first: one ConfigError naming the argument, not a TypeError
from Adam or range(), and no endless loop (batch_size=-1 gave range(0, n, -1): no batch, forever)."""

from __future__ import annotations

import pytest

from plate_inspect.errors import ConfigError
from plate_inspect.experiments import digits


@pytest.fixture(scope="module")
def task():
    return digits.load_digit_tasks()[0]


@pytest.mark.parametrize(
    "change, line",
    [
        ({"batch_size": -1}, "train: batch_size must be a positive integer, got -1"),
        ({"batch_size": 0}, "train: batch_size must be a positive integer, got 0"),
        ({"lr": "x"}, "train: lr must be a positive finite number, got 'x'"),
        ({"lr": float("nan")}, "train: lr must be a positive finite number, got nan"),
        ({"seed": None}, "seed must be a non-negative integer below 2^63, got None"),
        ({"steps": "x"}, "train: steps must be an integer >= 0, got 'x'"),
        ({"steps": -1}, "train: steps must be an integer >= 0, got -1"),
        ({"steps": None, "epochs": 1.5}, "train: epochs must be an integer >= 0, got 1.5"),
        ({"task": None}, "train: task must be a Task (load_tasks gives them), got None"),
        ({"params": []}, "train: params must be a non-empty list of parameters, got []"),
        ({"params": 3}, "train: params must be an iterable of parameters (list(model.parameters())), got 3"),
        ({"model": None}, "train: model must be a torch.nn.Module, got None"),
        ({"task_id": 0}, "train: task_id must be a positive integer, got 0"),
        ({"penalty": 3}, "train: penalty must be a function returning a loss term, or None, got 3"),
    ],
)
def test_train_refuses_a_bad_argument_in_one_line(task, change, line):
    model = digits.initial_model(64, 0)
    kwargs = {"model": model, "params": list(model.parameters()), "task": task, "task_id": 1, "steps": 1, **change}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as e:
        digits.train(**kwargs)
    assert str(e.value) == line
    assert all((before[k] == v).all() for k, v in model.state_dict().items())  # refused before any step


def test_train_stage1_checks_seed_and_n_tasks(task):
    with pytest.raises(ConfigError, match=r"^seed must be a non-negative integer below 2\^63, got 2.5$"):
        digits.train_stage1(task, seed=2.5, steps=1)
    with pytest.raises(ConfigError, match=r"^train_stage1: n_tasks must be a positive integer, got 'x'$"):
        digits.train_stage1(task, n_tasks="x", steps=1)
    model = digits.train_stage1(task, seed=3, steps=2)  # the good path is unchanged
    assert isinstance(model, digits.DigitsMLP)
