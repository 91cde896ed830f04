"""How a rank waiting to join the process group, or scanning, reacts to signals and to the other ranks' news."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from plate_inspect.distributed import network, timing
from plate_inspect.distributed.ranks import RankInfo
from plate_inspect.distributed.store import agent_store
from plate_inspect.distributed.tracking import JobTrack


@contextlib.contextmanager
def sigterm_interrupts(info: RankInfo) -> Iterator[None]:
    """On rank 0 of a torchrun job, SIGTERM raises KeyboardInterrupt while the scan runs, so it ends as after a
    Ctrl-C: the CLI's one line says that finished parts are kept and to rerun the same command.

    torchrun stops every rank with SIGTERM when one fails (a killed rank, another node's error); rank 0 used to
    die silently, leaving only torchrun's report, which names the failed rank but not how to go on. Only in the
    main thread, only over the default handler (never a program's own), restored after; not for ``--devices``
    workers, which their parent stops and reports itself. Only the first SIGTERM raises (scancel's and torchrun's
    both come)."""

    if (
        info.world_size == 1
        or not info.is_root
        or "TORCHELASTIC_RUN_ID" not in os.environ
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    fired = False

    def interrupt(signum: int, frame: Any) -> None:
        nonlocal fired
        if fired:  # scancel's SIGTERM and torchrun's: a second one while the first unwinds (finishing the part being
            return  # written, telling the other ranks) would cut that short, raised wherever it lands
        fired = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def sigterm_ignored_while_saying() -> Iterator[None]:
    """While a rank says its line (:func:`say_once`), a SIGTERM at its default action is ignored, not fatal.

    scancel gives every rank a SIGTERM and torchrun, stopped by its own, sends each rank another one: the first ends
    the scan (the CLI turns it into a KeyboardInterrupt), and the CLI's handler is gone by the time the rank says the
    interrupted line. On a busy node torchrun's SIGTERM came seconds later, while rank 1 waited for rank 0's line (or
    before rank 0 had printed it): the rank died there (exit -15, not 130), and a rank 0 killed so left the job
    without its interrupted line.
    Saying is bounded (``timing.SAID_WAIT_SECONDS``, and torchrun's SIGKILL after its shutdown timeout); the process
    exits right after. Only in the main thread, only over the default handler (never a program's own)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _ignore)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _ignore(signum: int, frame: Any) -> None:
    """A signal handler that does nothing (unlike SIG_IGN, a child started meanwhile gets the default back)."""


@contextlib.contextmanager
def stop_signals_end_joining() -> Iterator[None]:
    """While this rank waits to join the process group, SIGTERM and SIGINT end it at once (their default action).

    Joining waits inside torch's C++ code, where a Python signal handler never runs: when another rank failed
    before it joined, torchrun's SIGTERM (or a Ctrl-C it passes on) left this rank waiting until torchrun killed it
    30 s later. Nothing of the scan is written before the group exists (the directory lock is an flock, released
    with the process). Only in the main thread; a signal ignored (SIG_IGN) stays ignored."""

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig, handler in saved.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextlib.contextmanager
def end_joining_once_a_rank_spoke(track: JobTrack) -> Iterator[None]:
    """While this rank waits to join the process group, end it (as torchrun's SIGTERM does) once another rank of
    the job has said a line of its own in the agent store (:func:`say_once`): that rank failed before joining and
    never will, and it said why.

    On one node torchrun stops the waiting ranks when that rank exits; on another node nothing did, and the ranks
    there waited up to ``timing.COLLECTIVE_TIMEOUT`` (24 h) after the failed node's line, with a note every minute.
    Nothing of the scan is written before the group exists. Only under torchrun (its agent store)."""
    store = agent_store(timing.STORE_TIMEOUT_SECONDS) if track.info.world_size > 1 else None
    if store is None:
        yield
        return
    done = threading.Event()
    key = track.key("spoken", 0)

    def watch() -> None:
        with contextlib.suppress(RuntimeError):
            while not done.wait(timing.POLL_SECONDS):
                if store.add(key, 0) > 0 and not done.is_set():
                    os.kill(os.getpid(), signal.SIGTERM)  # (at its default action while joining, see the caller)
                    if not done.wait(timing.QUIET_EXIT_SECONDS):  # SIGTERM ignored: end all the same
                        os._exit(128 + signal.SIGTERM)
                    return

    thread = threading.Thread(target=watch, name="plate-join-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        store.close()


def _store_unreachable() -> str | None:
    """Why this rank cannot reach MASTER_ADDR:MASTER_PORT (:func:`network.unreachable`), or None."""
    host = os.environ.get("MASTER_ADDR", "")
    try:
        port = int(os.environ.get("MASTER_PORT", ""))
    except ValueError:
        return None
    return network.unreachable(host, port, timing.REACH_SECONDS) if host else None


@contextlib.contextmanager
def waiting_note(info: RankInfo) -> Iterator[None]:
    """Say on stderr, every ``timing.JOIN_NOTE_SECONDS``, that this rank is still waiting for the others to join.

    Joining waits as long as ``timing.COLLECTIVE_TIMEOUT`` (a rank may still be planning, or fetching the model into
    its node's cache), silently: a rank that failed before it joined (its model path missing on its node) or was
    never started (WORLD_SIZE left in a shell's environment) would leave the others waiting without a word. A rank
    that cannot reach MASTER_ADDR at all (no route, a name that resolves nowhere or to a host that is not there)
    says that instead: torch retries for as long, and blaming the other ranks sent users looking in the wrong place."""
    done = threading.Event()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"

    def note() -> None:
        waited = 0.0
        while not done.wait(timing.JOIN_NOTE_SECONDS):
            waited += timing.JOIN_NOTE_SECONDS
            cause = _store_unreachable()
            if done.is_set():
                return
            if cause is not None:
                print(
                    f"plate-inspect: rank {info.rank} has waited {waited:.0f} s to join the job at {where} but cannot "
                    f"reach that address ({cause}): MASTER_ADDR must be an address of the first node (rank 0's) "
                    "that every node reaches; if it is wrong, stop the job",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            print(
                f"plate-inspect: rank {info.rank} has waited {waited:.0f} s for the other ranks of WORLD_SIZE="
                f"{info.world_size} to join at {where}; a rank that failed before joining (see its output) or was "
                "never started leaves the others waiting: if so, stop the job",
                file=sys.stderr,
                flush=True,
            )

    thread = threading.Thread(target=note, name="plate-join-note", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
