"""run_continual and run_sequential read ``progress`` through progress.as_callback, as scan, verify and train do: a
value that is no function is refused before any work (it failed at the first event, after OUT was made and stage 1
had started), and the old ``f(done, total, name)`` style is adapted with a DeprecationWarning (it raised TypeError:
missing 2 required positional arguments)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plate_inspect.experiments.continual import ContinualSettings, run_continual
from plate_inspect.experiments.methods import Budget
from plate_inspect.experiments.sequential_tasks import run_sequential

TINY = replace(
    ContinualSettings(methods=("lora",), steps=(2,), stage1_steps=3), budgets={"lora": [Budget("r1", {"rank": 1})]}
)


def _continual(out, progress):
    return run_continual(out, seeds=1, settings=TINY, progress=progress)


def _sequential(out, progress):
    return run_sequential(out, methods=["lora"], seeds=1, steps=2, progress=progress)


@pytest.mark.parametrize(("run", "name"), [(_continual, "run_continual"), (_sequential, "run_sequential")])
@pytest.mark.parametrize("progress", [3, "bar", [print]])
def test_a_progress_that_is_no_function_is_refused_before_any_work(tmp_path, run, name, progress):
    out = tmp_path / "out"
    with pytest.raises(TypeError, match=rf"^{name}: progress must be a function of one ProgressEvent, got "):
        run(out, progress)
    assert not out.exists()


@pytest.mark.parametrize(
    ("run", "name", "total"),
    [(_continual, "run_continual", 3 + 2), (_sequential, "run_sequential", 2 + 3 * 2)],  # stage 1 + the runs' steps
)
def test_the_old_three_argument_style_is_adapted(tmp_path, run, name, total):
    calls = []
    with pytest.warns(DeprecationWarning, match=rf"^{name}: progress\(done, total, name\) is deprecated"):
        run(tmp_path / "out", lambda done, of, label: calls.append((done, of)))
    assert calls == [(done, total) for done in range(1, total + 1)]  # one call per Adam step
