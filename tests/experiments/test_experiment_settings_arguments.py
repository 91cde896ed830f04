"""Settings and helpers of the two digits experiments met with a value of the wrong kind: one ConfigError naming it
(they were TypeErrors: ``methods=3`` 'int' object is not iterable, ``steps=None`` "Value after * must be an
iterable", ``data_root=3`` from Path, a results.json holding ``null`` for an accuracy "'<=' not supported"), and
NumPy integers read as the integers they are (``seeds=np.int64(2)`` and ``steps=np.int64(2)`` were refused)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from plate_inspect.errors import ConfigError
from plate_inspect.experiments import digits
from plate_inspect.experiments.continual import (
    ContinualSettings,
    check_not_other_experiment,
    check_own_directory,
    only_results_json,
    records_from_dir,
    run_continual,
    seed_list,
    task_logits,
)
from plate_inspect.experiments.methods import Budget
from plate_inspect.experiments.sequential_tasks import run_sequential
from plate_inspect.train import sequential


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": 3}, r"^methods \(CLI: --methods\) must be a name or a list of names, got 3"),
        ({"methods": ["lora", 3]}, r"^methods \(CLI: --methods\) must be a name or a list of names"),
        (
            {"steps": None},
            r"^steps \(CLI: --steps\) must be an iterable of step counts \(e.g. \[60, 2400\]\), got None",
        ),
        ({"steps": 2.5}, r"^steps \(CLI: --steps\) must be an iterable of step counts"),
        ({"data": "fashion-mnist", "data_root": 3}, r"^data_root \(CLI: --data-root\) must be a path .*got 3"),
        ({"data": "fashion-mnist", "data_root": " "}, r"^data_root \(CLI: --data-root\) must be a path .*got ' '"),
    ],
)
def test_continual_settings_name_a_bad_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ContinualSettings(**kwargs).validate()


def test_quick_settings_name_bad_methods():
    with pytest.raises(ConfigError, match=r"^methods \(CLI: --methods\) must be a name or a list of names, got None"):
        ContinualSettings.quick(methods=None)
    assert list(ContinualSettings.quick(methods="lora").budgets) == ["lora"]  # one string: one method


@pytest.mark.parametrize(
    "check", [check_own_directory, only_results_json, lambda out: check_not_other_experiment(out, "continual")]
)
def test_directory_checks_name_a_bad_out(check):
    with pytest.raises(ConfigError, match=r"^out must be a path \(str or os.PathLike\), got None"):
        check(None)


def test_numpy_integers_are_integers(tmp_path):
    assert seed_list(np.int64(2)) == [0, 1]
    assert seed_list(np.array([3, 5])) == [3, 5]
    result = run_sequential(tmp_path / "seq", ["lora"], seeds=np.int64(1), steps=np.int64(2))
    written = json.loads(result.path.read_text())
    assert written["settings"]["steps"] == 2 and {r["seed"] for r in written["records"]} == {0}


def test_a_data_root_that_is_no_path_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"^data_root \(CLI: --data-root\) must be a path .*got 3"):
        run_sequential(tmp_path / "seq", ["lora"], seeds=1, steps=2, data="fashion-mnist", data_root=3)
    assert not (tmp_path / "seq").exists()
    with pytest.raises(ConfigError, match=r"^root \(CLI: --data-root\) must be a path .*got 3"):
        digits.load_tasks("fashion-mnist", 3)
    with pytest.raises(ConfigError, match=r"^root \(CLI: --data-root\) must be a path .*got \[\]"):
        digits.load_pair_tasks("fashion-mnist", [])


def test_model_helpers_name_a_bad_argument():
    with pytest.raises(ConfigError, match=r"^task_logits: model must be a torch.nn.Module, got None"):
        task_logits(None, torch.zeros(2, 64))
    with pytest.raises(ConfigError, match=r"^DigitsMLP: d_in must be a positive integer, got None"):
        digits.DigitsMLP(d_in=None)
    with pytest.raises(ConfigError, match=r"^DigitsMLP: n_tasks must be a positive integer, got 0"):
        digits.DigitsMLP(n_tasks=0)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("task2_acc", None, r"task2_acc=None is not an accuracy in \[0, 1\]"),
        ("task1_acc_after", "0.9", r"task1_acc_after='0.9' is not an accuracy in \[0, 1\]"),
        ("kl_task1", "x", r"has a bad KL or trainable %"),
        ("trainable_pct", None, r"has a bad KL or trainable %"),
        ("trainable_params", True, r"trainable_params=True must be a positive int"),
    ],
)
def test_a_results_json_with_a_value_of_the_wrong_kind_is_one_error(tmp_path, key, value, message):
    """A published directory (results.json and settings.json, no runs.jsonl) whose results.json was edited."""
    tiny = replace(
        ContinualSettings(methods=("lora",), steps=(2,), stage1_steps=2), budgets={"lora": [Budget("r1", {"rank": 1})]}
    )
    run_continual(tmp_path, seeds=1, settings=tiny)
    (tmp_path / "runs.jsonl").unlink()
    records = json.loads((tmp_path / "results.json").read_text())
    assert len(records_from_dir(tmp_path)[0]) == 1
    records[0][key] = value
    (tmp_path / "results.json").write_text(json.dumps(records))
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'results.json'}: not a results.json of run records \(.*"
                       + message):  # fmt: skip
        records_from_dir(tmp_path)


def test_rescan_names_its_path_arguments(tmp_path):
    for kwargs, name in (
        ({"merged": None, "previous": tmp_path, "out": tmp_path / "o"}, "merged"),
        ({"merged": tmp_path, "previous": None, "out": tmp_path / "o"}, "previous"),
        ({"merged": tmp_path, "previous": tmp_path, "out": "  "}, "out"),
    ):
        with pytest.raises(ConfigError, match=rf"^{name} must be a path \(str or os.PathLike\)"):
            sequential.rescan(**kwargs)
