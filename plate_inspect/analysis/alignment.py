"""Weight geometry vs. activation geometry (paper appendix "Weight geometry vs. activation geometry").

For every target linear layer with weight W (d_out x d_in) and input activations X (N x d_in), compare three
k-dimensional input subspaces by the fraction of activation variance they capture,
``VE_k(S) = tr(S^T Sigma S) / tr(Sigma)`` with ``Sigma = X^T X / N`` (uncentred, as in the paper):

- the weight basis V_k: top-k right singular vectors of W (what PLATE's Q is the complement of);
- the activation oracle U_k: top-k eigenvectors of Sigma (the best any k-frame can do);
- a Haar-random k-frame (mean over several seeded draws; its expectation is k / d_in).

and the alignment ``AL_k = ||U_k^T V_k||_F^2 / k`` (1 when the subspaces coincide; chance level k / d_in).

Activations are never stored: forward pre-hooks accumulate X^T X (float64) per layer, batch by batch.
The math is pure (:func:`alignment_from_moments`); :func:`weight_activation_alignment` takes any torch model and
an iterable of inputs; :func:`hf_text_alignment` runs a local Hugging Face model with its tokenizer on text
(``transformers`` is an optional extra, imported only there).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plate_inspect.arguments import iterable_argument, positive_int, positive_ints, seed_argument
from plate_inspect.atomic import path_argument
from plate_inspect.errors import AlignmentError, CheckpointError, ConfigError, PlateInspectError, os_error_text
from plate_inspect.geometry import random_orthonormal, symmetric_eigh
from plate_inspect.progress import ProgressCallback, ProgressCounter
from plate_inspect.targets import _NEVER_BY_DEFAULT, FAMILY_TARGETS, _matches, name_list
from plate_inspect.train.layer import model_argument

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The text used for the README's MiniLM table: scikit-learn's bundled dataset descriptions (real English prose
#: written by the scikit-learn authors, shipped inside the scikit-learn wheel, which plate-inspect depends on).
SKLEARN_TEXT_SOURCE = "sklearn/datasets/descr/*.rst (shipped with scikit-learn)"


# --------------------------------------------------------------------------- records
@dataclass
class AlignmentRecord:
    """One (module, k) row: variance explained by three k-frames, and weight/activation alignment."""

    module: str
    k: int
    d_in: int
    ve_weight: float
    ve_oracle: float
    ve_random: float
    al_weight: float
    al_chance: float
    n_samples: int = 0

    @property
    def ve_ratio(self) -> float:
        """VE_k(W) / VE_k(random): how many times more activation variance the weight basis captures."""
        return self.ve_weight / self.ve_random if self.ve_random > 0 else float("inf")

    @property
    def al_over_chance(self) -> float:
        """AL_k / (k / d_in): how many times the chance-level alignment of a random k-frame."""
        return self.al_weight / self.al_chance if self.al_chance > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        """The record as the CLI's ``--json`` prints it (exactly these eight keys)."""
        d = asdict(self)
        d.pop("n_samples")
        return d


@dataclass
class ActivationMoments:
    """Streamed second moment of one layer's inputs: sum of x x^T over n rows (float64)."""

    xtx: torch.Tensor  # [d_in, d_in]
    n: int

    @property
    def sigma(self) -> torch.Tensor:
        """Sigma_act = X^T X / N."""
        return self.xtx / max(self.n, 1)


# --------------------------------------------------------------------------- pure math
def top_right_singular_vectors(weight: torch.Tensor, k: int) -> torch.Tensor:
    """V_k: the top-k eigenvectors of W^T W (top-k right singular vectors of W, padded by null directions)."""
    w = weight.detach().to("cpu", torch.float64)
    _, evecs = symmetric_eigh(w.T @ w)
    return evecs[:, -k:].flip(1).contiguous()


def variance_explained(sigma: torch.Tensor, frame: torch.Tensor) -> float:
    """VE = tr(F^T Sigma F) / tr(Sigma) for an orthonormal frame F (d_in x k)."""
    total = float(torch.diagonal(sigma).sum())
    if total <= 0:
        return 0.0
    return float(((sigma @ frame) * frame).sum()) / total


