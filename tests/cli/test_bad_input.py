"""Bad input: one clear line naming the file/tensor, nonzero exit, no traceback, nothing marked complete."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_cli import assert_user_error, mount_tmpfs, run_cli
from safetensors.torch import save_file

from plate_inspect.bundle import MANIFEST, Bundle
from plate_inspect.errors import BundleError
from plate_inspect.testing.synthetic import write_llama_like


@pytest.fixture
def model(tmp_path):
    return write_llama_like(tmp_path / "model", layers=2, max_shard_bytes=150_000).path


def scan_args(model, tmp_path, *extra):
    return ["scan", model, "--out", tmp_path / "out", "--r", "4", "--quiet", *extra]


def test_truncated_shard(tmp_path, model):
    shard = sorted(model.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    assert_user_error(scan_args(model, tmp_path), shard.name, "truncated")


def test_corrupt_header(tmp_path, model):
    shard = sorted(model.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{["
    shard.write_bytes(bytes(data))
    assert_user_error(scan_args(model, tmp_path), shard.name, "corrupt")


def test_index_names_missing_shard(tmp_path, model):
    sorted(model.glob("*.safetensors"))[-1].unlink()
    assert_user_error(scan_args(model, tmp_path), "missing")


def test_index_points_outside_model_dir(tmp_path, model):
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../evil.safetensors"
    index_path.write_text(json.dumps(index))
    assert_user_error(scan_args(model, tmp_path), "outside the model directory")


def test_tensor_listed_in_index_but_absent(tmp_path, model):
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = first_shard
    index_path.write_text(json.dumps(index))
    assert_user_error(scan_args(model, tmp_path), "model.layers.0.mlp.ghost.weight", first_shard, "re-download both")


def test_damaged_files_say_what_to_do(tmp_path, model):
    """QA: some refusals named the file and the damage but not what to do (an empty directory, a corrupt index or
    config.json, an FP8 scale grid that does not fit its weight): each now ends with the remedy."""
    index_path = model / "model.safetensors.index.json"
    index_text = index_path.read_text()
    index_path.write_text(index_text[:-20])
    assert_user_error(scan_args(model, tmp_path), str(index_path), "corrupt index", "re-download it")
    index_path.write_text(index_text)
    config_path = model / "config.json"
    config_text = config_path.read_text()
    config_path.write_text(config_text + "}")
    assert_user_error(scan_args(model, tmp_path), str(config_path), "cannot parse config.json", "re-download it")
    config_path.write_text("[1, 2]")
    assert_user_error(scan_args(model, tmp_path), str(config_path), "not a JSON object", "re-download it")
    config_path.write_text(config_text)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(scan_args(empty, tmp_path), str(empty), "no .safetensors files", "give a Hugging Face model")
    text_file = tmp_path / "weights.npz"
    text_file.write_bytes(b"PK")
    assert_user_error(scan_args(text_file, tmp_path), str(text_file), "not a .safetensors file", "give a model")
    # an FP8 weight whose 128x128 scale grid is [3, 3] for a [176, 64] weight (the grid is [2, 1])
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite_tensor(model, name, torch.randn(176, 64).to(torch.float8_e4m3fn), {name + "_scale_inv": torch.ones(3, 3)})
    config_path.write_text(
        json.dumps(
            {**json.loads(config_text), "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
        )
    )
    assert_user_error(
        scan_args(model, tmp_path), name + "_scale_inv", "expected [2, 1]", "use the config.json that came"
    )


def _rewrite_tensor(model: Path, name: str, new: torch.Tensor, extra: dict[str, torch.Tensor] | None = None) -> None:
    """Replace tensor ``name`` in its shard (adding ``extra`` tensors beside it, listed in the index)."""
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = model / index["weight_map"][name]
    from safetensors.torch import load_file

    tensors = load_file(str(shard))
    tensors[name] = new
    tensors.update(extra or {})
    save_file(tensors, str(shard))
    index["weight_map"].update({k: shard.name for k in extra or {}})
    index_path.write_text(json.dumps(index))


def test_nan_in_weight_names_tensor_and_nothing_is_complete(tmp_path, model):
    name = "model.layers.1.self_attn.q_proj.weight"
    w = torch.randn(64, 64).to(torch.bfloat16)
    w[3, 5] = float("nan")
    _rewrite_tensor(model, name, w)
    assert_user_error(scan_args(model, tmp_path), name, "NaN")
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["complete"] is False  # layer 0 kept for a resume (its part header records its modules):
    assert len(Bundle.load(tmp_path / "out", require_complete=False).modules) == 7


def test_shape_contradicts_config(tmp_path, model):
    _rewrite_tensor(model, "model.layers.0.self_attn.k_proj.weight", torch.randn(48, 64).to(torch.bfloat16))
    assert_user_error(scan_args(model, tmp_path), "model.layers.0.self_attn.k_proj.weight", "config.json")


def test_integer_weight_is_unsupported(tmp_path, model):
    _rewrite_tensor(model, "model.layers.0.mlp.up_proj.weight", torch.zeros(176, 64, dtype=torch.int8))
    assert_user_error(scan_args(model, tmp_path), "model.layers.0.mlp.up_proj.weight", "I8", "not supported"[:9])


def test_quantized_config_is_unsupported(tmp_path, model):
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    assert_user_error(scan_args(model, tmp_path), "gptq")


def test_pickle_only_directory_is_refused(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"not opened")
    assert_user_error(
        ["scan", d, "--out", tmp_path / "o"], "pytorch_model.bin", "never unpickles", "safe_serialization"
    )


def test_no_target_modules_matched_lists_what_exists(tmp_path, model):
    assert_user_error(
        scan_args(model, tmp_path, "--target-modules", "nonexistent_proj"),
        "no target modules matched",
        "self_attn.q_proj",
    )


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--r", "0"], "r must be"),
        (["--tau", "1.5"], "tau must"),
        (["--max-rank", "0"], "max_rank"),
        (["--layers", "3-1"], "--layers"),
    ],
)
def test_settings_out_of_range(tmp_path, model, extra, needle):
    assert_user_error(["scan", model, "--out", tmp_path / "out", *extra], needle)


def test_output_path_under_a_file(tmp_path, model):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert_user_error(["scan", model, "--out", blocker / "bundle", "--quiet"], "cannot write")


def _leftovers(out: Path) -> list[str]:
    """Temp files, or part files that safetensors cannot read completely: what a failed write must not leave."""
    from safetensors import safe_open

    bad = [p.name for p in out.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]
    for part in out.glob("*.safetensors"):
        try:
            with safe_open(str(part), "pt") as f:
                names = f.keys()
                for name in names:
                    f.get_tensor(name)
        except Exception:  # noqa: BLE001 - any failure to read means a partial file
            bad.append(part.name)
    return bad


def test_output_dir_not_writable(tmp_path, model, mounts):
    """A really unwritable directory: chmod where it binds (not root), a read-only tmpfs where we are root."""
    target = tmp_path / "ro"
    if os.geteuid() != 0:
        target.mkdir()
        target.chmod(0o555)
    elif mount_tmpfs(target, "ro,size=64k"):
        mounts.append(target)
    else:
        pytest.skip("running as root (chmod does not stop root's writes) and mounting a read-only tmpfs is refused")
    try:
        assert_user_error(["scan", model, "--out", target / "bundle", "--quiet"], "not writable", "--out")
        assert_user_error(["scan", model, "--out", target, "--quiet"], "not writable", "--out")
    finally:
        if os.geteuid() != 0:
            target.chmod(0o755)  # so pytest can clean up


def test_disk_full_is_a_clear_error_nothing_partial_and_resumes(tmp_path, model, mounts):
    """A real full filesystem (256 KiB tmpfs, the bundle needs ~370 KiB): one line, no partial file, then resume."""
    out = tmp_path / "small"
    if not mount_tmpfs(out, "size=256k"):
        pytest.skip("a full filesystem needs a tmpfs mount (root with mount permission); this machine refuses it")
    mounts.append(out)
    assert_user_error(scan_args(model, tmp_path, "--out", out), "disk full", "resume")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] is False and 0 < len(Bundle.load(out, require_complete=False).modules) < 14
    assert _leftovers(out) == []
    subprocess.run(["mount", "-o", "remount,size=2m", str(out)], check=True)
    code, output = run_cli(*scan_args(model, tmp_path, "--out", out))
    assert code == 0, output
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] is True and len(manifest["modules"]) == 14 and _leftovers(out) == []


def test_foreign_bundle_dir_refused_without_overwrite(tmp_path, model):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text('{"something": "else"}')
    assert_user_error(["scan", model, "--out", out, "--quiet"], "--overwrite")
    code, _ = run_cli("scan", model, "--out", out, "--quiet", "--overwrite", "--r", "4")
    assert code == 0


def test_missing_and_incomplete_bundle(tmp_path, model):
    assert_user_error(["info", tmp_path / "nothing-here"], "nothing-here: does not exist")
    assert_user_error(["verify", tmp_path / "nothing-here"], "does not exist")
    (tmp_path / "afile").write_text("x")
    assert_user_error(["info", tmp_path / "afile"], "afile: is a file, not a bundle directory")
    (tmp_path / "empty").mkdir()
    assert_user_error(["info", tmp_path / "empty"], "empty: not a bundle (no manifest.json)")


def test_damaged_bundle_says_how_to_mend_it_and_the_mend_works(tmp_path, model):
    """A missing or truncated part file, a damaged manifest, a part file given for the bundle: each one line with
    what to do, and doing it (rerunning the scan into the bundle) repairs the bundle."""
    code, _ = run_cli(*scan_args(model, tmp_path))
    assert code == 0
    out = tmp_path / "out"
    parts = sorted(out.glob("layer-*.safetensors"))
    assert len(parts) == 2
    assert_user_error(["info", parts[0]], f"is a part file of the bundle {out}; give the bundle directory")
    parts[1].write_bytes(parts[1].read_bytes()[: parts[1].stat().st_size // 2])
    for damaged in ("truncated", "missing"):
        needles = ("rerun the scan that made this bundle (same model and settings) into", "recomputed")
        assert_user_error(["report", out, "-o", tmp_path / "r.html"], parts[1].name, *needles)
        code, _ = run_cli(*scan_args(model, tmp_path))  # the mend the message names
        assert code == 0
        assert run_cli("verify", out)[0] == 0, damaged
        if damaged == "truncated":
            parts[1].unlink()
    (out / MANIFEST).write_text('{"format": "plate-bun')
    assert_user_error(["report", out, "-o", tmp_path / "r.html"], "unreadable manifest", "--overwrite")
    code, _ = run_cli(*scan_args(model, tmp_path, "--overwrite"))
    assert code == 0 and run_cli("verify", out)[0] == 0


def test_real_console_script_prints_no_traceback(tmp_path):
    exe = shutil.which("plate-inspect", path=str(Path(sys.executable).parent))
    proc = subprocess.run(
        [exe, "scan", str(tmp_path / "missing-model"), "--out", str(tmp_path / "o")], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error:")
    assert len(proc.stderr.strip().splitlines()) <= 3  # one logical line (rich may wrap it)


def test_truncated_single_file_header(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    assert_user_error(["scan", f, "--out", tmp_path / "o"], "model.safetensors", "truncated")


def test_align_k_larger_than_the_embedded_minilm_layers(tmp_path):
    """The embedded MiniLM's attention layers have d_in = 384: k = 512 is a settings error, before any forward pass."""
    text = tmp_path / "t.txt"
    text.write_text("A few words of English text. " * 20, encoding="utf-8")
    assert_user_error(
        ["align", "--k", "8,512", "--text", text, "--quiet"], "k=512", "min(d_out, d_in)=384", "choose k <= 384"
    )


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--r", "300"], "--r must be at most 256"),
        (["--lora-rank", "65"], "--lora-rank must be at most 64"),
        (["--rho", "0,nan"], "finite"),
        (["--rho", "1,inf"], "finite"),
        (["--families", "plate,nope"], "--families"),
        (["--probes", "-1"], "--probes"),
    ],
)
def test_curvature_settings_out_of_range(extra, needle):
    assert_user_error(["curvature", "--quiet", *extra], needle)


