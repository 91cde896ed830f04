"""The one way a long-running function reports progress: a ``progress`` callback that receives ProgressEvents.

Every long-running public function (``scan``/``run_scan``, ``audit``, ``write_report``/``report_data``,
``collect_input_moments``/``hf_text_alignment``, ``analyze_families``/``analyze_family``,
``digits.train``/``train_stage1``, ``run_continual``, ``run_sequential``) takes ``progress: ProgressCallback | None``
(keyword ``progress``). It is called once with ``done=0`` before the first unit of work, then once after every
finished unit (a module, a batch, an Adam step, a curvature solve or probe): ``done`` never decreases and the
last event has ``done == total`` when the total is known. A unit of unknown length (a Lanczos solve) also sends
events within it that repeat ``done`` with a label saying how far it has got (:meth:`ProgressCounter.within`: at
most one per :data:`WITHIN_INTERVAL_S`). The CLI draws these events with one rich bar
(``plate_inspect.cli.common.progress_bar``); anything else (a log line, a GUI, a test) is a plain function of one
argument.

Under torchrun a scan's events are each rank's own: ``done``/``total`` count the modules of that rank's share. On
rank 0 every event also carries the whole job's progress as ``event.job`` (another ProgressEvent: modules of all
ranks done, of all planned modules; kept modules of a resume count as done once their weights were checked, as in
a single process), and while rank 0 waits for the others, events that repeat its ``done`` bring the job's news
(sent from a thread of the scan's, one call at a time); once every rank has finished, the last one has
``job.done == job.total``. Elsewhere ``job`` is None.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ProgressEvent:
    """Where a long run stands: ``done`` of ``total`` units finished, the last one being ``label``."""

    done: int
    total: int | None  # None when the number of units is not known up front (an iterator of batches)
    unit: str  # what is counted: "modules", "batches", "steps", "parts", "tensors"
    label: str = ""  # what just finished ("" for the opening event)
    bytes_done: int | None = None  # bytes read so far, where units differ in size (the scan)
    bytes_total: int | None = None
    #: Under torchrun, on rank 0: the whole job's progress (all ranks' modules and bytes), as far as rank 0 has
    #: heard; None elsewhere (see the module's docstring). A bar shows ``event.job or event``.
    job: ProgressEvent | None = None


ProgressCallback = Callable[[ProgressEvent], None]

#: Least time between two events within one unit (:meth:`ProgressCounter.within`): a bar needs no more, and the work
#: that reports (each product of a Lanczos solve) then pays one clock read per call, not an event.
WITHIN_INTERVAL_S = 0.5


class _ScanProgressLike(Protocol):
    """The old scanner front end (``ScanProgress``): still accepted for one release, with a DeprecationWarning."""

    def start(self, total_modules: int, total_bytes: int, already_done: int, already_bytes: int) -> None: ...

    def module_done(self, name: str, nbytes: int) -> None: ...

    def finish(self) -> None: ...


class ProgressCounter:
    """Counts the finished units of one run and sends the events; with no callback it does nothing."""

    def __init__(
        self,
        progress: ProgressCallback | None,
        total: int | None,
        unit: str,
        *,
        done: int = 0,
        bytes_total: int | None = None,
    ) -> None:
        """``done``: units already finished before this run (a resumed run's opening event starts there)."""
        self.progress = progress
        self.total = total
        self.unit = unit
        self.done = done
        self.bytes_total = bytes_total
        self.bytes_done = 0 if bytes_total is not None else None
        self._sent = time.monotonic()  # when the last event went out (within() waits WITHIN_INTERVAL_S after it)

    def start(self) -> None:
        """The opening event (done=0): a front end shows the total before the first, possibly long, unit."""
        self._send("")

    def step(self, label: str, units: int = 1, nbytes: int = 0) -> None:
        """``units`` more units finished, the last one being ``label`` (``nbytes`` of input read for them)."""
        self.done += units
        if self.bytes_done is not None:
            self.bytes_done += nbytes
        self._send(label)

    def within(self, label: Callable[[], str]) -> None:
        """The unit under way has moved on (``done`` unchanged): an event labelled ``label()`` (how far the unit has
        got, e.g. "plate: top Hessian eigenvalue, product 140"), sent only when :data:`WITHIN_INTERVAL_S` has passed
        since the last event, so a tight loop may call it every iteration (``label`` is built only when sent)."""
        if self.progress is not None and time.monotonic() - self._sent >= WITHIN_INTERVAL_S:
            self._send(label())

    def inner(self, label: str) -> ProgressCallback | None:
        """The ``progress`` callback of a sub-task counted in the same units (a trainer's Adam steps inside a run):
        each unit it finishes steps this counter, labelled ``label``; its own opening event is dropped."""
        if self.progress is None:
            return None
        last = [0]

        def send(event: ProgressEvent) -> None:
            if event.done > last[0]:
                self.step(label, event.done - last[0])
                last[0] = event.done

        return send

    def _send(self, label: str) -> None:
        if self.progress is not None:
            self._sent = time.monotonic()
            self.progress(ProgressEvent(self.done, self.total, self.unit, label, self.bytes_done, self.bytes_total))


def as_callback(progress: object, where: str) -> ProgressCallback | None:
    """``progress`` as a ProgressCallback; the old styles (a ScanProgress object, ``f(done, total, name)``) are
    adapted for one release with a DeprecationWarning."""
    if progress is None:
        return None
    if all(hasattr(progress, a) for a in ("start", "module_done", "finish")):
        _deprecated(where, "a ScanProgress object")
        return _from_scan_progress(progress)  # type: ignore[arg-type]
    if not callable(progress):
        raise TypeError(f"{where}: progress must be a function of one ProgressEvent, got {type(progress).__name__}")
    if _positional_arity(progress) == 3:
        _deprecated(where, "progress(done, total, name)")
        old = progress
        moved = _moved()
        return lambda e: old(e.done, e.total, e.label) if e.done and moved(e) else None
    return progress


def _moved() -> Callable[[ProgressEvent], bool]:
    """A filter for the old styles, which took one call per finished unit: True for an event whose ``done`` moved
    (or the opening one), False for one that repeats it (the job's news under torchrun, a unit under way)."""
    last = [-1]

    def moved(e: ProgressEvent) -> bool:
        if e.done == last[0]:
            return False
        last[0] = e.done
        return True

    return moved


def _deprecated(where: str, style: str) -> None:
    warnings.warn(
        f"{where}: {style} is deprecated and will stop working in the next release; pass a function that takes "
        "one plate_inspect.progress.ProgressEvent",
        DeprecationWarning,
        stacklevel=4,
    )


def _positional_arity(fn: object) -> int | None:
    """How many positional arguments ``fn`` requires (None when it cannot be told)."""
    if not callable(fn):
        return None
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def _from_scan_progress(front: _ScanProgressLike) -> ProgressCallback:
    """Events -> the ScanProgress calls (start on the opening event, module_done per module, finish at the end)."""
    last_bytes = [0]
    moved = _moved()

    def send(e: ProgressEvent) -> None:
        if not moved(e):
            return
        if e.done == 0:
            front.start(e.total or 0, e.bytes_total or 0, 0, 0)
        else:
            front.module_done(e.label, (e.bytes_done or 0) - last_bytes[0])
        last_bytes[0] = e.bytes_done or 0
        if e.total is not None and e.done == e.total:
            front.finish()

    return send