def alignment_from_moments(
    module: str,
    weight: torch.Tensor,
    sigma: torch.Tensor,
    ks: Sequence[int],
    n_random: int = 8,
    seed: int = 0,
    n_samples: int = 0,
) -> list[AlignmentRecord]:
    """VE_k (weight, oracle, random), AL_k and chance for one layer, from W [d_out, d_in] and Sigma [d_in, d_in]."""
    for argument, value in (("weight", weight), ("sigma", sigma)):
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{module}: {argument} must be a torch tensor, got {type(value).__name__}")
    ks = positive_ints(ks, "ks")
    n_random, seed = positive_int(n_random, "n_random"), seed_argument(seed)
    if weight.ndim != 2:
        raise AlignmentError(f"{module}: weight must be 2-D, got shape {list(weight.shape)}")
    d_in = weight.shape[1]
    if tuple(sigma.shape) != (d_in, d_in):
        raise AlignmentError(f"{module}: activation moment is {list(sigma.shape)}, weight has d_in={d_in}")
    sigma = sigma.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(sigma).all()):  # eigh fails on it (LinAlgError), or every figure is NaN
        raise AlignmentError(
            f"{module}: the activation moment holds NaN or Inf: the layer's inputs were not finite (check the inputs "
            "and the model's earlier layers)"
        )
    sigma = 0.5 * (sigma + sigma.T)
    evals, evecs = symmetric_eigh(sigma)
    evals, evecs = evals.flip(0), evecs.flip(1)
    total = float(torch.diagonal(sigma).sum())
    w_basis = top_right_singular_vectors(weight, max(ks))
    out = []
    rank_bound = min(weight.shape)
    for k in ks:
        if not 1 <= k <= rank_bound:
            raise ConfigError(
                f"{module}: k={k} must lie in 1..min(d_out, d_in)={rank_bound} (beyond W's rank its top-k right "
                "singular directions are arbitrary)"
            )
        if 0 < n_samples < k:
            raise AlignmentError(
                f"{module}: only {n_samples} activation rows for k={k}: the activation covariance has rank <= "
                f"{n_samples}, so its top-{k} subspace holds all the variance and the figures mean nothing; give "
                "more text (--text FILE, --max-tokens) or a smaller --k"
            )
        v_k, u_k = w_basis[:, :k], evecs[:, :k]
        ve_rand = [
            variance_explained(sigma, random_orthonormal(d_in, k, seed=seed + 7919 * i + k, dtype=torch.float64))
            for i in range(n_random)
        ]
        out.append(
            AlignmentRecord(
                module=module,
                k=int(k),
                d_in=int(d_in),
                ve_weight=variance_explained(sigma, v_k),
                ve_oracle=float(evals[:k].clamp_min(0).sum()) / total if total > 0 else 0.0,
                ve_random=sum(ve_rand) / len(ve_rand) if ve_rand else float("nan"),
                al_weight=float((u_k.T @ v_k).pow(2).sum()) / k,
                al_chance=k / d_in,
                n_samples=int(n_samples),
            )
        )
    return out


# --------------------------------------------------------------------------- hooks on a torch model
def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """W as [d_out, d_in] for nn.Linear and transformers' Conv1D (stored [d_in, d_out]); None otherwise."""
    if isinstance(module, nn.Linear):
        return module.weight
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
        return weight.T
    return None


def _selected_weight(name: str, module: nn.Module) -> torch.Tensor:
    """W of a layer :func:`select_linear_modules` chose (it chose it because it has one)."""
    weight = linear_weight(module)
    assert weight is not None, f"{name} is not a linear layer"
    return weight


def select_linear_modules(model: nn.Module, target_modules: str | Sequence[str] | None = None) -> dict[str, nn.Module]:
    """Target linear layers by name (suffixes or regexes, as in ``scan``); default: the family's or every linear.

    One string is one pattern (not a sequence of one-character patterns: ``"10"`` would select layers 1 and 0)."""
    model_argument(model, "select_linear_modules")
    if target_modules is not None:
        names = name_list(target_modules) if isinstance(target_modules, (str, Iterable)) else None
        if names is None or not all(isinstance(t, str) for t in names):
            raise ConfigError(
                f"target_modules must be a list of module names or patterns (or one), got {target_modules!r:.80}"
            )
        target_modules = names
    linears = {n: m for n, m in model.named_modules() if n and linear_weight(m) is not None}
    if target_modules:
        chosen = {n: m for n, m in linears.items() if any(_matches(n, p) for p in target_modules)}
    else:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        patterns = FAMILY_TARGETS.get(str(model_type)) if model_type else None
        chosen = {
            n: m
            for n, m in linears.items()
            if not _NEVER_BY_DEFAULT.search(n) and (patterns is None or any(_matches(n, p) for p in patterns))
        }
    if not chosen:
        raise AlignmentError(
            "no target linear layers matched"
            + (f" {list(target_modules)}" if target_modules else "")
            + f"; linear layers in this model: {', '.join(list(linears)[:20]) or 'none'}"
        )
    return chosen


def _call(model: nn.Module, item: Any) -> Any:
    """One forward pass on one input: ``model(**item)`` for a dict, ``model(*item)`` for a tuple/list."""
    if isinstance(item, dict):
        return model(**item)
    if isinstance(item, (tuple, list)):
        return model(*item)
    return model(item)


