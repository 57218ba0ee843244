"""ckptvault's errors, picklable as themselves: DCP sends a failed rank's exception to the coordinator and on to
every rank (``gather_object``, ``broadcast_object_list``: pickle), and an exception whose ``__init__`` takes other
arguments than its message (``StepExistsError(step, url)``, ``UnsupportedObjectError(path, value, hint)``) would
fail to unpickle there, turning the real error into a TypeError on the other ranks.

:func:`register` adds a reducer for every error class of ``ckptvault.errors`` to ``copyreg``'s dispatch table (used by
every ``pickle.Pickler``): the exception comes back as its own class with its message, arguments and attributes,
without calling its ``__init__``. Importing ``ckptvault.distributed`` calls it.
"""

from __future__ import annotations

import copyreg
import inspect
from typing import Any

from .. import errors


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _reduce(exc: BaseException) -> tuple[Any, ...]:
    return _rebuild, (type(exc), exc.args, dict(vars(exc)))


def register() -> None:
    """Make every ckptvault error class pickle through :func:`_rebuild` (idempotent)."""
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, errors.VaultError):
            copyreg.pickle(cls, _reduce)
