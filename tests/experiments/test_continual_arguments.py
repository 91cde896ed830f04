"""The continual benchmark's public helpers (ci95, summarize, select_records, symmetric_kl, check_steps) name a bad
argument in one ConfigError instead of a StatisticsError, TypeError or AttributeError from inside; their results on
good arguments are checked against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from plate_inspect.errors import ConfigError
from plate_inspect.experiments.continual import (
    MAX_STEPS,
    RunRecord,
    check_steps,
    ci95,
    select_records,
    summarize,
    symmetric_kl,
)


def _rec(method: str, seed: int, steps: int = 60) -> RunRecord:
    return RunRecord(method, "r8", {}, seed, "digits", steps, 180, False, 100, 1.0, 0.9, 0.8, 0.7, 0.01)


@pytest.mark.parametrize("values", [[], None, 3, "12", [1.0, None], [float("nan")], [1.0, math.inf], [True]])
def test_ci95_names_values_that_are_no_numbers(values):
    with pytest.raises(
        ConfigError, match=r"^ci95: values must be a list of finite numbers \(e.g. \[0, 0.5, 1\]\), got"
    ):
        ci95(values)


def test_ci95_of_integers_and_a_generator():
    # mean 2, sample sd 1, t(0.975, 2) = 4.302653 (a t table): half-width 4.302653 / sqrt(3)
    mean, half = ci95(v for v in (1, 2, 3))
    assert mean == 2.0 and half == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)


@pytest.mark.parametrize(("records", "got"), [(None, "an iterable of RunRecord, got None"), ([3], "RunRecords")])
def test_summarize_names_records_that_are_no_run_records(records, got):
    with pytest.raises(ConfigError, match=rf"^summarize: records must be {got}"):
        summarize(records)


def test_summarize_of_no_records_is_no_rows():
    assert summarize([]) == [] and summarize(iter([])) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": 3}, r"^methods \(CLI: --methods\) must be a name or a list of names, got 3"),
        ({"methods": [None]}, r"^methods \(CLI: --methods\) must be a name or a list of names"),
        ({"steps": 60}, r"^steps \(CLI: --steps\) must be a list of positive integers \(e.g. \[8, 32\]\), got 60"),
        ({"steps": [0]}, r"^steps \(CLI: --steps\) must be a list of positive integers"),
        ({"seeds": [-1]}, r"^seeds must be integers in \[0, 2\^63\), got -1"),
        ({"seeds": [0, 0]}, r"^seed 0 is listed twice"),
        ({"seeds": 1.5}, r"^seeds must be a count or a list of integers, got 1.5"),
    ],
)
def test_select_records_names_a_bad_selection(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        select_records([_rec("lora", 0)], "OUT", **kwargs)


def test_select_records_names_records_that_are_no_list():
    with pytest.raises(ConfigError, match=r"^records must be an iterable of run records"):
        select_records(None, "OUT")


def test_select_records_filters_by_hand():
    records = [_rec(m, seed, steps) for m in ("lora", "plate") for seed in (0, 1) for steps in (60, 120)]
    chosen = select_records(records, "OUT", methods="plate", steps=[120], seeds=[1])  # one string: one method
    assert chosen == [_rec("plate", 1, 120)]
    assert select_records(records, "OUT", seeds=2) == records  # a count: seeds 0..1, as run_continual reads it
    with pytest.raises(ConfigError, match=r"^OUT has no finished run of seed 2 \(CLI: --seeds\); finished: 0, 1"):
        select_records(records, "OUT", seeds=[2])


@pytest.mark.parametrize(
    ("p", "q", "message"),
    [
        (None, torch.zeros(2, 3), r"^symmetric_kl: logits_p must be a non-empty float tensor .*got None"),
        (torch.zeros(2, 3), [[0.0] * 3] * 2, r"^symmetric_kl: logits_q must be a non-empty float tensor"),
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), r"logits_p .*got a Tensor of dtype torch.int64"),
        (torch.zeros(0, 3), torch.zeros(0, 3), r"^symmetric_kl: logits_p must be a non-empty float tensor"),
        (torch.tensor(1.0), torch.tensor(1.0), r"^symmetric_kl: logits_p must be a non-empty float tensor"),
        (torch.zeros(2, 3), torch.zeros(3), r"^symmetric_kl: logits_p \[2, 3\] and logits_q \[3\] differ in shape"),
    ],
)
def test_symmetric_kl_names_bad_logits(p, q, message):
    with pytest.raises(ConfigError, match=message):
        symmetric_kl(p, q)


def test_symmetric_kl_against_a_hand_computation():
    # p = softmax([0, 0]) = (1/2, 1/2), q = softmax([log 3, 0]) = (3/4, 1/4); rows 2 and 3 are identical (KL 0)
    p = torch.tensor([[0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    q = torch.tensor([[math.log(3.0), 0.0], [1.0, 2.0]], dtype=torch.float64)
    kl_pq = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    kl_qp = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert symmetric_kl(p, q) == pytest.approx(0.5 * (0.5 * (kl_pq + kl_qp) + 0.0), rel=1e-12)


@pytest.mark.parametrize("value", [None, 2.5, "60", 0, -3, True])
def test_check_steps_names_a_step_count_that_is_no_positive_integer(value):
    with pytest.raises(ConfigError, match=r"^steps \(CLI: --steps\) must be a positive integer, got "):
        check_steps(value, "steps (CLI: --steps)")


def test_check_steps_keeps_its_ceiling():
    check_steps(MAX_STEPS, "steps (CLI: --steps)")
    with pytest.raises(ConfigError, match=r"^steps \(CLI: --steps\) 1,000,001 is more than 1,000,000 Adam steps"):
        check_steps(MAX_STEPS + 1, "steps (CLI: --steps)")
