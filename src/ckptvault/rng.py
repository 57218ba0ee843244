"""Every global random number generator a training loop draws from, captured and restored in one call.

:func:`rng_state` returns a plain nested value that a checkpoint stores exactly and without pickle (torch's
states are uint8 tensors, numpy's is its ``get_state()`` tuple, Python's its ``getstate()`` tuple), so::

    mgr.save(step, {"model": model.state_dict(), ..., "rng": ckptvault.rng_state()})
    ...
    ckptvault.set_rng_state(mgr.restore(keys=["rng"])["rng"])

continues every generator where it was. ``torch.Generator`` objects of your own (a sampler's) are not global:
save their ``get_state()`` next to it.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError

__all__ = ["rng_state", "set_rng_state"]

_REQUIRED = ("torch", "numpy", "python")


def rng_state() -> dict[str, Any]:
    """The states of torch's CPU generator, of every CUDA device's (when CUDA is available), of numpy's global
    generator and of Python's ``random``.

    Returns ``{"torch": uint8 tensor, "numpy": tuple, "python": tuple}`` plus ``"cuda": [uint8 tensor per device]``
    when ``torch.cuda.is_available()`` (which initialises CUDA on every device). Each value is a copy: later draws
    do not change it. Restore it with :func:`set_rng_state`.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the generators from a value :func:`rng_state` returned (directly or through a checkpoint).

    Raises :class:`~ckptvault.errors.InvalidArgumentError` naming a missing key, before any generator changes. A
    ``"cuda"`` entry is restored into as many devices as both it and this machine have; if they differ, or CUDA
    is not available here, a warning says so (the CUDA draws then cannot continue exactly as they would have).
    """
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(f"set_rng_state() takes the dict rng_state() returns, got {type(state).__name__}")
    absent = [key for key in _REQUIRED if key not in state]
    if absent:
        raise InvalidArgumentError(f"the RNG state lacks {absent}; set_rng_state() takes the dict rng_state() returns "
                                   f"(keys {list(_REQUIRED)} and, with CUDA, 'cuda'), got keys {sorted(map(str, state))}")
    cuda = state.get("cuda")
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if cuda is None:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available != len(cuda):
        warnings.warn(f"the RNG state holds {len(cuda)} CUDA generators and this machine has {available} CUDA "
                      f"devices; restored {min(available, len(cuda))}", RuntimeWarning, stacklevel=2)
    for device, device_state in enumerate(cuda[:available]):
        torch.cuda.set_rng_state(device_state, device)
