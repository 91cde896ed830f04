"""Which files a model directory is read from, and the inputs refused before any weight is read.

transformers' order is followed: ``model.safetensors`` before a sharded index, every tensor of the index's shards;
without an index, every ``*.safetensors`` file (refused when numbered shards are missing). ``config.json`` is read
and its quantization_config checked. Pickle files, PEFT/LoRA and PLATE adapters are refused, saying what to give
instead.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plate_inspect.errors import CheckpointError, CorruptCheckpointError, dangling_link, os_error_advice
from plate_inspect.quantized_layouts import check_quantization
from plate_inspect.safetensors_header import TensorInfo, parse_safetensors_header

if TYPE_CHECKING:
    from plate_inspect.checkpoint import Checkpoint

__all__ = [
    "CONVERT_HINT",
    "INDEX_FILE",
    "PICKLE_SUFFIXES",
    "SINGLE_FILE",
    "one_shard_note",
    "open_sharded",
    "read_config",
    "read_weight_map",
    "refuse_adapter",
    "refuse_missing_shards",
    "single_file_first",
    "single_file_is_read",
]

#: Suffixes of pickle checkpoints, never opened (unpickling can run arbitrary code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: How to turn a pickle checkpoint into safetensors (the end of their refusal).
CONVERT_HINT = (
    "convert it once with transformers: AutoModel.from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True)"
)
#: Tensor-name pieces of LoRA-style adapters (PEFT, diffusers/kohya): an adapter, not a model to scan.
_LORA_MARKERS = (".lora_A.", ".lora_B.", ".lora_down.", ".lora_up.", ".lora_embedding_A", ".lora_embedding_B")
#: The one-file checkpoint name transformers loads first, before a sharded index (``from_pretrained``'s order).
SINGLE_FILE = "model.safetensors"
#: A sharded checkpoint's index: its ``weight_map`` names the shard of every tensor.
INDEX_FILE = "model.safetensors.index.json"
#: Numbered shard names (``model-00002-of-00004.safetensors``): stem, number, count.
_SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<i>[0-9]+)-of-(?P<n>[0-9]+)\.safetensors")


def refuse_adapter(ckpt: Checkpoint, use: str = "scan") -> None:
    """A PEFT adapter (adapter_model*.safetensors only, or any LoRA tensor such as ``*.lora_A.weight``) is not a
    model to choose target modules in: its lora_A / lora_B matrices would be scanned as modules. Refused, naming the
    base model to ``use`` instead ("scan", "verify the bundle against") when the adapter names it. (Reading an
    adapter's tensors, as audit does, is fine: this is for target selection and weight checks.)"""
    root, files = ckpt.root, ckpt.files
    plate = next((n for n in sorted(ckpt.tensors) if n.endswith(".plate_A")), None)
    if plate is not None and not files[0].name.startswith("adapter_model"):  # a save_adapter file
        made_from = _plate_adapter_source(ckpt.tensors[plate].file)
        raise CheckpointError(
            f"{ckpt.tensors[plate].file}: a PLATE adapter (save_adapter: '{plate}'), not a model; {use} its base model"
            + (f" ({made_from}, as the adapter records it)" if made_from else "")
            + f", or merge the adapter into it first (plate-inspect merge BASE ADAPTER --out OUT) and {use} OUT"
        )
    lora = next((n for n in sorted(ckpt.tensors) if any(m in n for m in _LORA_MARKERS)), None)
    if lora is None and not (files and all(f.name.startswith("adapter_model") for f in files)):
        return
    adapter_config = root / "adapter_config.json"
    try:
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError):
        base = None
    named = f" ({base}, as adapter_config.json names it)" if isinstance(base, str) and base else ""
    if files[0].name.startswith("adapter_model"):
        what = f"a PEFT adapter ({'adapter_config.json, ' if adapter_config.is_file() else ''}{files[0].name})"
    else:
        what = f"LoRA adapter tensors ('{lora}')"
    raise CheckpointError(
        f"{root}: holds {what}, not a model; {use} its base model{named}, or merge the adapter into it first (peft: "
        "PeftModel.from_pretrained(base, DIR).merge_and_unload().save_pretrained(OUT))"
    )


