"""The job's key-value stores (torchrun's agent store, the process group's store), every call bounded in time."""

from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_mod
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from plate_inspect.distributed import timing
from plate_inspect.distributed.messages import RESUME, one_line

T = TypeVar("T")


#: What a connection to a store that ended raises (torch's network and store errors, RuntimeErrors).
STORE_ERRORS = tuple(
    getattr(torch.distributed, name)
    for name in ("DistNetworkError", "DistStoreError")
    if hasattr(torch.distributed, name)
) or (RuntimeError,)


class StoreTimeout(RuntimeError):
    """A call to the job's store got no answer within ``timing.STORE_TIMEOUT_SECONDS``."""


class BoundedStore:
    """A key-value store (TCPStore) whose every call returns within ``timeout`` seconds (default
    ``timing.STORE_TIMEOUT_SECONDS``) or raises :class:`StoreTimeout`; once one has timed out, every later call raises
    at once.

    The calls run in order on a daemon thread of this object's own (with ``clone``, over a connection of its own,
    opened there too); a call that never returns leaves that thread blocked, not the caller. ``store`` may also be
    a function that opens the store (on that thread, so that connecting is bounded as well)."""

    def __init__(self, store: Any, clone: bool = False, timeout: float | None = None) -> None:
        self._timeout = timeout  # None: timing.STORE_TIMEOUT_SECONDS (read at each call)
        self._calls: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        self._timed_out: str | None = None
        self._thread = threading.Thread(target=self._serve, args=(store, clone), name="plate-store", daemon=True)
        self._thread.start()

    def _serve(self, store: Any, clone: bool) -> None:
        opened: tuple[bool, Any] = (True, store)
        try:
            if callable(store) and not hasattr(store, "add"):
                opened = (True, store())
            elif clone:
                with contextlib.suppress(Exception):
                    opened = (True, store.clone())
        except BaseException as e:  # a store that cannot be opened: every call raises its error
            opened = (False, e)
        while True:
            item = self._calls.get()
            if item is None:
                return
            fn, box, done = item
            if not opened[0]:
                box.append(opened)
            else:
                try:
                    box.append((True, fn(opened[1])))
                except BaseException as e:
                    box.append((False, e))
            done.set()

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(store)`` on the store's thread, waited for at most ``timing.STORE_TIMEOUT_SECONDS``."""
        if self._timed_out is not None:
            raise StoreTimeout(self._timed_out)
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._calls.put((fn, box, done))
        timeout = timing.STORE_TIMEOUT_SECONDS if self._timeout is None else self._timeout
        if not done.wait(timeout):
            self._timed_out = f"no answer for {timeout:.0f} s"
            raise StoreTimeout(self._timed_out)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def post(self, fn: Callable[[Any], Any]) -> None:
        """``fn(store)`` on the store's thread, not waited for (its result or error is dropped)."""
        if self._timed_out is None:
            self._calls.put((fn, [], threading.Event()))

    def add(self, key: str, amount: int) -> int:
        """The store's counter ``key`` after adding ``amount`` (0 reads it)."""
        return self.call(lambda s: s.add(key, amount))

    def set(self, key: str, value: str) -> None:
        """Store ``value`` under ``key``."""
        self.call(lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        """The value under ``key`` (the store waits for it: check first)."""
        return self.call(lambda s: s.get(key))

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is in the store."""
        return self.call(lambda s: s.check(keys))

    def close(self) -> None:
        """End the store's thread once the calls before have returned (at once if none is pending)."""
        self._calls.put(None)


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


#: The addresses (host:port) of job stores this process found gone: :func:`say_once` does not wait on them again.
_LOST_STORES: set[str] = set()


def lost_store_line(error: BaseException) -> str:
    """The one line for a job whose store (on the first node) failed or stopped answering (and notes it as gone)."""
    _LOST_STORES.add(_store_address())
    what = (
        f"has not answered for {timing.STORE_TIMEOUT_SECONDS:.0f} s"
        if isinstance(error, StoreTimeout)
        else f"is gone ({one_line(error)})"
    )
    return (
        f"lost contact with the job's store at {_store_address()}: it {what}; the first node (torchrun's agent or "
        f"rank 0 there) is down, stopped or unreachable: stop the job; {RESUME}"
    )


def agent_store(timeout: float) -> BoundedStore | None:
    """A client of torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True: the agent on the first node holds the
    store at MASTER_ADDR:MASTER_PORT for the whole job); None without one (rank 0 would hold it, in its process
    group only), or when this process found it gone already. Every call is bounded by ``timeout`` seconds,
    connecting included."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or _store_address() in _LOST_STORES:
        return None
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    wait = datetime.timedelta(seconds=timeout)
    return BoundedStore(lambda: torch.distributed.TCPStore(host, port, is_master=False, timeout=wait), timeout=timeout)
