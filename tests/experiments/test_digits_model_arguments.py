"""digits' model helpers (initial_model, accuracy, class_range_task, save_model, load_model) name a bad argument in
one ConfigError instead of a TypeError/AttributeError/KeyError from torch, scikit-learn or safetensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from plate_inspect.errors import ConfigError
from plate_inspect.experiments import digits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_in": None, "seed": 0}, r"^initial_model: d_in must be a positive integer, got None"),
        ({"d_in": 0, "seed": 0}, r"^initial_model: d_in must be a positive integer, got 0"),
        ({"d_in": 64, "seed": None}, r"^seed must be a non-negative integer below 2\^63, got None"),
        ({"d_in": 64, "seed": -1}, r"^seed must be a non-negative integer below 2\^63, got -1"),
        ({"d_in": 64, "seed": 0, "n_classes": 2.5}, r"^initial_model: n_classes must be a positive integer"),
        ({"d_in": 64, "seed": 0, "n_tasks": 0}, r"^initial_model: n_tasks must be a positive integer"),
    ],
)
def test_initial_model_names_a_bad_argument(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        digits.initial_model(**kwargs)


def test_initial_model_is_the_seeded_initialisation():
    a, b = digits.initial_model(8, seed=3, n_classes=2, n_tasks=3), digits.initial_model(8, seed=3, n_classes=2)
    assert a.fc1.weight.shape == (256, 8) and a.head3.weight.shape == (2, 256)
    assert torch.equal(a.fc1.weight, b.fc1.weight)


def _planted_model() -> digits.DigitsMLP:
    """A model whose head-1 prediction is the larger of the first two inputs (fc layers pass them through)."""
    model = digits.DigitsMLP(d_in=2, hidden=2, n_classes=2, n_tasks=1)
    with torch.no_grad():
        for layer in (model.fc1, model.fc2, model.fc3, model.head1):
            layer.weight.copy_(torch.eye(2))
            layer.bias.zero_()
    return model


def test_accuracy_against_a_hand_count():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    y = torch.tensor([0, 1, 1, 0])  # the model predicts 0, 1, 0, 1: two of four right
    assert digits.accuracy(_planted_model(), x, y, 1) == 0.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((None, torch.zeros(2, 2), torch.zeros(2, dtype=torch.int64)), r"^accuracy: model must be a torch.nn.Module"),
        (("m", None, torch.zeros(2, dtype=torch.int64)), r"^accuracy: x must be a 2-D float tensor .*got None"),
        (("m", torch.zeros(2, 2), None), r"^accuracy: y must be a 1-D integer tensor of class labels, got None"),
        (
            ("m", torch.zeros(2, 2), torch.zeros(2)),
            r"^accuracy: y must be .*got a Tensor of dtype torch.float32 and sh",
        ),
        (("m", torch.zeros(3, 2), torch.zeros(2, dtype=torch.int64)), r"^accuracy: x has 3 examples but y has 2"),
        (("m", torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)), r"^accuracy: x and y hold no examples"),
    ],
)
def test_accuracy_names_a_bad_argument(args, message):
    model = _planted_model()
    with pytest.raises(ConfigError, match=message):
        digits.accuracy(*(model if a == "m" else a for a in args), 1)


def test_class_range_task_relabels_and_splits():
    x = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    y = torch.arange(20) % 4
    task = digits.class_range_task(x, y, 2, 4, test_size=0.5)
    assert sorted(torch.cat([task.y_train, task.y_test]).tolist()) == [0] * 5 + [1] * 5
    for xs, ys in ((task.x_train, task.y_train), (task.x_test, task.y_test)):
        assert torch.equal((xs[:, 0] / 2).long() % 4, ys + 2)  # each example kept with its own label


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": None}, r"^class_range_task: x must be a 2-D float tensor"),
        ({"y": [0, 1]}, r"^class_range_task: y must be a 1-D integer tensor"),
        ({"lo": None}, r"^class_range_task: lo must be an integer >= 0, got None"),
        ({"hi": "4"}, r"^class_range_task: hi must be a positive integer, got '4'"),
        ({"lo": 4, "hi": 2}, r"^class_range_task: lo \(4\) must be below hi \(2\)"),
        ({"test_size": 1.5}, r"^class_range_task: test_size must be a fraction in \(0, 1\), got 1.5"),
        ({"test_size": float("nan")}, r"^class_range_task: test_size must be a fraction"),
        ({"split_seed": None}, r"^seed must be a non-negative integer"),
    ],
)
def test_class_range_task_names_a_bad_argument(change, message):
    kwargs = {"x": torch.zeros(20, 2), "y": torch.arange(20) % 4, "lo": 0, "hi": 2, "test_size": 0.5, "split_seed": 0}
    with pytest.raises(ConfigError, match=message):
        digits.class_range_task(**{**kwargs, **change})


def test_save_model_names_a_bad_argument(tmp_path):
    with pytest.raises(ConfigError, match=r"^path must be a path \(str or os.PathLike\), got None"):
        digits.save_model(_planted_model(), None)
    with pytest.raises(ConfigError, match=r"^save_model: model must be a torch.nn.Module, got None"):
        digits.save_model(None, tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_load_model_round_trip(tmp_path):
    model = digits.initial_model(8, seed=1, n_classes=3, n_tasks=4)
    digits.save_model(model, tmp_path / "m.safetensors")
    loaded = digits.load_model(tmp_path / "m.safetensors")
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_load_model_of_another_file_names_it(tmp_path):
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(ConfigError, match=rf"^{other}: is not a digits model \(no tensor 'head1.weight'; it holds w\)"):
        digits.load_model(other)
    text = tmp_path / "notes.safetensors"
    text.write_text("not a safetensors file at all\n")
    with pytest.raises(ConfigError, match=rf"^{text}: is not a safetensors file \(.*\); give a file written by"):
        digits.load_model(text)
    model = digits.initial_model(8, seed=1, n_classes=3)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file({**state, "fc2.weight": torch.zeros(3, 3)}, str(other))  # the right names, a wrong shape
    with pytest.raises(ConfigError, match=rf"^{other}: is not a digits model \(.*size mismatch"):
        digits.load_model(other)
