"""Alignment of a local Hugging Face model run on text: loading it offline, cutting text into token windows.

``transformers`` is an optional extra: it is imported inside :func:`load_hf_model` only, so the rest of the
analysis package works without it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from plate_inspect.analysis.activations import (
    check_ks,
    collect_input_moments,
    records_from_moments,
    select_linear_modules,
)
from plate_inspect.analysis.alignment_math import AlignmentRecord
from plate_inspect.arguments import positive_int, seed_argument
from plate_inspect.atomic import path_argument
from plate_inspect.errors import CheckpointError, ConfigError, PlateInspectError, os_error_text
from plate_inspect.progress import ProgressCallback

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The text used for the README's MiniLM table: scikit-learn's bundled dataset descriptions (real English prose
#: written by the scikit-learn authors, shipped inside the scikit-learn wheel, which plate-inspect depends on).
SKLEARN_TEXT_SOURCE = "sklearn/datasets/descr/*.rst (shipped with scikit-learn)"


def sklearn_descr_text() -> str:
    """Real English prose available offline: scikit-learn's bundled dataset descriptions, concatenated."""
    from importlib import resources

    files = sorted(
        (p for p in resources.files("sklearn.datasets.descr").iterdir() if p.name.endswith(".rst")),
        key=lambda p: p.name,
    )
    return "\n\n".join(p.read_text(encoding="utf-8") for p in files)


def read_text(path: str | Path) -> str:
    """The text of a UTF-8 file, with a one-line error when it cannot be read or is empty."""
    p = path_argument(path, "path")
    todo = "give a UTF-8 text file (CLI: --text)"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: text file not found; check the path, or {todo}") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory; {todo}") from None
    except UnicodeDecodeError as e:
        where = f"byte 0x{e.object[e.start]:02x} at offset {e.start}"
        raise ConfigError(f"{p}: not UTF-8 text ({where}: a binary file?); {todo}") from None
    except OSError as e:
        raise ConfigError(os_error_text(e) or f"{p}: cannot read ({e}); {todo}") from None
    if not text.strip():
        raise ConfigError(f"{p}: text file is empty; {todo}")
    return text


def token_windows(ids: list[int], window: int, max_tokens: int | None) -> Iterator[list[int]]:
    """Consecutive windows of at most ``window`` token ids, stopping after ``max_tokens`` ids in all."""
    if max_tokens is not None:
        ids = ids[:max_tokens]
    for i in range(0, len(ids), window):
        yield ids[i : i + window]


#: Files a Hugging Face tokenizer is loaded from (one is enough; ``*.tiktoken`` files count too).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
#: Weights after the hidden layers (poolers, task heads): missing ones do not change the activations align reads.
_HEAD_WEIGHT = re.compile(r"(^|\.)(pooler|classifier|score|lm_head|qa_outputs)\.")


def _diagnose_weights(path: Path) -> None:
    """After transformers failed to load ``path``: raise the checkpoint reader's own error for its safetensors
    files (truncated: re-download; no read permission), which says more than transformers' (a file it may not
    read is "No such file"); nothing when the reader finds no fault."""
    from plate_inspect.checkpoint import Checkpoint

    if any(path.glob("*.safetensors")):
        Checkpoint.open(path)


def load_hf_model(model_dir: str | Path) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """(model, tokenizer) from a local Hugging Face directory, never contacting the hub."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "the align command needs transformers: pip install 'plate-inspect[train]' (or pip install transformers)"
        ) from None
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; align needs a local Hugging Face model dir with a tokenizer")
    if not (path / "config.json").exists():
        from plate_inspect.bundle import MANIFEST

        if (path / MANIFEST).is_file():
            raise CheckpointError(
                f"{path}: is a PLATE bundle (plate-inspect scan output), not a model; align reads the model itself: "
                "give the Hugging Face model directory (with its tokenizer) the bundle was made from"
            )
        raise CheckpointError(f"{path}: no config.json; align needs a local Hugging Face model dir")
    if not any((path / name).is_file() for name in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        # without them AutoTokenizer may build an empty vocabulary (every word [UNK]): meaningless activations
        raise CheckpointError(
            f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "align needs the model's tokenizer: save it into the directory (tokenizer.save_pretrained)"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a missing/broken tokenizer
        raise CheckpointError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None
    verbosity = transformers.utils.logging.get_verbosity()
    try:
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()  # its load report: the missing weights are checked below
        model, info = transformers.AutoModel.from_pretrained(str(path), local_files_only=True, output_loading_info=True)
    except Exception as e:
        _diagnose_weights(path)  # the project's own reader names a truncated or unreadable file and what to do
        raise CheckpointError(f"{path}: cannot load the model ({type(e).__name__}: {e})") from None
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    missing = sorted(k for k in info.get("missing_keys", ()) if not _HEAD_WEIGHT.search(k))
    if missing:
        raise CheckpointError(
            f"{path}: the checkpoint lacks {len(missing)} weight{'s' if len(missing) != 1 else ''} the model needs "
            f"(e.g. '{missing[0]}'), which transformers would initialise randomly; pass a complete model directory"
        )
    model.eval()
    return model, tokenizer


def special_token_frame(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The special token ids a tokenizer puts before and after a single sequence (e.g. [CLS] ... [SEP])."""
    probe = "hello"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    framed = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for pos in range(len(framed) - len(bare) + 1):
        if framed[pos : pos + len(bare)] == bare:
            return list(framed[:pos]), list(framed[pos + len(bare) :])
    return [], []


