"""Fixtures for every test: generated checkpoints with real HF layouts and the real embedded MiniLM (one per session),
an untrained digits MLP with its bundle (one per test module).

Shared helpers live in modules beside this file (oracles, helpers_train, ...), not here: a test module cannot
import from conftest once subdirectories have their own conftest.py (pytest imports each as ``conftest``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from plate_inspect.testing.synthetic import write_bert, write_gpt2, write_llama_like


@pytest.fixture(scope="session")
def qwen_ckpt(tmp_path_factory):
    """Sharded bf16 Qwen2-layout checkpoint (index.json, GQA k/v, biases) with planted duplicate rows."""
    return write_llama_like(
        tmp_path_factory.mktemp("qwen2") / "model", layers=2, max_shard_bytes=150_000, planted_fraction=0.15
    )


@pytest.fixture(scope="session")
def gpt2_ckpt(tmp_path_factory):
    return write_gpt2(tmp_path_factory.mktemp("gpt2") / "model")


@pytest.fixture(scope="session")
def bert_ckpt(tmp_path_factory):
    return write_bert(tmp_path_factory.mktemp("bert") / "model")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from plate_inspect.embedded import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def digits_setup(tmp_path_factory):
    """(root, checkpoint, bundle) of an untrained digits MLP (helpers_train.digits_setup), one per test module."""
    import helpers_train

    return helpers_train.digits_setup(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def digits_adapter(tmp_path_factory):
    """(checkpoint, bundle, save_adapter file) of an untrained digits MLP with r=8, tau=0.8, one per test module."""
    import helpers_train

    from plate_inspect.train.layer import apply_bundle, save_adapter

    root = tmp_path_factory.mktemp("digits-adapter")
    _, ckpt, bundle = helpers_train.digits_setup(root, r=8, tau=0.8)
    model = helpers_train.load_digits(ckpt)
    apply_bundle(model, bundle)
    return ckpt, bundle, save_adapter(model, root / "adapter.safetensors")


# --------------------------------------------------------------------------- disk: module fixtures' directories
# pytest's retention policy ("failed", pyproject) removes a passing test's tmp_path at once, but the directories that
# module- and class-scoped fixtures make with tmp_path_factory.mktemp stay until the run ends: they added up to most of
# the basetemp's peak. They are removed when their fixture is torn down (its module is done), unless a test has failed
# by then (kept to look at, as pytest keeps a failed test's tmp_path). Directories a session fixture made while a
# narrower fixture was being set up (qwen_ckpt asked for by a module fixture) stay theirs: the session's.
_SESSION_DIRS: set[Path] = set()


def _basetemp_children(request: pytest.FixtureRequest) -> set[Path]:
    factory = request.config._tmp_path_factory  # type: ignore[attr-defined]
    base = factory._basetemp
    return set(base.iterdir()) if base is not None and base.is_dir() else set()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = _basetemp_children(request)
    yield
    made = _basetemp_children(request) - before
    if not made:
        return
    if fixturedef.scope == "session":
        _SESSION_DIRS.update(made)
    elif fixturedef.scope in ("module", "class", "package"):
        session = request.session

        def remove(dirs=frozenset(made)) -> None:
            if session.testsfailed:
                return
            for path in dirs - _SESSION_DIRS:
                shutil.rmtree(path, ignore_errors=True)

        fixturedef.addfinalizer(remove)


@pytest.fixture(scope="module")
def saved_tiny_model(tmp_path_factory):
    """family -> (transformers' tiny model of that family, the directory its save_pretrained wrote), built on first
    use (tests/checkpoint/test_modern_families.py: tiny_model and the family tables)."""
    from checkpoint.test_modern_families import tiny_model

    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            path = tmp_path_factory.mktemp(family)
            model = tiny_model(family)
            model.save_pretrained(path)
            cache[family] = (model, path)
        return cache[family]

    return get
