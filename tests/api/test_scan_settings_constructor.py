"""ScanSettings: the fields hold the normalised values (tuples), the constructor takes what callers give (any iterable;
one string is one name). Its fields were annotated as tuples while __post_init__ took any iterable, so callers
normalised before building it (scan() did ``tuple(tau_grid)``: ``tau_grid=0.9`` was a TypeError, not a ConfigError).

The constructor's accepted types are a typing-only ``__init__`` (mypy reads it; the dataclass makes the real one):
checked here to list the same parameters, in the same order, with the same defaults as the fields.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

import plate_inspect
from plate_inspect import bundle as bundle_mod
from plate_inspect.bundle import ScanSettings
from plate_inspect.errors import ConfigError


def _typing_init() -> ast.FunctionDef:
    tree = ast.parse(inspect.getsource(bundle_mod))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ScanSettings")
    guard = next(n for n in cls.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return next(n for n in guard.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")


def test_the_typing_constructor_lists_the_fields_with_their_defaults():
    init = _typing_init()
    params = init.args.args[1:]  # after self
    fields = dataclasses.fields(ScanSettings)
    assert [p.arg for p in params] == [f.name for f in fields]
    namespace = vars(bundle_mod)
    defaults = [eval(ast.unparse(d), namespace) for d in init.args.defaults]  # noqa: S307 - our own source
    assert defaults == [f.default for f in fields]
    # the wider inputs, where the field holds a tuple
    wider = {p.arg: ast.unparse(p.annotation) for p in params if p.annotation is not None}
    assert wider["target_modules"] == "str | Iterable[str] | None"
    assert wider["layers"] == "Iterable[LayerEntry] | None"
    assert wider["tau_grid"] == "Iterable[float]"


def test_the_fields_hold_tuples_whatever_iterable_was_given():
    s = ScanSettings(target_modules=iter(["v_proj", "q_proj"]), layers=(i for i in (3, 1)), tau_grid=[0.9, 0.5])
    assert (s.target_modules, s.layers, s.tau_grid) == (("v_proj", "q_proj"), (3, 1), (0.5, 0.9))
    assert ScanSettings(target_modules="q_proj").target_modules == ("q_proj",)


@pytest.mark.parametrize("tau_grid", [0.9, None])
def test_scan_passes_its_settings_as_given_and_a_bad_grid_is_a_config_error(tmp_path, tau_grid):
    with pytest.raises(ConfigError, match="tau_grid must be a list of finite numbers"):
        plate_inspect.scan(tmp_path / "no-model", tmp_path / "out", tau_grid=tau_grid)
    assert not (tmp_path / "out").exists()