def _plate_adapter_source(path: Path) -> str | None:
    """The model a save_adapter file's bundle was scanned from (its metadata's ``source`` id), or None."""
    try:
        source = json.loads(parse_safetensors_header(path)[1].get("source", "null"))
    except (CheckpointError, ValueError, RecursionError):
        return None
    made_from = source.get("id") if isinstance(source, dict) else None
    return made_from if isinstance(made_from, str) and made_from else None


def refuse_missing_shards(root: Path, files: Iterable[Path]) -> None:
    """CheckpointError when shards are numbered (``model-00002-of-00004.safetensors``) and some of them are not in
    ``root``, which has no index to name its shards: reading the others would scan part of the model as if whole
    (an interrupted or partial download, a shard copied away). Names the missing files."""
    found: dict[tuple[str, int, str], set[int]] = {}
    for f in files:
        m = _SHARD_NAME.fullmatch(f.name)
        if m and 0 < int(m["i"]) <= int(m["n"]):
            found.setdefault((m["stem"], len(m["i"]), m["n"]), set()).add(int(m["i"]))
    missing = [
        f"{stem}-{i:0{width}d}-of-{n}.safetensors"
        for (stem, width, n), have in sorted(found.items())
        for i in range(1, int(n) + 1)
        if i not in have
    ]
    if missing:
        listed = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(
            f"{root}: shard{'s' if len(missing) > 1 else ''} {listed} missing (the shards are numbered, and there is "
            f"no {INDEX_FILE} to say which tensors they hold); re-download the checkpoint with its index, or give one "
            "shard's file to scan it alone"
        )


def one_shard_note(path: Path) -> list[str]:
    """A note when ``path`` is one shard of the sharded checkpoint beside it: only its tensors are read."""
    index = path.parent / INDEX_FILE
    numbered = _SHARD_NAME.fullmatch(path.name)
    if not index.is_file() and numbered and int(numbered["n"]) > 1:  # no index: its name says it is one of n
        return [
            f"{path.name} is, by its name, shard {int(numbered['i'])} of {int(numbered['n'])} of a sharded checkpoint: "
            "only its tensors are scanned"
        ]
    try:
        shards = set(read_weight_map(index).values()) if index.is_file() else set()
    except CorruptCheckpointError:
        return []
    if path.name not in shards or len(shards) < 2:
        return []
    return [
        f"{path.name} is one of the {len(shards)} shards of the checkpoint in {path.parent} ({INDEX_FILE}): only its "
        f"tensors are scanned; give the directory to scan the whole model"
    ]


def single_file_is_read(has_single_file: bool, shards: Iterable[str] | None) -> bool:
    """Whether ``model.safetensors`` is what a directory is read from: present and not one of the index's
    ``shards`` (None: no index), as transformers' from_pretrained takes it before a sharded index. The one rule of
    the local reader, the hub download and the cache's completeness check."""
    return has_single_file and (shards is None or SINGLE_FILE not in set(shards))


def single_file_first(root: Path, weight_map: dict[str, str] | None) -> tuple[Path | None, list[str]]:
    """``root/model.safetensors`` when it exists and is not one of the index's shards, as transformers'
    from_pretrained takes it before a sharded index (so the scan reads the weights the model loads), with a note
    naming the files left aside; else (None, [])."""
    single = root / SINGLE_FILE
    if not single_file_is_read(single.is_file(), None if weight_map is None else weight_map.values()):
        return None, []
    others = sorted(p.name for p in root.glob("*.safetensors") if p.name != SINGLE_FILE)
    if (root / INDEX_FILE).exists():
        others.insert(0, INDEX_FILE)
    if not others:
        return single, []
    listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    return single, [
        f"{root} holds {SINGLE_FILE} and other weights ({listed}); reading {SINGLE_FILE} only, the file transformers "
        f"loads from this directory (to scan the others, move {SINGLE_FILE} away)"
    ]


