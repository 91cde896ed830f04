"""``merge --overwrite`` into an existing checkpoint directory is crash-safe.

Before, the merged files were moved into OUT one by one: a crash in between left a mix of old and new shards. Now
OUT is replaced as a whole (its other files hard-linked into the new directory, one atomic exchange, or two renames
where there is none). A crash is simulated at every filesystem step of the merge: the step raises, and from then on
every filesystem change does too (the disk stays as the crash left it). The oracle: the full contents of OUT (every
file's bytes, the user's files included) must equal the old or the new directory, and its tensors, loaded with
safetensors as transformers picks the files, the old or the new checkpoint's; a rerun must finish the job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers_train import randomize_adapters, skeleton
from safetensors.torch import load_file

from plate_inspect import scan
from plate_inspect.cli.main import cli
from plate_inspect.errors import CheckpointError
from plate_inspect.formatting import human_bytes
from plate_inspect.testing.synthetic import write_llama_like
from plate_inspect.train import sequential
from plate_inspect.train.layer import apply_bundle, save_adapter
from plate_inspect.train.sequential import finish_interrupted_merge, merge_checkpoint

_MUTATING = ("replace", "rename", "link", "symlink", "mkdir", "rmdir", "unlink")


class _Crash(BaseException):
    """The simulated crash: not an Exception, so no ``except Exception`` handler swallows it."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root, sharded source, same weights as one file, adapter 1, adapter 2, pristine old OUT, expected new OUT).

    The old OUT is a single-file merge with adapter 1 plus a user's files (an adapter, a README, a subdirectory with
    a file, a symlink); the new one is the sharded source merged with adapter 2 (other values, other files: a mix
    of the two could not pass as either). The expected new OUT is an uninterrupted merge into a copy of the old."""
    root = tmp_path_factory.mktemp("atomic")
    sharded = write_llama_like(root / "sharded", layers=1, max_shard_bytes=20_000).path
    single = write_llama_like(root / "single", layers=1).path
    bundle = scan(sharded, root / "bundle", r=8, tau=0.8, max_rank=32)
    adapters = []
    for seed in (5, 7):
        model = skeleton(sharded, bundle.modules)
        randomize_adapters(apply_bundle(model, bundle), seed=seed, scale=0.05)
        adapters.append(save_adapter(model, root / f"adapter{seed}.safetensors"))
    old = root / "old"
    merge_checkpoint(single, adapters[0], old)
    shutil.copy(adapters[0], old / "adapter.safetensors")
    (old / "README.md").write_text("my notes\n")
    (old / "runs").mkdir()
    (old / "runs" / "log.txt").write_text("step 1\n")
    (old / "latest").symlink_to("runs/log.txt")
    os.chmod(old, 0o750)
    new = root / "new"
    shutil.copytree(old, new, symlinks=True)
    merge_checkpoint(sharded, adapters[1], new, overwrite=True)
    assert _contents(old) != _contents(new) and _tensors(old) != _tensors(new)
    return root, sharded, single, adapters[0], adapters[1], old, new


def _contents(d: Path) -> dict[str, object]:
    """Everything under ``d``: file bytes, symlink targets, directories."""
    got: dict[str, object] = {}
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).as_posix()
        got[rel] = ("->", os.readlink(p)) if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return got


def _tensors(d: Path) -> dict[str, bytes]:
    """The checkpoint transformers would load from ``d``, read with safetensors alone: model.safetensors if there,
    else the index's shards (every one must exist). Values as bytes, so that dicts compare exactly."""
    if (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
    got: dict[str, bytes] = {}
    for f in files:
        for name, t in load_file(str(d / f)).items():
            got[name] = t.contiguous().view(torch.uint8).numpy().tobytes() + str(t.dtype).encode()
    return got


def _fresh_out(setup, tmp_path: Path) -> Path:
    old = setup[5]
    out = tmp_path / "out"
    shutil.copytree(old, out, symlinks=True)
    os.chmod(out, 0o750)
    return out


def _crash_at(monkeypatch, n: int, log: list[str]) -> None:
    """Make the (n+1)-th filesystem change of the merge crash, and every one after it."""
    state = {"done": 0, "crashed": False}

    def wrap(name, fn):
        def step(*args, **kwargs):
            if state["crashed"] or state["done"] >= n:
                state["crashed"] = True
                raise _Crash(name)
            state["done"] += 1
            log.append(name)
            return fn(*args, **kwargs)

        return step

    for name in _MUTATING:
        monkeypatch.setattr(os, name, wrap(name, getattr(os, name)))
    monkeypatch.setattr(sequential, "_exchange", wrap("exchange", sequential._exchange))


def _leftovers(out: Path, kind: str) -> list[str]:
    """The temporary directories (and their lock files) of merges into ``out`` beside it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.{kind}-"))


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_a_crash_at_any_step_leaves_the_old_or_the_new_checkpoint_and_a_rerun_finishes(
    setup, tmp_path, monkeypatch, exchange
):
    _, sharded, _, _, adapter2, old, new = setup
    old_c, new_c, old_t, new_t = _contents(old), _contents(new), _tensors(old), _tensors(new)
    if not exchange:
        monkeypatch.setattr(sequential, "_exchange", lambda a, b: False)
    steps: list[str] = []
    with monkeypatch.context() as m:  # count the steps of an uninterrupted merge
        _crash_at(m, 10**6, steps)
        out = _fresh_out(setup, tmp_path / "count")
        steps.clear()
        merge_checkpoint(sharded, adapter2, out, overwrite=True)
    assert _contents(out) == new_c and (out.stat().st_mode & 0o777) == 0o750
    assert steps.count("replace") == (1 if exchange else 4)  # temp dir -> swap name; or back, out away, new in
    seen = {"old": 0, "new": 0, "missing": 0}
    for n in range(len(steps) + 1):
        out = _fresh_out(setup, tmp_path / f"crash{n}")
        with monkeypatch.context() as m:
            _crash_at(m, n, [])
            if n < len(steps):
                with pytest.raises(_Crash):
                    merge_checkpoint(sharded, adapter2, out, overwrite=True)
            else:
                merge_checkpoint(sharded, adapter2, out, overwrite=True)
        if out.exists():  # at this instant, before anything repairs it
            state = _contents(out)
            assert state in (old_c, new_c), f"crash before step {n} ({steps[n : n + 1]}): a mix"
            seen["old" if state == old_c else "new"] += 1
        else:
            seen["missing"] += 1
            assert not exchange, f"crash before step {n}: out missing although the exchange is atomic"
        finish_interrupted_merge(out)  # what the next merge does first
        assert _contents(out) in (old_c, new_c), f"crash before step {n}"
        assert _tensors(out) in (old_t, new_t)
        assert _leftovers(out, "swap") == []
        merge_checkpoint(sharded, adapter2, out, overwrite=True)  # the rerun
        assert _contents(out) == new_c and _leftovers(out, "swap") == []
        assert (out.stat().st_mode & 0o777) == 0o750
        assert _leftovers(out, "partial") == []  # a crash while writing: its lock is free, the rerun deleted it
    assert seen["old"] > 0 and seen["new"] > 0
    assert (seen["missing"] > 0) == (not exchange)  # two renames: a moment without out, finished by the next merge


def test_a_failed_step_rolls_back_or_forward_without_a_mix(setup, tmp_path, monkeypatch):
    """An OSError (not a crash) at any publishing step: the merge says so in one line, or finishes; out is the old
    or the new checkpoint; the next merge clears what is left."""
    _, sharded, _, _, adapter2, old, new = setup
    old_c, new_c = _contents(old), _contents(new)
    for exchange in (True, False):
        for n in range(12):
            out = _fresh_out(setup, tmp_path / f"fail{exchange}{n}")
            with monkeypatch.context() as m:
                if not exchange:
                    m.setattr(sequential, "_exchange", lambda a, b: False)
                calls = {"n": 0}
                real = os.replace

                def failing(a, b, _real=real, _calls=calls, _n=n):
                    _calls["n"] += 1
                    if _calls["n"] == _n + 1:
                        raise OSError(5, "Input/output error", str(b))
                    return _real(a, b)

                m.setattr(os, "replace", failing)
                try:
                    merge_checkpoint(sharded, adapter2, out, overwrite=True)
                except CheckpointError as e:
                    assert "cannot write the merged checkpoint (Input/output error" in str(e) and "\n" not in str(e)
            assert _contents(out) in (old_c, new_c), (exchange, n)
            finish_interrupted_merge(out)
            assert _contents(out) in (old_c, new_c) and _leftovers(out, "swap") == []
            assert _leftovers(out, "partial") == [], (exchange, n)


def test_a_real_crash_between_the_renames_is_finished_by_the_next_merge(setup, tmp_path):
    """A killed process (os._exit, no cleanup), without an atomic exchange, right after out was renamed away: out
    is missing; the next ``plate-inspect merge`` says it finished the interrupted merge and out is the new one."""
    _, sharded, _, _, adapter2, _, new = setup
    out = _fresh_out(setup, tmp_path)
    script = f"""
import os, sys
from plate_inspect.train import sequential
sequential._exchange = lambda a, b: False
real = os.replace
def replace(a, b):
    real(a, b)
    if os.path.basename(str(b)).startswith(".out.swap-") and os.path.basename(str(a)) == "out":
        os._exit(9)
os.replace = replace
sequential.merge_checkpoint({str(sharded)!r}, {str(adapter2)!r}, {str(out)!r}, overwrite=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert not out.exists() and len(_leftovers(out, "swap")) == 1
    partial = _leftovers(out, "swap")[0].replace(".swap-", ".partial-")
    assert _leftovers(out, "partial") == [partial, f"{partial}.lock"]  # the lock file outlives its dead holder
    result = CliRunner().invoke(
        cli, ["merge", str(sharded), str(adapter2), "--out", str(out), "--overwrite", "-q"], terminal_width=400
    )
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"{out}: finished an interrupted merge into it" in said and "temporary directory" not in said
    assert _contents(out) == _contents(new) and os.listdir(out.parent) == ["out"]


def test_without_hard_links_the_files_are_moved_in_with_a_note(setup, tmp_path, monkeypatch):
    _, sharded, _, _, adapter2, _, new = setup
    out = _fresh_out(setup, tmp_path)

    def no_links(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    result = merge_checkpoint(sharded, adapter2, out, overwrite=True)
    assert _contents(out) == _contents(new) and os.listdir(out.parent) == ["out"]
    assert len(result.notes) == 1 and "could not be linked" in result.notes[0] and "one by one" in result.notes[0]


def test_a_mount_point_out_is_filled_in_place_with_a_note(setup, tmp_path, monkeypatch):
    """OUT on another filesystem than its parent cannot be renamed: the temp dir goes inside it (before, it went
    beside OUT and moving the files across filesystems failed), the files are moved in, with a note."""
    _, sharded, _, _, adapter2, _, new = setup
    out = _fresh_out(setup, tmp_path)
    monkeypatch.setattr(sequential, "_is_mount_point", lambda p: Path(p) == out)
    result = merge_checkpoint(sharded, adapter2, out, overwrite=True)
    assert _contents(out) == _contents(new) and os.listdir(out.parent) == ["out"]
    assert "is a mount point" in result.notes[0] and "one by one" in result.notes[0]


def test_a_symlinked_out_keeps_its_link_and_the_directory_is_swapped(setup, tmp_path):
    _, sharded, _, _, adapter2, _, new = setup
    real = _fresh_out(setup, tmp_path / "disk")
    link = tmp_path / "link"
    link.symlink_to(real)
    merge_checkpoint(sharded, adapter2, link, overwrite=True)
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert _contents(real) == _contents(new) and os.listdir(real.parent) == ["out"]


def test_the_swap_is_durable_files_and_links_synced_before_the_exchange_parent_after(setup, tmp_path, monkeypatch):
    """Power loss right after the exchange must not expose empty shards or missing links: every written file and
    the new directory (after the links went in) are fsynced before the exchange, the parent after it."""
    _, sharded, _, _, adapter2, _, new = setup
    out = _fresh_out(setup, tmp_path)
    events: list[tuple[str, str]] = []
    real_fsync, real_link, real_exchange = os.fsync, os.link, sequential._exchange

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def link(src, dst, **kwargs):
        events.append(("link", str(dst)))
        return real_link(src, dst, **kwargs)

    def exchange(a, b):
        events.append(("exchange", str(a)))
        return real_exchange(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(sequential, "_exchange", exchange)
    merge_checkpoint(sharded, adapter2, out, overwrite=True)
    assert _contents(out) == _contents(new)
    at = next(i for i, (kind, _) in enumerate(events) if kind == "exchange")
    tmp = events[at][1].replace(".swap-", ".partial-")  # the name the files were written and linked under
    written = {p.name for p in out.iterdir() if p.suffix in (".safetensors", ".json")} - {"adapter.safetensors"}
    synced = {os.path.basename(p) for kind, p in events[:at] if kind == "fsync" and os.path.dirname(p) == tmp}
    assert written and written <= synced, written - synced
    last_link = max(i for i, (kind, _) in enumerate(events) if kind == "link")
    assert ("fsync", tmp) in events[last_link:at]  # the new directory's entries, links included
    assert ("fsync", str(out.parent)) in events[at:]  # the exchange itself


def test_out_as_the_current_directory_is_filled_in_place_and_stays_the_current_directory(setup, tmp_path, monkeypatch):
    """``--out .``: ``.`` has no parent to build beside (the temp dir went inside OUT and linking OUT's entries into
    it would recurse), and a swapped-out current directory would leave the shell in a deleted directory. The
    files are moved in, with a note; the current directory is the merged one."""
    _, sharded, _, _, adapter2, _, new = setup
    out = _fresh_out(setup, tmp_path)
    monkeypatch.chdir(out)
    result = merge_checkpoint(sharded, adapter2, Path("."), overwrite=True)
    assert _contents(out) == _contents(new) and os.listdir(tmp_path) == ["out"]
    assert Path(os.getcwd()) == out and sorted(os.listdir(".")) == sorted(p.name for p in new.iterdir())
    assert "is the current directory" in result.notes[0] and "one by one" in result.notes[0]


# --- leftovers of killed merges (session 17) ---------------------------------------------------------------------
# A merge holds an flock on the lock file beside its temporary directory for as long as it writes it; the kernel
# drops it when the process dies (SIGKILL too). The next merge deletes the directories whose lock it can take and
# leaves those of running merges alone. The oracle: real processes, stopped at a chosen step or killed there.


def _stopped_merge(source: Path, adapter: Path, out: Path, at: str) -> subprocess.Popen:
    """A merge into ``out`` in a child process that stops, holding its lock, at ``at`` and goes on when a line
    arrives on its stdin: "write" after its first shard is written, "swap" right after its finished directory was
    renamed ``.out.swap-X`` (before the exchange), "renamed" (no exchange) right after ``out`` was renamed away."""
    script = f"""
import os, sys
from plate_inspect.train import sequential
at, state = {at!r}, {{"stopped": False}}
def stop():
    if not state["stopped"]:
        state["stopped"] = True
        print("stopped", flush=True)
        sys.stdin.readline()
real_save, real_replace = sequential.save_file, os.replace
def save_file(*args, **kwargs):
    real_save(*args, **kwargs)
    if at == "write":
        stop()
def replace(a, b):
    real_replace(a, b)
    a, b = os.path.basename(str(a)), os.path.basename(str(b))
    if (at == "swap" and a.startswith(".out.partial-")) or (at == "renamed" and a == "out"):
        if b.startswith(".out.swap-"):
            stop()
sequential.save_file, os.replace = save_file, replace
if at == "renamed":
    sequential._exchange = lambda a, b: False
sequential.merge_checkpoint({str(source)!r}, {str(adapter)!r}, {str(out)!r}, overwrite=True)
print("merged", flush=True)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "stopped", proc.communicate(timeout=60)[1][-2000:]
    return proc


def _go_on(proc: subprocess.Popen) -> str:
    """Let a stopped merge go on; its stdout once it ended (exit status 0 asserted)."""
    stdout, stderr = proc.communicate("\n", timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    return stdout


def _merge_cli(source: Path, adapter: Path, out: Path) -> str:
    result = CliRunner().invoke(
        cli, ["merge", str(source), str(adapter), "--out", str(out), "--overwrite", "-q"], terminal_width=400
    )
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # rich wraps long lines at the console's width


def _file_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not p.is_symlink())


def test_a_killed_merge_s_temporary_directory_is_removed_by_the_next_merge(setup, tmp_path):
    """SIGKILL while writing (after the first shard) leaves ``.out.partial-X`` and its lock file; the next merge
    takes the free lock, deletes both, and says so in one line with the bytes freed (the shard's size)."""
    _, sharded, _, _, adapter2, old, new = setup
    out = _fresh_out(setup, tmp_path)
    proc = _stopped_merge(sharded, adapter2, out, "write")
    partial = out.parent / _leftovers(out, "partial")[0]
    assert _leftovers(out, "partial") == [partial.name, f"{partial.name}.lock"]
    written = _file_bytes(partial)
    assert written > 10_000 and len(list(partial.glob("*.safetensors"))) == 1
    proc.kill()
    assert proc.wait(timeout=60) == -9
    said = _merge_cli(sharded, adapter2, out)
    assert (
        f"{out}: removed 1 temporary directory of killed merges into it, {human_bytes(written)} freed ({partial})"
        in said
    )
    assert "running now" not in said and "delete them" not in said and said.count("removed") == 1
    assert os.listdir(out.parent) == ["out"] and _contents(out) == _contents(new) != _contents(old)


def test_a_stopped_merge_keeps_its_temporary_directory_while_another_merge_runs(setup, tmp_path):
    """A merge holding its lock (stopped after its first shard, then SIGSTOPped too) keeps its directory, byte for
    byte, while a second merge into the same OUT runs, which says so once; let go, the first one finishes its
    merge (its own checkpoint: the old one's weights) over the second one's."""
    import signal

    _, sharded, single, adapter1, adapter2, old, new = setup
    out = _fresh_out(setup, tmp_path)
    proc = _stopped_merge(single, adapter1, out, "write")
    try:
        partial = out.parent / _leftovers(out, "partial")[0]
        before = _contents(partial)
        os.kill(proc.pid, signal.SIGSTOP)
        said = _merge_cli(sharded, adapter2, out)
        assert f"{out}: left 1 temporary directory alone ({partial}): a merge into it is running now" in said
        assert said.count("running now") == 1 and "removed" not in said
        assert _contents(partial) == before and _contents(out) == _contents(new)
        os.kill(proc.pid, signal.SIGCONT)
    except BaseException:
        proc.kill()
        raise
    _go_on(proc)
    assert os.listdir(out.parent) == ["out"] and _contents(out) == _contents(old)


@pytest.mark.parametrize("at", ["swap", "renamed"])
def test_a_merge_swapping_its_checkpoint_in_is_left_alone(setup, tmp_path, at):
    """Two merges racing to one OUT: while the first one's finished directory is ``.out.swap-X`` (before the
    exchange; or, without one, with OUT renamed away), the second one's finish_interrupted_merge must neither delete
    it (before: rmtree of the directory about to become OUT) nor move it (before: it rolled forward under the first
    one, which then put the old checkpoint back). The first one then finishes: OUT is its checkpoint."""
    _, sharded, _, _, adapter2, old, new = setup
    out = _fresh_out(setup, tmp_path)
    proc = _stopped_merge(sharded, adapter2, out, at)
    swap = out.parent / _leftovers(out, "swap")[0]
    partial = swap.with_name(swap.name.replace(".swap-", ".partial-"))
    assert out.exists() == (at == "swap") and partial.exists() == (at == "renamed")
    # without an exchange, its finished directory was renamed back to .out.partial-X before out was renamed away
    held = (
        f"1 temporary directory alone ({swap})"
        if at == "swap"
        else f"2 temporary directories alone ({swap}, {partial})"
    )
    try:
        notes = finish_interrupted_merge(out)
        assert notes == [f"{out}: left {held}: a merge into it is running now"]
        assert swap.is_dir() and out.exists() == (at == "swap")
    except BaseException:
        proc.kill()
        raise
    assert _go_on(proc).strip() == "merged"
    assert os.listdir(out.parent) == ["out"] and _contents(out) == _contents(new)


def _dead_writer(parent: Path, name: str, body: str = "") -> Path:
    """The temporary directory of a process that made it with make_temp_dir, ran ``body`` (``tmp``: the directory)
    and died without cleaning up (os._exit)."""
    script = f"""
import os
from pathlib import Path
from plate_inspect.atomic import make_temp_dir
tmp = make_temp_dir({str(parent)!r}, {name!r}).path
{body}
print(tmp, flush=True)
os._exit(9)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    return Path(proc.stdout.strip())


def test_the_cleanup_frees_only_dead_writers_space_and_never_touches_out(tmp_path, monkeypatch):
    """Dead writers' directories are deleted: beside OUT, and inside it (a merge that filled it in place), and a
    lock file whose directory is gone. Hard links to OUT's files (made while swapping) free nothing and OUT keeps
    them; a symlink inside is not followed. A ``.out.partial-X`` symlink to OUT and a directory without a lock file
    (an older version) are not deleted; the latter is named."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"w" * 5000)
    (out / "README.md").write_text("mine\n")
    before = _contents(out)
    body = (
        "(tmp / 'model.safetensors').write_bytes(b'n' * 1234)\n"
        f"os.link({str(out / 'README.md')!r}, tmp / 'README.md')\n"
        f"(tmp / 'link').symlink_to({str(out)!r})"
    )
    beside = _dead_writer(tmp_path, "out", body)
    inside = _dead_writer(out, "out", "(tmp / 'model.safetensors').write_bytes(b'i' * 100)")
    gone = _dead_writer(tmp_path, "out", "tmp.rmdir()")
    old_version = tmp_path / ".out.partial-0123456789ab"
    old_version.mkdir()
    (old_version / "model.safetensors").write_bytes(b"o" * 2000)
    (tmp_path / ".out.partial-aaaaaaaaaaaa").symlink_to(out)
    assert (tmp_path / f"{gone.name}.lock").is_file() and not gone.exists()
    notes = finish_interrupted_merge(out)
    removed = f"{out}: removed 2 temporary directories of killed merges into it, 1.33 KB freed ({beside}, {inside})"
    assert notes == [
        removed,
        f"1 temporary directory of an interrupted merge into {out} (2.00 KB: {old_version}); delete them unless a "
        "merge into it is running now (made without a lock, by an older plate-inspect or on a filesystem without "
        "flock, so this merge cannot tell)",
    ]
    assert _contents(out) == before and (out / "README.md").stat().st_nlink == 1
    assert sorted(os.listdir(tmp_path)) == [".out.partial-0123456789ab", ".out.partial-aaaaaaaaaaaa", "out"]
    assert finish_interrupted_merge(out) == notes[1:]  # nothing left to remove: the same note, once per merge


def test_without_flock_nothing_is_deleted(tmp_path, monkeypatch):
    """A filesystem without flock (some network mounts: ENOLCK): a merge there leaves no lock file, and a cleaner
    that cannot lock deletes nothing; both name the directory as before."""
    out = tmp_path / "out"
    no_flock = (
        "import fcntl, errno\ndef refuse(*a): raise OSError(errno.ENOLCK, 'No locks available')\nfcntl.flock = refuse\n"
    )
    script = f"{no_flock}from plate_inspect.atomic import make_temp_dir\nt = make_temp_dir({str(tmp_path)!r}, 'out')\n"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    (made,) = tmp_path.iterdir()
    assert made.is_dir() and made.name.startswith(".out.partial-")  # no lock file beside it
    locked = _dead_writer(tmp_path, "out")
    import fcntl

    def refuse(*args):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    notes = finish_interrupted_merge(out)
    assert len(notes) == 1 and notes[0].startswith(f"2 temporary directories of an interrupted merge into {out}")
    assert made.is_dir() and locked.is_dir() and (tmp_path / f"{locked.name}.lock").is_file()


def test_a_directory_that_cannot_be_deleted_is_named_and_its_lock_file_kept(tmp_path, monkeypatch):
    """Deleting fails (another user's files in a sticky directory, say): one line naming it and why; the lock file
    stays, so the next merge tries again."""
    out = tmp_path / "out"
    dead = _dead_writer(tmp_path, "out", "(tmp / 'model.safetensors').write_bytes(b'x')")

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    assert finish_interrupted_merge(out) == [
        f"{out}: could not delete {dead}, left by a killed merge into it (Permission denied)"
    ]
    assert dead.is_dir() and (tmp_path / f"{dead.name}.lock").is_file()
    monkeypatch.undo()
    assert finish_interrupted_merge(out)[0].startswith(f"{out}: removed 1 temporary directory")
    assert os.listdir(tmp_path) == []


def test_make_temp_dir_holds_its_lock_until_released(tmp_path):
    """While held (this process: another open file of the lock), a claim finds it live; released, the lock file is
    gone and the directory counts as unknown (no lock file), never as dead."""
    from plate_inspect.atomic import Claim, claim_temp_dir, make_temp_dir

    temp = make_temp_dir(tmp_path, "out")
    assert temp.path.is_dir() and (tmp_path / f"{temp.path.name}.lock").is_file()
    with claim_temp_dir(temp.path) as claim:
        assert claim is Claim.LIVE
    temp.release()
    assert os.listdir(tmp_path) == [temp.path.name]
    with claim_temp_dir(temp.path) as claim:
        assert claim is Claim.UNKNOWN
