"""`plate-inspect scan` inputs as a user gives them: Hugging Face cache layouts, non-plain checkpoints, wrong things
given as the model, output directories in the way (and the default --out of a symlinked or relative path),
SIGTERM. Each test pins a case that broke or misled before.

Hub cases run the real CLI in a fresh interpreter (huggingface_hub reads HF_HOME / HF_ENDPOINT when imported)
against a cache laid out as huggingface_hub lays it out: ``models--org--name/{blobs,refs/main,snapshots/<commit>}``
with the snapshot files symlinked into ``blobs/``. Fingerprints are checked against sha256 of the stored bytes
read back with safetensors itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers_cli import run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import plate_inspect.testing.synthetic as synthetic
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.cli.main import cli
from plate_inspect.errors import BundleError, CheckpointError, CorruptCheckpointError, UnsupportedWeightError
from plate_inspect.scanner import default_out_dir, scan
from plate_inspect.testing.synthetic import write_llama_like

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
CHANGED = "model.layers.0.self_attn.q_proj.weight"  # the weight snapshot B changes


def one_error(args, *needles: str) -> str:
    """The command fails with exit 2 and one `error:` line holding every needle; returns that line."""
    code, output = run_cli(*args)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def stored_sha(path: Path, name: str) -> str:
    """sha256 of a tensor's stored bytes, read with safetensors (the oracle for a module's fingerprint)."""
    with safe_open(str(path), "pt") as f:
        data = f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def fingerprint(out: Path, module: str) -> str:
    return json.loads((out / "manifest.json").read_text())["modules"][module]["fingerprint"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_llama_like(tmp_path_factory.mktemp("m") / "model", layers=2, max_shard_bytes=150_000).path


def all_tensors(model: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def single_file_model(tmp_path: Path, model: Path, tensors: dict[str, torch.Tensor], name="m") -> Path:
    d = tmp_path / name
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(model / "config.json", d / "config.json")
    return d


# --------------------------------------------------------------------------- the Hugging Face cache
def add_snapshot(repo: Path, commit: str, files: list[Path]) -> Path:
    """Files as huggingface_hub caches them: content in blobs/<hash>, a relative symlink in snapshots/<commit>/."""
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in files:
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


@pytest.fixture
def hub_cache(tmp_path, model) -> Path:
    """HF_HOME with acme/tiny at two commits: A (refs/main) and B (CHANGED doubled)."""
    home = tmp_path / "hf-home"
    repo = home / "hub" / "models--acme--tiny"
    add_snapshot(repo, COMMIT_A, sorted(model.iterdir()))
    other = tmp_path / "other"
    shutil.copytree(model, other)
    shard = other / json.loads((model / "model.safetensors.index.json").read_text())["weight_map"][CHANGED]
    tensors = load_file(shard)
    tensors[CHANGED] = (tensors[CHANGED].float() * 2).to(tensors[CHANGED].dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    add_snapshot(repo, COMMIT_B, sorted(other.iterdir()))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT_A)
    return home


def run_fresh(home: Path, *args, offline: bool = True, endpoint: str | None = None) -> tuple[int, str]:
    """`python -m plate_inspect ARGS` in a new interpreter with this HF_HOME (stdout and stderr together)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING")) and "proxy" not in k.lower()}
    env.update(HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost")
    env.update(HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5", HF_HUB_DISABLE_XET="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    proc = subprocess.run(
        [sys.executable, "-m", "plate_inspect", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_scan_says_which_commit_of_the_cache_it_took_and_revision_picks_one(hub_cache, tmp_path, model):
    """Two snapshots: the plain id takes refs/main (A) and says so, commit and snapshot path; --revision B (a full
    commit) scans B's bytes. Before, the user read only 'acme/tiny@main' and never learnt which snapshot it was."""
    snaps = hub_cache / "hub" / "models--acme--tiny" / "snapshots"
    code, output = run_fresh(hub_cache, "scan", "acme/tiny", "--out", tmp_path / "a", "--r", "4", "-q")
    assert code == 0, output
    assert f"model: acme/tiny at main, commit {COMMIT_A} ({snaps / COMMIT_A})" in output, output
    assert f"acme/tiny@main (commit {COMMIT_A[:12]})" in output  # the summary's source line
    shard = snaps / COMMIT_A / json.loads((model / "model.safetensors.index.json").read_text())["weight_map"][CHANGED]
    assert fingerprint(tmp_path / "a", CHANGED.removesuffix(".weight")) == stored_sha(shard, CHANGED)

    code, output = run_fresh(hub_cache, "scan", "acme/tiny", "--revision", COMMIT_B, "--out", tmp_path / "b", "-q")
    assert code == 0, output
    assert f"commit {COMMIT_B} ({snaps / COMMIT_B})" in output
    source = json.loads((tmp_path / "b" / "manifest.json").read_text())["source"]
    assert source == {"kind": "hub", "id": "acme/tiny", "revision": COMMIT_B, "commit": COMMIT_B}
    shard_b = snaps / COMMIT_B / shard.name
    assert fingerprint(tmp_path / "b", CHANGED.removesuffix(".weight")) == stored_sha(shard_b, CHANGED)
    assert stored_sha(shard_b, CHANGED) != stored_sha(shard, CHANGED)


def test_a_revision_the_cache_lacks_names_the_revisions_it_holds(hub_cache, tmp_path):
    """A short commit, a tag not cached, or a cache without refs/main said 'missing: the whole repo, nor is it a
    local path': wrong, the repo is there. Now: which revision is missing, and the branches and commits cached."""
    for args, revision in (
        (["--revision", "ccccccc"], "ccccccc"),
        (["--revision", "v1.0"], "v1.0"),
    ):
        code, output = run_fresh(hub_cache, "scan", "acme/tiny", *args, "--out", tmp_path / "o", "-q")
        assert code == 2 and output.count("error:") == 1, output
        assert f"revision '{revision}' is not in the local Hugging Face cache" in output, output
        assert f"main -> {COMMIT_A}" in output and f"snapshots {COMMIT_A}, {COMMIT_B}" in output, output
        assert "the whole repo" not in output and "nor is it a local path" not in output
        assert "a commit listed there (a unique prefix will do)" in output
    (hub_cache / "hub" / "models--acme--tiny" / "refs" / "main").unlink()  # a cache copied without refs/
    code, output = run_fresh(hub_cache, "scan", "acme/tiny", "--out", tmp_path / "o", "-q")
    assert code == 2 and "revision 'main' is not in the local Hugging Face cache" in output, output
    assert "no branch or tag (refs/ is empty)" in output and COMMIT_B in output, output
    assert not (tmp_path / "o").exists()


def test_an_incomplete_snapshot_with_the_hub_unreachable_names_the_missing_shard(hub_cache, tmp_path, model):
    """A shard's blob missing (a dangling symlink; a download cut off leaves blobs/<hash>.incomplete) and the hub not
    reachable: huggingface_hub hands back the cached, incomplete snapshot, and the scan said the index 'names shard
    ..., which is missing; re-download it' (the index? how?). Now the hub message: what is missing, the command."""
    snap = hub_cache / "hub" / "models--acme--tiny" / "snapshots" / COMMIT_A
    shard = sorted(snap.glob("model-*.safetensors"))[-1]
    blob = shard.resolve()
    blob.rename(blob.with_name(blob.name + ".incomplete"))
    with socket.socket() as s:  # a port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    code, output = run_fresh(
        hub_cache, "scan", "acme/tiny", "--out", tmp_path / "o", "-q", offline=False, endpoint=endpoint
    )
    assert code == 2 and output.count("error:") == 1, output
    assert f"not fully in the local Hugging Face cache ({hub_cache / 'hub'}; missing: {shard.name})" in output, output
    assert f"download them on a connected machine with: hf download acme/tiny {shard.name}" in output, output


# --------------------------------------------------------------------------- the --out directory
def test_out_is_checked_before_the_model_is_opened(hub_cache, tmp_path, model):
    """An --out in the way was found only after the checkpoint was opened: for a hub id, after the download (a
    70B model: hours). Now it is refused first: a file, a path under a file, a model's own directory."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    for out, needle in (
        (afile, f"{afile}: cannot write the bundle: it is a file, not a directory"),
        (afile / "b", f"cannot write the bundle: {afile} is a file, not a directory"),
        (model, "holds safetensors files that are not parts of a PLATE bundle"),
    ):
        # not cached, offline: before, the hub error came first (the download, online)
        code, output = run_fresh(hub_cache, "scan", "acme/not-cached", "--out", out, "-q")
        assert code == 2 and needle in output and "Hugging Face" not in output, output
    with pytest.raises(BundleError, match="it is a file, not a directory"):
        scan("acme/not-cached", afile, offline=True)  # the API checks first too


def test_unwritable_out_is_refused_before_the_model_is_opened(tmp_path, model, monkeypatch):
    """A directory without write permission (os.access says so; root passes chmod, so the answer is simulated for
    the one directory): refused before any checkpoint is read."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real_access(p, mode, **kw))
    opened = []
    monkeypatch.setattr(Checkpoint, "open", classmethod(lambda cls, *a, **k: opened.append(a)))
    one_error(["scan", model, "--out", ro / "bundle", "-q"], f"{ro}: output directory is not writable", "--out")
    assert opened == [] and not (ro / "bundle").exists()


# --------------------------------------------------------------------------- things that are not a model
def test_a_lora_adapter_without_adapter_config_is_refused(tmp_path, model):
    """adapter_model.safetensors alone (adapter_config.json not copied) was scanned as a model: its lora_A and
    lora_B matrices became 'modules'. The same LoRA tensors under another file name too."""
    q = load_file(sorted(model.glob("*.safetensors"))[0])[CHANGED]
    prefix = "base_model.model." + CHANGED.removesuffix(".weight")
    lora = {
        f"{prefix}.lora_A.weight": torch.randn(8, q.shape[1]),
        f"{prefix}.lora_B.weight": torch.zeros(q.shape[0], 8),
    }
    for name in ("adapter_model.safetensors", "model.safetensors"):
        d = tmp_path / name.split(".")[0]
        d.mkdir()
        save_file(lora, str(d / name))
        line = one_error(["scan", d, "--out", tmp_path / f"o-{d.name}", "--r", "4", "-q"], "not a model", "merge")
        assert (name != "model.safetensors") or f"'{prefix}.lora_A.weight'" in line, line
        assert not (tmp_path / f"o-{d.name}").exists()


def test_a_bundle_given_as_the_model_is_named_a_bundle(tmp_path, model):
    """A bundle dir (or one of its part files) as MODEL said 'no target modules matched ...; weights in this
    checkpoint have types: none'. Now: it is a bundle, and the model it was made from."""
    out = tmp_path / "bundle"
    assert run_cli("scan", model, "--out", out, "--r", "4", "-q")[0] == 0
    one_error(["scan", out, "--out", tmp_path / "o", "-q"], f"{out}: is a PLATE init bundle", f"({model})")
    one_error(["scan", out / "layer-00000.safetensors", "--out", tmp_path / "o", "-q"], "is a part file of the PLATE")


@pytest.mark.parametrize("shape", [(64 * 64,), (4, 16, 64)])
def test_a_layer_weight_that_is_not_2d_is_refused_not_dropped(tmp_path, model, shape):
    """q_proj stored flattened (1-D) or folded (3-D) in one layer silently left the scan: 13 of 14 modules, no
    word. Now the tensor is named."""
    tensors = all_tensors(model)
    tensors[CHANGED] = tensors[CHANGED].reshape(shape)
    d = single_file_model(tmp_path, model, tensors)
    one_error(["scan", d, "--out", tmp_path / "o", "-q"], f"tensor '{CHANGED}' has shape {list(shape)}", "2-D")
    # a layer outside --layers is not this scan's business
    code, output = run_cli("scan", d, "--layers", "1", "--out", tmp_path / "o1", "--r", "4", "-q")
    assert code == 0 and "7 target modules" in output, output


@pytest.mark.parametrize(
    ("suffixes", "fmt"),
    [
        ({".q_weight": torch.int32, ".q_invperm": torch.int16, ".q_scale": torch.int32}, "EXL2"),
        ({".W_q": torch.uint8, ".scale": torch.float16, ".zero": torch.float16}, "HQQ"),
        ({".codes": torch.int16, ".codebooks": torch.float16}, "AQLM"),
    ],
)
def test_packed_formats_without_a_quantization_config_name_the_format(tmp_path, model, suffixes, fmt):
    """EXL2, HQQ and AQLM layers (no quantization_config in config.json) read as 'no target modules matched;
    weights have types: lm_head, model.embed_tokens'. Now the packed tensor and its format are named."""
    tensors = {}
    for name, w in all_tensors(model).items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            tensors.update({module + s: torch.zeros(4, 8, dtype=dtype) for s, dtype in suffixes.items()})
        else:
            tensors[name] = w
    d = single_file_model(tmp_path, model, tensors)
    with pytest.raises(UnsupportedWeightError, match=rf"packed quantized weight \({fmt}\)"):
        Checkpoint.open(d)
    one_error(["scan", d, "--out", tmp_path / "o", "-q"], f"({fmt})", "dequantize")
    # refused only as integers: float tensors of these names (some other model's) stay readable
    floats = {f"a{suffix}": torch.ones(2, 2) for suffix in suffixes}
    save_file(floats, str(tmp_path / "floats.safetensors"))
    assert sorted(Checkpoint.open(tmp_path / "floats.safetensors").tensors) == sorted(floats)


# --------------------------------------------------------------------------- which files are the checkpoint
def test_model_safetensors_beside_an_index_is_read_as_transformers_reads_it(tmp_path, model):
    """A dir with model.safetensors and an index + shards: transformers' from_pretrained loads model.safetensors;
    the scan read the shards (other weights than the model uses), silently. Now model.safetensors, with a note."""
    d = tmp_path / "both"
    shutil.copytree(model, d)
    tensors = {k: (v.float() * 3).to(v.dtype) for k, v in all_tensors(model).items()}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    code, output = run_cli("scan", d, "--out", tmp_path / "o", "--r", "4", "-q")
    assert code == 0, output
    assert f"note: {d} holds model.safetensors and other weights (model.safetensors.index.json" in output
    assert fingerprint(tmp_path / "o", CHANGED.removesuffix(".weight")) == stored_sha(d / "model.safetensors", CHANGED)
    assert Checkpoint.open(d).files == [d / "model.safetensors"]
    # an index whose shard is model.safetensors itself is an ordinary sharded checkpoint: the index is read
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    with pytest.raises(CheckpointError, match="lists tensor 'x'"):
        Checkpoint.open(d)


def test_a_tensor_in_two_indexed_shards_with_other_values_is_refused(tmp_path, model):
    """The index names one shard for a tensor that another shard holds too, with other values (shards of two
    saves): which one a loader takes is unclear; the scan took the index's silently. Same values: accepted."""
    d = tmp_path / "dup"
    shutil.copytree(model, d)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    other = next(s for s in sorted(set(weight_map.values())) if s != weight_map[CHANGED])
    original = load_file(d / weight_map[CHANGED])[CHANGED]
    for copy, refused in ((original.clone(), False), ((original.float() * 5).to(original.dtype), True)):
        tensors = {k: v for k, v in load_file(model / other).items()}
        tensors[CHANGED] = copy
        save_file(tensors, str(d / other), metadata={"format": "pt"})
        if refused:
            with pytest.raises(CorruptCheckpointError, match=f"'{CHANGED}' is in '{weight_map[CHANGED]}'"):
                Checkpoint.open(d)
        else:
            assert Checkpoint.open(d).tensors[CHANGED].file.name == weight_map[CHANGED]


# --------------------------------------------------------------------------- interruptions
def test_sigterm_ends_a_scan_like_ctrl_c_and_the_rerun_resumes(tmp_path):
    """SIGTERM (kill, a scheduler's preemption) killed the scan mid-write: exit -15, no message, a stray temp
    file possible and the layer being written lost. Now: the part being written is finished, the interrupt line,
    exit 130; the rerun keeps what was written and ends bit-identical to an uninterrupted scan."""
    model = write_llama_like(tmp_path / "big", layers=4, hidden=256, intermediate=768, heads=4, kv_heads=2).path
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = [sys.executable, "-m", "plate_inspect", "scan", str(model), "--r", "8", "-q", "--out"]
    proc = subprocess.Popen([*args, str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not (out / "layer-00000.safetensors").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    if proc.returncode == 0:
        pytest.skip("the scan finished before SIGTERM arrived (machine too fast for this model)")
    assert proc.returncode == 130, output
    assert "interrupted: finished modules are saved; rerun the same command to resume" in output
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp file left
    kept = len(list(out.glob("layer-*.safetensors")))
    assert json.loads((out / "manifest.json").read_text())["complete"] is False and kept < 4
    rerun = subprocess.run([*args, str(out)], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and "resumed an interrupted scan" in rerun.stderr + rerun.stdout
    assert subprocess.run([*args, str(ref)], capture_output=True, timeout=300).returncode == 0
    identity = [json.loads((p / "manifest.json").read_text())["identity"] for p in (out, ref)]
    assert identity[0] == identity[1]


def test_one_shard_of_a_sharded_checkpoint_says_it_is_one_shard(tmp_path, model):
    """A shard given as the model scanned its layers only, with no word that the others were left out."""
    shards = sorted(model.glob("model-*.safetensors"))
    code, output = run_cli("scan", shards[0], "--out", tmp_path / "o", "--r", "4", "-q")
    assert code == 0, output
    assert f"note: {shards[0].name} is one of the {len(shards)} shards of the checkpoint in {model}" in output, output
    with safe_open(str(shards[0]), "pt") as f:  # the oracle: the shard's own layer weights, nothing more
        in_shard = {k.removesuffix(".weight") for k in f.keys() if k.endswith("_proj.weight")}  # noqa: SIM118
    assert set(json.loads((tmp_path / "o" / "manifest.json").read_text())["modules"]) == in_shard


def test_revision_with_a_local_path_is_refused_not_ignored(tmp_path, model):
    """--revision beside a local path was ignored: the user believed a revision was scanned."""
    one_error(["scan", model, "--revision", "v1.0", "--out", tmp_path / "o", "-q"], "is a local path", "--revision")
    assert not (tmp_path / "o").exists()


def test_a_short_commit_picks_the_one_cached_snapshot_it_starts(hub_cache, tmp_path, model):
    """`--revision bbbbbbb` (git's short form) was 'not in the cache' beside snapshot bbbb...(40): huggingface_hub
    looks snapshots up by full commit. Now a unique prefix scans that snapshot's bytes; a shared one is refused."""
    snaps = hub_cache / "hub" / "models--acme--tiny" / "snapshots"
    code, output = run_fresh(hub_cache, "scan", "acme/tiny", "--revision", "bbbbbbb", "--out", tmp_path / "b", "-q")
    assert code == 0, output
    source = json.loads((tmp_path / "b" / "manifest.json").read_text())["source"]
    assert source["commit"] == COMMIT_B
    shard = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"][CHANGED]
    assert fingerprint(tmp_path / "b", CHANGED.removesuffix(".weight")) == stored_sha(snaps / COMMIT_B / shard, CHANGED)
    add_snapshot(snaps.parent, "b" * 8 + "c" * 32, sorted((snaps / COMMIT_B).iterdir()))
    code, output = run_fresh(hub_cache, "scan", "acme/tiny", "--revision", "bbbbbbb", "--out", tmp_path / "c", "-q")
    assert code == 2 and "revision 'bbbbbbb' starts 2 cached commits" in output, output


@pytest.fixture
def linked(tmp_path, monkeypatch):
    """tmp_path holding a/real/model.safetensors (a real file), b/model.safetensors and b/mine.safetensors (links
    to it), linkdir (a link to a/real) and an HF hub cache snapshot whose model.safetensors links to a blob; the
    working directory is tmp_path, and $PWD says so."""
    (tmp_path / "a" / "real").mkdir(parents=True)
    (tmp_path / "a" / "real" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.safetensors").symlink_to("../a/real/model.safetensors")
    (tmp_path / "b" / "mine.safetensors").symlink_to("../a/real/model.safetensors")
    (tmp_path / "linkdir").symlink_to("a/real")
    repo = tmp_path / "hub" / "models--Org--Tiny-1B"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "9f86d081884c7d65").write_bytes(b"x")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "model.safetensors").symlink_to("../../blobs/9f86d081884c7d65")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "given, name",
    [
        ("b/model.safetensors", "b"),  # was bundles/real: the link's target directory
        ("./b/model.safetensors", "b"),
        ("b/mine.safetensors", "mine"),  # the stem as given (was bundles/real: the target's stem is model)
        ("linkdir", "linkdir"),  # was bundles/real
        ("linkdir/", "linkdir"),
        ("linkdir/model.safetensors", "linkdir"),
        ("a/real", "real"),
        ("a/real/model.safetensors", "real"),
        ("b/..", None),  # the working directory's name
        ("hub/models--Org--Tiny-1B/snapshots/0123abcd", "Tiny-1B"),
        ("hub/models--Org--Tiny-1B/snapshots/0123abcd/model.safetensors", "Tiny-1B"),  # was the blob's hash
        ("Org/Some-Model", "Some-Model"),  # a hub repo id
    ],
)
def test_default_out_is_named_after_the_path_as_given(linked, given, name):
    assert default_out_dir(given) == Path("bundles") / (name or linked.name)
    assert default_out_dir(linked / given) == Path("bundles") / (name or linked.name)  # absolute: the same


def test_default_out_of_dot_is_the_working_directory_as_the_shell_names_it(linked, monkeypatch):
    """`cd linkdir && plate-inspect scan .`: bundles/linkdir, the name the shell shows ($PWD), not the link's
    target; a stale $PWD (a chdir since, as in a script) falls back to the resolved directory."""
    monkeypatch.chdir(linked / "b")
    monkeypatch.setenv("PWD", str(linked / "b"))
    assert default_out_dir(".") == default_out_dir("./model.safetensors") == Path("bundles") / "b"
    monkeypatch.chdir(linked / "linkdir")
    monkeypatch.setenv("PWD", str(linked / "linkdir"))
    assert default_out_dir(".") == default_out_dir("./model.safetensors") == Path("bundles") / "linkdir"
    monkeypatch.setenv("PWD", str(linked / "b"))  # names another directory: not trusted
    assert default_out_dir(".") == Path("bundles") / "real"
    monkeypatch.delenv("PWD")
    assert default_out_dir(".") == Path("bundles") / "real"


def test_cli_scan_of_a_linked_file_names_the_bundle_as_given_and_records_the_weights(tmp_path, monkeypatch):
    """scan b/model.safetensors (a link into a/real) writes bundles/b; the manifest records the resolved file,
    so a scan of the same weights by their own path into that bundle counts as the same model (no note)."""
    synthetic.write_llama_like(tmp_path / "a" / "real", layers=1, seed=0)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.safetensors").symlink_to("../a/real/model.safetensors")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["scan", "b/model.safetensors", "--r", "4", "-q"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == ["b"]
    assert "-> bundles/b" in res.output
    source = json.loads((tmp_path / "bundles" / "b" / "manifest.json").read_text())["source"]
    assert source["id"] == os.path.realpath(tmp_path / "a" / "real" / "model.safetensors")
    again = CliRunner().invoke(cli, ["scan", "a/real", "--out", "bundles/b", "--r", "4", "-q"])
    assert again.exit_code == 0 and "holds a bundle of" not in again.output, again.output