def read_config(path: Path) -> dict[str, Any]:
    """A model's config.json ({} when absent), its quantization_config checked; CorruptCheckpointError if unreadable."""
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: cannot parse config.json: {e}; re-download it") from None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{path}: config.json is not a JSON object; re-download it")
    quant = config.get("quantization_config")
    if quant:
        check_quantization(path, quant)
    return config


def read_weight_map(index_path: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name), validated."""
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{index_path}: corrupt index ({type(e).__name__}: {e}); re-download it") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CorruptCheckpointError(
            f"{index_path}: corrupt index (weight_map must map tensor names to file names); re-download it"
        )
    return weight_map


def open_sharded(
    root: Path, index_path: Path, weight_map: dict[str, str]
) -> tuple[list[Path], dict[str, TensorInfo], list[str]]:
    """The shards an index names (inside ``root``, present, headers valid), each listed tensor's place, and notes.

    A tensor a shard holds that the index does not list is read too, as transformers loads every tensor of the
    shards (a hand-edited or stale index): left out, its module dropped out of the scan without a word."""
    root_norm = os.path.normpath(root)
    shard_names = sorted(set(weight_map.values()))
    files: list[Path] = []
    headers: dict[str, dict[str, TensorInfo]] = {}
    for shard in shard_names:
        # lexical check: hub snapshots are symlinks into a blob store, so resolving them would always "escape"
        shard_norm = os.path.normpath(os.path.join(root_norm, shard))
        if os.path.isabs(shard) or not shard_norm.startswith(root_norm + os.sep):
            raise CheckpointError(f"{index_path}: shard '{shard}' points outside the model directory; refusing")
        shard_path = Path(shard_norm)
        if not shard_path.is_file():
            link = dangling_link(shard_path)
            raise CheckpointError(
                f"{index_path}: names shard '{shard}', which is missing; "
                + (link.replace("it is a", f"{shard} is a", 1) if link else "re-download it")
            )
        files.append(shard_path)
        headers[shard], _ = parse_safetensors_header(shard_path)
    tensors: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        info = headers[shard].get(name)
        if info is None:
            raise CheckpointError(
                f"{index_path}: lists tensor '{name}' in '{shard}', but that shard lacks it; the index and its shards "
                "come from different versions: re-download both"
            )
        tensors[name] = info
    unlisted: dict[str, TensorInfo] = {}
    for shard in shard_names:  # a second, different copy in another shard: which one a loader takes is unclear
        for name, other in headers[shard].items():
            listed = tensors.get(name, unlisted.get(name))
            if listed is None:
                unlisted[name] = other
            elif listed.file != other.file and not _same_stored(listed, other):
                said = "(as the index says) " if name in tensors else ""
                raise CorruptCheckpointError(
                    f"{index_path}: tensor '{name}' is in '{listed.file.name}' {said}and, with other "
                    f"values, in '{shard}'; the shards come from different saves: re-download the checkpoint"
                )
    notes = []
    if unlisted:
        first = min(unlisted)
        notes.append(
            f"{INDEX_FILE} does not list {len(unlisted)} tensor{'s' if len(unlisted) > 1 else ''} its shards hold "
            f"('{first}' in {unlisted[first].file.name}{', ...' if len(unlisted) > 1 else ''}); they are read too, "
            "as transformers loads every tensor of the shards (the index is stale or was edited?)"
        )
    return files, {**tensors, **unlisted}, notes


def _same_stored(a: TensorInfo, b: TensorInfo) -> bool:
    """Whether two stored tensors hold the same dtype, shape and bytes (read in 64 MiB blocks)."""
    if (a.dtype, a.shape, a.nbytes) != (b.dtype, b.shape, b.nbytes):
        return False
    block = 64 << 20
    try:
        with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
            for offset in range(0, a.nbytes, block):
                n = min(block, a.nbytes - offset)
                fa.seek(a.start + offset)
                fb.seek(b.start + offset)
                if fa.read(n) != fb.read(n):
                    return False
    except OSError as e:
        raise CheckpointError(
            f"{a.file}: cannot read tensor '{a.name}': {e.strerror or e}; {os_error_advice(e)}"
        ) from None
    return True
