"""Shared CLI plumbing: the consoles, the one progress bar and the --quiet flag that turns it off."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import click
from rich.console import Console

from plate_inspect.errors import ConfigError
from plate_inspect.formatting import human_bytes
from plate_inspect.progress import ProgressCallback, ProgressEvent

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
for _c in (console, err_console):  # piped or captured output: tables and progress need room, not 80 columns
    if not _c.is_terminal:
        _c.width = max(_c.width, 160)


def quiet_option(*old_names: str) -> Callable[[Any], Any]:
    """The ``--quiet``/``-q`` flag of every command with a progress bar (parameter ``quiet``); ``old_names``: earlier
    spellings it still accepts, named in its help."""
    note = f" ({', '.join(old_names)}: the old name)" if old_names else ""
    return click.option("--quiet", "-q", *old_names, "quiet", is_flag=True, help=f"No progress bar{note}.")


def split_names(text: str | None, option: str = "--target-modules") -> list[str] | None:
    """A comma-separated option value (``--target-modules q_proj,v_proj``) as a list; None when not given. A value
    that names nothing (``,``, ``" , "``: unset shell variables joined by commas) is a ConfigError: read as no value,
    it selected the defaults."""
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ConfigError(f"{option} {text!r} names no module (only commas and blanks); give names, or leave it out")
    return names


@contextlib.contextmanager
def progress_bar(label: str, quiet: bool = False, transient: bool = False) -> Iterator[ProgressCallback | None]:
    """The one rich bar of every long command, on stderr: done/total units, bytes read (when the events carry
    them), elapsed time, ETA and what finished last; under torchrun, the whole job's (``event.job``). Yields the
    callback to pass as ``progress=`` (None if quiet)."""
    if quiet:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TextColumn("{task.fields[read]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[current]}"),
        console=err_console,
        transient=transient,
    )
    task = bar.add_task(label, total=None, unit="", read="", current="")

    def show(event: ProgressEvent) -> None:
        if not bar.live.is_started:  # drawn from the first event on: an early error is not preceded by "0/?"
            bar.start()
        shown = event.job or event  # under torchrun, on rank 0: the whole job's progress
        read = ""
        if shown.bytes_done is not None and shown.bytes_total is not None:
            read = f"{human_bytes(shown.bytes_done)}/{human_bytes(shown.bytes_total)}"
        bar.update(task, completed=shown.done, total=shown.total, unit=shown.unit, read=read, current=event.label)

    try:
        yield show
    finally:
        if bar.live.is_started:
            bar.stop()
