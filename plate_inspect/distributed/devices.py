"""One spawned worker process per device on one machine: a local torchrun without torchrun (``--devices``)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue as queue_mod
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from plate_inspect.errors import BundleError, ConfigError, PlateInspectError
from plate_inspect.progress import ProgressCallback, ProgressCounter, ProgressEvent

if TYPE_CHECKING:
    from plate_inspect.bundle import Bundle
    from plate_inspect.scanner import ScanPlan


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def parse_devices(spec: str | Sequence[str]) -> list[str]:
    """'cuda:0,cuda:1' or 'all' (every visible GPU) -> device names; repeated 'cpu' entries run CPU workers. A list
    of names is taken too; anything else (a number, None) is a ConfigError naming ``devices``. GPUs come back as
    torch names them (``cuda:01`` is ``cuda:1``); one named twice, or not visible, is a ConfigError."""
    from plate_inspect.targets import name_list

    if not isinstance(spec, str):
        spec = name_list(spec, "devices (CLI: --devices)")
    if isinstance(spec, str):
        if spec.strip() == "all":
            count = torch.cuda.device_count()
            if count == 0:
                raise ConfigError(
                    'devices="all" (CLI: --devices all): no CUDA device is visible; use '
                    'device="cpu" (CLI: --device cpu)'
                )
            return [f"cuda:{i}" for i in range(count)]
        spec = [d.strip() for d in spec.split(",") if d.strip()]
    given = [d.strip() for d in spec]
    if not given:
        raise ConfigError("--devices is empty; give e.g. cuda:0,cuda:1 or all")
    devices = [_device_name(d) for d in given]
    cuda = [d for d in devices if d != "cpu"]
    if len(set(cuda)) != len(cuda):
        raise ConfigError(f"--devices names a GPU twice ({', '.join(given)}); give each GPU once")
    count = torch.cuda.device_count()
    for d in cuda:
        if torch.device(d).index >= count:
            raise ConfigError(f"--devices: {d} is not visible (this machine shows {count} GPUs)")
    return devices


def _device_name(entry: str) -> str:
    """One --devices entry as torch names it: ``cpu``, or ``cuda:N`` with N in decimal digits (``cuda:01`` is
    ``cuda:1``, so that naming a GPU twice is seen; torch itself refused it with a traceback)."""
    if entry == "cpu":
        return entry
    head, _, index = entry.partition(":")
    if head != "cuda" or not (index.isascii() and index.isdigit()):
        raise ConfigError(f"--devices: '{entry}' is not cpu or cuda:N")
    return f"cuda:{int(index)}"


def scan_on_devices(
    plan: ScanPlan,
    out: str | os.PathLike,
    devices: Sequence[str],
    *,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> Bundle:
    """Run a scan as one spawned worker process per device (a local torchrun without torchrun), then load it.

    Workers get RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and, unless already set, an equal share of
    the CPU cores as OMP/OpenBLAS/MKL threads. If a worker fails, the others are stopped and the error is raised
    here; rerunning resumes from the part files already written.
    """
    from plate_inspect.bundle import Bundle

    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    n = len(devices)
    port = _free_port()
    threads = str(max(1, (os.cpu_count() or 1) // n))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n)}
    env.update({var: threads for var in _THREAD_VARS if var not in os.environ})
    counter = ProgressCounter(progress, len(plan.targets), "modules", bytes_total=sum(t.nbytes for t in plan.targets))
    counter.start()
    procs = []
    try:
        for rank, device in enumerate(devices):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n)}
            with _environ(rank_env):  # spawned children copy the environment when they start
                proc = ctx.Process(
                    target=_device_worker,
                    args=(plan, str(out), device, overwrite, messages, os.getpid()),
                    name=f"plate-scan-{rank}",
                )
                proc.start()
            procs.append(proc)
        error = _watch(procs, messages, counter)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
    if error is not None:
        raise error
    return Bundle.load(out)


def _watch(procs: list, messages: Any, counter: ProgressCounter) -> PlateInspectError | None:
    """Relay progress until every worker exits; the first failure (its own error, or its exit code) is returned."""
    error: PlateInspectError | None = None
    while True:
        try:
            kind, payload = messages.get(timeout=0.2)
        except queue_mod.Empty:
            kind, payload = None, None
        if kind == "module":
            name, nbytes = payload
            counter.step(name, nbytes=nbytes)
        elif kind == "error" and error is None:
            error = payload
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead and error is None and kind is None:
            p = dead[0]
            error = BundleError(
                f"scan worker {p.name} died (exit code {p.exitcode}); finished parts are kept: rerun to resume"
            )
        if error is not None:
            return error
        if kind is None and all(p.exitcode == 0 for p in procs):
            return None


def _die_with_parent(parent_pid: int) -> None:
    """Linux: this worker is killed when the process that started it dies (kill, SIGTERM, OOM), instead of
    scanning on as an orphan that holds its GPU; a later rerun resumes from the parts written. Elsewhere: no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


def _device_worker(
    plan: ScanPlan, out: str, device: str, overwrite: bool, messages: Any, parent_pid: int | None = None
) -> None:
    from plate_inspect.scanner import run_scan

    if parent_pid is not None:
        _die_with_parent(parent_pid)

    done, read = [0], [0]

    def relay(event: ProgressEvent) -> None:
        """This worker's progress, relayed to the parent process (which counts over all workers); an event that
        repeats ``done`` (worker 0's news of the others, :class:`JobProgress`) is not a module."""
        if event.done > done[0]:
            messages.put(("module", (event.label, (event.bytes_done or 0) - read[0])))
        done[0], read[0] = event.done, event.bytes_done or 0

    try:
        run_scan(plan, out, overwrite=overwrite, device=device, progress=relay)
    except PlateInspectError as e:
        messages.put(("error", e))
        raise SystemExit(2) from None


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
