"""Progress that moves within long units: the sequential experiment counts Adam steps (its task-1 training was
silent: it counted whole runs), and a curvature solve reports its Lanczos products as they happen.

Oracles: the optimiser steps and operator products counted independently of the progress code (a counting Adam, the
problem's own product functions wrapped), never timings; the throttle is checked on a fake clock.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plate_inspect import progress as progress_module
from plate_inspect.progress import ProgressCounter, ProgressEvent


class Recorder:
    """A progress callback that keeps every event."""

    def __init__(self) -> None:
        self.events: list[ProgressEvent] = []

    def __call__(self, event: ProgressEvent) -> None:
        self.events.append(event)


@pytest.fixture
def counted_adam(monkeypatch):
    """Every Adam step taken, as the number of progress events ``recorder`` held when it was taken."""
    seen: list[int] = []
    recorder = Recorder()

    class CountingAdam(torch.optim.Adam):
        def step(self, closure=None):
            seen.append(len(recorder.events))
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "Adam", CountingAdam)
    return seen, recorder


def test_sequential_counts_adam_steps_of_task_one_and_of_every_run(tmp_path, counted_adam):
    from plate_inspect.experiments.sequential_tasks import N_TASKS, run_sequential

    seen, rec = counted_adam
    steps = 2
    run_sequential(tmp_path, ["lora"], seeds=[0, 1], steps=steps, progress=rec)
    per_seed = steps + (N_TASKS - 1) * steps  # task 1 (stage 1), then tasks 2..4 of the one method
    assert len(seen) == 2 * per_seed  # the oracle: Adam steps actually taken
    ev = rec.events
    assert [(e.done, e.total, e.unit) for e in ev] == [(i, len(seen), "steps") for i in range(len(seen) + 1)]
    # each event follows its own step: step k is taken with the opening event and k - 1 step events sent
    assert seen == list(range(1, len(seen) + 1))
    labels = [e.label for e in ev[1:]]
    assert labels == (["seed 0: task 1"] * steps + ["seed 0: lora"] * (N_TASKS - 1) * steps
                      + ["seed 1: task 1"] * steps + ["seed 1: lora"] * (N_TASKS - 1) * steps)  # fmt: skip

    seen.clear()
    again = Recorder()  # all kept: one opening event at the total, no stage 1 to train
    run_sequential(tmp_path, ["lora"], seeds=[0, 1], steps=steps, progress=again)
    assert seen == [] and [(e.done, e.total) for e in again.events] == [(6 * steps, 6 * steps)]
    more = Recorder()  # one more seed: the kept runs' steps open as done, the new seed's task 1 and run are counted
    run_sequential(tmp_path, ["lora"], seeds=[0, 1, 2], steps=steps, progress=more)
    assert len(seen) == per_seed
    kept = 6 * steps
    assert [(e.done, e.total) for e in more.events] == [(kept + i, kept + per_seed) for i in range(per_seed + 1)]


def test_within_is_throttled_by_the_clock(monkeypatch):
    """An event within a unit goes out only WITHIN_INTERVAL_S after the last event (of any kind); checked on a fake
    clock, so the test counts events, not time."""
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    rec = Recorder()
    counter = ProgressCounter(rec, 2, "parts")
    counter.start()
    built = []

    def label(n):
        def make():
            built.append(n)
            return f"product {n}"

        return make

    interval = progress_module.WITHIN_INTERVAL_S
    for n in range(1, 13):  # a product every interval / 4
        now[0] += interval / 4
        counter.within(label(n))
    counter.step("solve")
    now[0] += interval / 2
    counter.within(label(13))  # too soon after the step's event
    now[0] += interval / 2
    counter.within(label(14))
    assert [(e.done, e.label) for e in rec.events] == [
        (0, ""), (0, "product 4"), (0, "product 8"), (0, "product 12"), (1, "solve"), (1, "product 14")
    ]  # fmt: skip
    assert built == [4, 8, 12, 14]  # labels of events not sent are never built
    ProgressCounter(None, 2, "parts").within(label(99))  # no callback: nothing, no label
    assert 99 not in built


def test_curvature_solves_report_their_products(monkeypatch):
    """Within each top-eigenvalue solve (Lanczos here: the family is larger than the dense cut-off) one event per
    operator product when the throttle is off; their count is the number of Hessian/GGN/drift products the problem
    computed for that solve, counted by wrapping the problem's own product functions."""
    from plate_inspect.analysis import curvature

    monkeypatch.setattr(progress_module, "WITHIN_INTERVAL_S", 0.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4)).double()
    x, y = torch.randn(32, 8, dtype=torch.float64), torch.arange(32) % 4
    family = curvature.full_family(model)
    assert family.dim > curvature.DENSE_MAX_DIM  # eigsh, not the dense path
    problem = curvature.OldTaskProblem(model, F.cross_entropy, [(x, y)])
    calls = {"hvp": 0, "ggn_vp": 0, "drift_vp": 0}
    products_at_step: list[dict[str, int]] = []

    def counting(kind):
        own = getattr(problem, kind)

        def product(v):
            calls[kind] += 1
            return own(v)

        return product

    for kind in calls:
        setattr(problem, kind, counting(kind))
    rec = Recorder()

    def record(event: ProgressEvent) -> None:
        rec(event)
        if not re.search(r", product \d+$", event.label):
            products_at_step.append(dict(calls))

    curvature.analyze_family(problem, family, n_probes=1, rhos=(0.1,), progress=record)
    solves = [("hvp", "top Hessian eigenvalue"), ("ggn_vp", "top GGN eigenvalue"), ("drift_vp", "drift radius")]
    ev = rec.events
    assert ev[0].done == 0 and all(e.total == curvature.family_parts(1) and e.unit == "parts" for e in ev)
    i = 1
    for k, (kind, what) in enumerate(solves):
        within = []
        while re.search(r", product \d+$", ev[i].label):
            within.append(ev[i])
            i += 1
        assert ev[i].label == f"{family.name}: {what}" and ev[i].done == k + 1
        n = products_at_step[k + 1][kind] - products_at_step[k][kind]  # the oracle: products of this solve
        assert n > 1
        assert [e.label for e in within] == [f"{family.name}: {what}, product {j}" for j in range(1, n + 1)]
        assert all(e.done == k for e in within)  # done does not move within a unit
        i += 1
    assert [e.label for e in ev[i:]] == [f"{family.name}: probe 1/1", f"{family.name}: forgetting curve"]