class SeqLenCappedWarning(UserWarning):
    """The requested window is longer than the model's position embeddings; the windows were made shorter."""


def capped_seq_len(seq_len: int, max_positions: int | None) -> tuple[int, str | None]:
    """(the window length used, a note when it is not the one asked for): a window never exceeds the model's
    ``max_position_embeddings`` (longer inputs would index past its position table)."""
    if not max_positions or seq_len <= int(max_positions):
        return seq_len, None
    cap = int(max_positions)
    return cap, (
        f"windows of {seq_len} tokens (CLI: --seq-len) exceed the model's max_position_embeddings ({cap}): "
        f"windows of {cap} tokens are used instead (special tokens included)"
    )


def hf_text_inputs(
    tokenizer: PreTrainedTokenizerBase, text: str, seq_len: int = 256, max_tokens: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Model inputs from text: the tokenized text cut into windows of seq_len tokens (special tokens added)."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if not ids:
        raise ConfigError("the text has no tokens")
    prefix, suffix = special_token_frame(tokenizer)
    window = max(1, seq_len - len(prefix) - len(suffix))
    out = []
    for chunk in token_windows(ids, window, max_tokens):
        input_ids = torch.tensor([prefix + chunk + suffix], dtype=torch.long)
        out.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})
    return out


def hf_text_alignment(
    model_dir: str | Path,
    text: str,
    ks: Sequence[int] = (8, 32),
    max_tokens: int | None = 20000,
    seq_len: int = 256,
    target_modules: str | Sequence[str] | None = None,
    n_random: int = 8,
    seed: int = 0,
    progress: ProgressCallback | None = None,
    notes: Callable[[str], None] | None = None,
) -> list[AlignmentRecord]:
    """Alignment records for a local HF model dir run on ``text`` (unpadded windows, so no pad tokens count).

    A ``seq_len`` beyond the model's ``max_position_embeddings`` is capped there, and said so: through ``notes``
    (one call with the sentence; the CLI prints it on stderr), else as a :class:`SeqLenCappedWarning`.
    """
    path_argument(model_dir, "model_dir")
    if not isinstance(text, str):
        raise ConfigError(f"text must be a str (read a file with read_text), got {type(text).__name__}")
    ks = check_ks(ks)
    if positive_int(seq_len, "seq_len") < 2:
        raise ConfigError(f"seq_len must be at least 2 (CLI: --seq-len), got {seq_len}")
    if max_tokens is not None:
        positive_int(max_tokens, "max_tokens")
    n_random, seed = positive_int(n_random, "n_random"), seed_argument(seed)
    model, tokenizer = load_hf_model(model_dir)
    check_ks(ks, select_linear_modules(model, target_modules))  # before any forward pass
    seq_len, note = capped_seq_len(seq_len, getattr(model.config, "max_position_embeddings", None))
    if note is not None:
        if notes is not None:
            notes(note)
        else:
            warnings.warn(note, SeqLenCappedWarning, stacklevel=2)
    try:
        inputs = hf_text_inputs(tokenizer, text, seq_len=seq_len, max_tokens=max_tokens)
    except PlateInspectError:
        raise
    except Exception as e:  # the tokenizer's own failure (an empty vocab.txt: "Missing [UNK] token")
        raise CheckpointError(
            f"{model_dir}: its tokenizer failed on the text ({type(e).__name__}: {e}); check the directory's "
            "tokenizer files (save them again with tokenizer.save_pretrained)"
        ) from None
    moments = collect_input_moments(model, inputs, target_modules, progress=progress)
    return records_from_moments(model, moments, ks, n_random, seed)