def test_values_too_large_for_float32_gram_are_a_clear_error(tmp_path):
    """Finite weights whose float32 Gram would overflow (1e30 x 1e30): one line naming the tensor; float64 scans."""
    w = torch.randn(16, 12, generator=torch.Generator().manual_seed(0))
    w[3, 5] = 1e30
    path = tmp_path / "huge.safetensors"
    save_file({"model.layers.0.mlp.down_proj.weight": w.contiguous()}, str(path))
    assert_user_error(
        ["scan", path, "--out", tmp_path / "out", "--r", "2", "--quiet"], "down_proj", "too large", "float64"
    )
    code, output = run_cli("scan", path, "--out", tmp_path / "out64", "--r", "2", "--precision", "float64", "--quiet")
    assert code == 0, output


def test_bundle_names_a_module_the_user_nearly_gave_and_says_what_it_is(tmp_path, model):
    """A weight name or a misspelt module gets the right module named; another layer's module is never offered."""
    code, _ = run_cli(*scan_args(model, tmp_path))
    assert code == 0
    bundle = Bundle.load(tmp_path / "out")
    assert repr(bundle) == (
        f"Bundle({str(tmp_path / 'out')!r}, model={str(model)!r}, modules=14, r=4, tau=0.9, max_rank=512, complete)"
    )
    q = "model.layers.1.self_attn.q_proj"
    with pytest.raises(BundleError, match=rf"no '\.weight'\); did you mean '{q}'\?$"):
        bundle.q(q + ".weight")
    with pytest.raises(BundleError, match=rf"did you mean '{q}'\?$"):
        bundle.record("model.layers.1.self_attn.qproj")
    with pytest.raises(BundleError, match=r"'model\.layers\.7\.self_attn\.q_proj' in this bundle \(it has 14: see"):
        bundle.record("model.layers.7.self_attn.q_proj")