def collect_input_moments(
    model: nn.Module,
    inputs: Iterable[Any],
    target_modules: str | Sequence[str] | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, ActivationMoments]:
    """Run ``model`` on every input and accumulate X^T X of each target layer's input (streamed, float64).

    An input is passed as ``model(**item)`` for a dict, ``model(*item)`` for a tuple/list, else ``model(item)``;
    ``forward(model, item)`` overrides that. Every leading dimension of a layer input counts as a sample row.
    ``progress`` gets one event per forward pass (unit "batches"; total known when ``inputs`` has a length).
    """
    model_argument(model, "collect_input_moments")
    iterable_argument(inputs, "inputs", "model inputs (a list of batches, a DataLoader)")
    modules = select_linear_modules(model, target_modules)
    moments: dict[str, ActivationMoments] = {}
    handles = []

    def make_hook(name: str, d_in: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(_mod: nn.Module, args: tuple[Any, ...]) -> None:
            if args[0].shape[-1] != d_in:  # else a RuntimeError from reshape: "shape '[-1, 64]' is invalid"
                raise AlignmentError(
                    f"{name}: its input has {args[0].shape[-1]} features in the last dimension, the layer takes "
                    f"{d_in}: the inputs do not fit this model (check their shape)"
                )
            x = args[0].detach().reshape(-1, d_in).to(torch.float64)
            m = moments.get(name)
            if m is None:
                moments[name] = ActivationMoments(x.T @ x, x.shape[0])
            else:
                m.xtx += x.T @ x
                m.n += x.shape[0]

        return hook

    for name, mod in modules.items():
        d_in = _selected_weight(name, mod).shape[1]
        handles.append(mod.register_forward_pre_hook(make_hook(name, d_in)))
    was_training = model.training
    model.eval()
    counter = ProgressCounter(progress, len(inputs) if isinstance(inputs, Sized) else None, "batches")
    counter.start()
    try:
        with torch.no_grad():
            for i, item in enumerate(inputs):
                out = forward(model, item) if forward is not None else _call(model, item)
                del out
                counter.step(f"batch {i + 1}")
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [n for n in modules if n not in moments]
    if missing:
        raise AlignmentError(
            f"these layers saw no input: {missing[:5]}{' ...' if len(missing) > 5 else ''} (the inputs were empty, or "
            "their forward never runs: e.g. torch's nn.MultiheadAttention applies out_proj's weight directly); "
            "leave them out with target_modules (CLI: --target-modules)"
        )
    return {n: moments[n] for n in modules}


def weight_activation_alignment(
    model: nn.Module,
    inputs: Iterable[Any],
    ks: Sequence[int] = (8, 32),
    target_modules: str | Sequence[str] | None = None,
    n_random: int = 8,
    seed: int = 0,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> list[AlignmentRecord]:
    """VE_k / AL_k records for every target linear layer of any torch model, fed an iterable of inputs."""
    model_argument(model, "weight_activation_alignment")
    iterable_argument(inputs, "inputs", "model inputs (a list of batches, a DataLoader)")
    n_random, seed = positive_int(n_random, "n_random"), seed_argument(seed)
    ks = _check_ks(ks, select_linear_modules(model, target_modules))
    moments = collect_input_moments(model, inputs, target_modules, forward=forward)
    return _records_from_moments(model, moments, ks, n_random, seed)


def _records_from_moments(
    model: nn.Module, moments: dict[str, ActivationMoments], ks: Sequence[int], n_random: int, seed: int
) -> list[AlignmentRecord]:
    """VE_k / AL_k records of each layer whose input moments were collected, for the k values its shape allows."""
    modules = dict(model.named_modules())
    records: list[AlignmentRecord] = []
    for name, m in moments.items():
        weight = _selected_weight(name, modules[name])
        usable = [k for k in ks if k <= min(weight.shape)]
        records.extend(alignment_from_moments(name, weight, m.sigma, usable, n_random, seed, n_samples=m.n))
    return records


def _check_ks(ks: Sequence[int], modules: dict[str, nn.Module] | None = None) -> list[int]:
    """Positive k values, each at most min(d_out, d_in) of every target layer (W's rank bound; when the layers are
    known): beyond it W's top-k right singular directions are arbitrary."""
    ks = positive_ints(ks, "ks")
    if modules:
        sides = {name: min(_selected_weight(name, m).shape) for name, m in modules.items()}
        smallest = min(sides.values())
        if max(ks) > smallest:
            narrow = [n for n, d in sides.items() if d < max(ks)]
            raise ConfigError(
                f"k={max(ks)} exceeds min(d_out, d_in)={smallest} of {len(narrow)} target layers (e.g. {narrow[0]}): "
                f"beyond W's rank its top-k directions are arbitrary; choose k <= {smallest} or narrow --target-modules"
            )
    return sorted(set(ks))


# --------------------------------------------------------------------------- Hugging Face models and text
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
) -> list[dict]:
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
    ks = _check_ks(ks)
    if positive_int(seq_len, "seq_len") < 2:
        raise ConfigError(f"seq_len must be at least 2 (CLI: --seq-len), got {seq_len}")
    if max_tokens is not None:
        positive_int(max_tokens, "max_tokens")
    n_random, seed = positive_int(n_random, "n_random"), seed_argument(seed)
    model, tokenizer = load_hf_model(model_dir)
    _check_ks(ks, select_linear_modules(model, target_modules))  # before any forward pass
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
    return _records_from_moments(model, moments, ks, n_random, seed)
