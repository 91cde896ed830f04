"""Argument checks at the boundary of the Python API (analyses, experiments): a ConfigError naming the argument (as
scikit-learn does), not a TypeError from deep inside torch, NumPy or SciPy, and no silent NaN record from a setting
that means nothing (``n_random=0``, ``n_probes=0``, ``rhos=[nan]``). The CLI checks its flags itself, with the
flags' names."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeGuard, TypeVar, overload

from plate_inspect.errors import ConfigError

#: torch.manual_seed's largest seed (NumPy's generators take it too)
MAX_SEED = 2**63 - 1

#: an iterable type kept as given (a list stays a list, a DataLoader a DataLoader)
IterableT = TypeVar("IterableT", bound=Iterable[Any])


def is_integer(value: object) -> TypeGuard[int]:
    """An int (NumPy integers included), not a bool. A TypeGuard, so that ``int(value)`` and comparisons type-check
    after it: NumPy integers are typed as the int they behave as (``numbers.Integral`` would refuse ``value >= 1``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def real_value(value: object) -> float:
    """``value`` as a float when it is a real number (not a bool), NaN when it is not one, and +-inf for an int or
    Fraction beyond float's range (``10**400``: ``float()`` raises OverflowError there), so that one finiteness
    test refuses all of them."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def bool_argument(value: object, argument: str) -> bool:
    """``value`` when it is True or False, else a ConfigError naming ``argument`` (``"no"`` and ``[]`` were read by
    truth value: ``overwrite="no"`` replaced the output, ``merge="no"`` merged)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{argument} must be True or False, got {value!r:.80}")
    return value


def positive_int(value: object, argument: str) -> int:
    """``value`` as an int >= 1, else a ConfigError naming ``argument``."""
    if not is_integer(value) or int(value) < 1:
        raise ConfigError(f"{argument} must be a positive integer, got {value!r:.80}")
    return int(value)


def non_negative_int(value: object, argument: str) -> int:
    """``value`` as an int >= 0, else a ConfigError naming ``argument``."""
    if not is_integer(value) or int(value) < 0:
        raise ConfigError(f"{argument} must be an integer >= 0, got {value!r:.80}")
    return int(value)


def seed_argument(seed: object) -> int:
    """``seed`` as an int in 0..2^63-1 (the seeds torch and NumPy both take), else a ConfigError."""
    if not is_integer(seed) or not 0 <= int(seed) <= MAX_SEED:
        raise ConfigError(f"seed must be a non-negative integer below 2^63, got {seed!r:.80}")
    return int(seed)


def positive_ints(values: object, argument: str) -> list[int]:
    """A non-empty list of integers >= 1 (one int is refused too: ``ks=8`` is written ``ks=[8]``)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ConfigError(f"{argument} must be a list of positive integers (e.g. [8, 32]), got {values!r:.80}")
    items = list(values)
    if not items or not all(is_integer(v) and int(v) >= 1 for v in items):
        raise ConfigError(f"{argument} must be a list of positive integers (e.g. [8, 32]), got {items!r:.80}")
    return [int(v) for v in items]


def finite_numbers(values: object, argument: str, empty: bool = False) -> list[float]:
    """A list of finite real numbers (non-empty unless ``empty``), else a ConfigError naming ``argument``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ConfigError(f"{argument} must be a list of finite numbers (e.g. [0, 0.5, 1]), got {values!r:.80}")
    items = list(values)
    if (not items and not empty) or not all(math.isfinite(real_value(v)) for v in items):
        raise ConfigError(f"{argument} must be a list of finite numbers (e.g. [0, 0.5, 1]), got {items!r:.80}")
    return [float(v) for v in items]


def non_negative_number(value: object, argument: str) -> float:
    """``value`` as a finite float >= 0, else a ConfigError naming ``argument``."""
    number = real_value(value)
    if not (math.isfinite(number) and number >= 0):
        raise ConfigError(f"{argument} must be a finite number >= 0, got {value!r:.80}")
    return number


def path_argument(value: object, argument: str) -> Path:
    """``value`` as a Path, or a ConfigError naming ``argument`` when it is no path (None, a number, '', '  '): the
    check at the boundary of the public functions that take one (else a TypeError from deep inside ``Path``). A blank
    path is refused as the CLI refuses a blank argument (an unset variable: '' means the current directory, '  ' a
    directory named by spaces)."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
        raise ConfigError(f"{argument} must be a path (str or os.PathLike), got {value!r:.80}")
    return Path(value)


def text_argument(value: object, argument: str, example: str) -> str:
    """``value`` when it is a str (a spec such as ``"lora,plate"`` that is split and parsed), else a ConfigError
    naming ``argument`` with an ``example``: a list or a number failed inside ``str.split`` as an AttributeError."""
    if not isinstance(value, str):
        raise ConfigError(f"{argument} must be a string such as {example!r}, got {value!r:.80}")
    return value


def positive_number(value: object, argument: str) -> float:
    """``value`` as a finite float > 0 (a learning rate, a scale), else a ConfigError naming ``argument``."""
    number = real_value(value)
    if not (math.isfinite(number) and number > 0):
        raise ConfigError(f"{argument} must be a positive finite number, got {value!r:.80}")
    return number


@overload
def iterable_argument(value: IterableT, argument: str, what: str) -> IterableT: ...
@overload
def iterable_argument(value: object, argument: str, what: str) -> Iterable[Any]: ...
def iterable_argument(value: object, argument: str, what: str) -> Iterable[Any]:
    """``value`` when it can be iterated (a list, a DataLoader), else a ConfigError saying what it should hold."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{argument} must be an iterable of {what}, got {value!r:.80}")
    return value


def describe(value: object) -> str:
    """``value`` for an error message: an array or tensor by type, dtype and shape (its values would fill the
    line), anything else by its repr cut to 80 characters."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {type(value).__name__} of dtype {dtype} and shape {list(shape)}"
    return f"{value!r:.80}"
