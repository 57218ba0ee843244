"""Type checks of user settings: an InvalidArgumentError that names the setting at once, instead of a TypeError
deep inside a save, or a value such as ``"no"`` that Python would take as true."""

from __future__ import annotations

import numbers
from typing import Any

from .errors import InvalidArgumentError

_KIND_NAMES = {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "None"}
#: what each kind admits: any integral or real number type (numpy's included) for int and float
_ADMITS: dict[type, type] = {int: numbers.Integral, float: numbers.Real}


def check_kind(name: str, value: Any, *kinds: type) -> None:
    """InvalidArgumentError naming ``name`` unless ``value`` is of one of ``kinds`` (``bool``, ``int``, ``float``,
    ``str``, ``type(None)``). ``int`` admits any integral number (numpy's too), ``float`` any real one; a bool is not
    taken for a number (True == 1)."""
    admitted = tuple(_ADMITS.get(kind, kind) for kind in kinds)
    if isinstance(value, admitted) and not (isinstance(value, bool) and bool not in kinds):
        return
    names = " or ".join(_KIND_NAMES.get(kind, kind.__name__) for kind in kinds if not (kind is int and float in kinds))
    raise InvalidArgumentError(f"{name} must be {names}, got {value!r} ({type(value).__name__})")


def check_progress(progress: Any) -> None:
    """InvalidArgumentError unless ``progress`` is None or callable (it is called with a byte count, and
    ``total=`` where it takes that keyword: ``_feedback.py``)."""
    if progress is not None and not callable(progress):
        raise InvalidArgumentError(f"progress must be a callable taking a byte count, or None, got {progress!r}")
