"""Shared fixtures and helpers for the ckptvault test suite.

Helpers other test files may use (import them with ``from conftest import ...``):

* :func:`assert_same_state`: exact structural + bitwise equality of two states
  (types must match exactly: a tuple stays a tuple, an OrderedDict stays one,
  numpy stays numpy with the same byte order; floats and tensors compare bit for bit,
  so NaN payloads and -0.0 count).
* :func:`fresh_memory_url`: a ``memory://`` URL no other test uses.
* :func:`chunk_files` / :func:`manifest_files`: the object files of a local vault.

Fixtures: ``local_url`` (a not-yet-existing vault directory under tmp_path),
``memory_url`` and ``vault_url`` (parametrised over both stores).

Options: ``--regen-goldens`` rewrites ``tests/golden/`` (see tests/test_format_golden.py).
Hypothesis runs under the ``ckptvault`` profile (no deadline: the CI machine is
small and shared); set ``HYPOTHESIS_PROFILE=thorough`` for many more examples.
"""

from __future__ import annotations

import collections
import math
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from ckptvault.stores import memory as memory_store

settings.register_profile("ckptvault", deadline=None, max_examples=50,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", parent=settings.get_profile("ckptvault"), max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ckptvault"))

GOLDEN_DIR = Path(__file__).parent / "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--regen-goldens", action="store_true", default=False,
                     help="rewrite the committed golden files in tests/golden/ (a deliberate format change)")


@pytest.fixture
def regen_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--regen-goldens"))


# -- vault locations -----------------------------------------------------------

def fresh_memory_url(prefix: str = "test") -> str:
    """A memory:// URL with a unique name (memory stores of one name share objects in a process)."""
    return f"memory://{prefix}-{uuid.uuid4().hex}"


def drop_memory_store(url: str) -> None:
    """Free the objects of a memory:// vault."""
    memory_store._SHARED.pop(url.removeprefix("memory://"), None)


@pytest.fixture
def local_url(tmp_path: Path) -> str:
    return str(tmp_path / "vault")


@pytest.fixture
def memory_url():  # type: ignore[no-untyped-def]
    url = fresh_memory_url()
    yield url
    drop_memory_store(url)


@pytest.fixture(params=["local", "memory"])
def vault_url(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    if request.param == "local":
        yield str(tmp_path / "vault")
        return
    url = fresh_memory_url()
    yield url
    drop_memory_store(url)


def chunk_files(vault_dir: str | Path) -> list[Path]:
    """Every chunk object file of a local vault."""
    return sorted(p for p in (Path(vault_dir) / "chunks").rglob("*") if p.is_file())


def manifest_files(vault_dir: str | Path) -> list[Path]:
    return sorted((Path(vault_dir) / "manifests").glob("*.json"))


# -- exact comparison ---------------------------------------------------------------

def tensor_bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The element bytes of ``t`` in C order (works for every dtype, NaN payloads included)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)  # size-1 dims may carry any stride


def assert_same_tensor(a: torch.Tensor, b: Any, path: str = "") -> None:
    assert isinstance(b, torch.Tensor), f"{path}: expected a tensor, got {type(b).__name__}"
    assert b.dtype == a.dtype, f"{path}: dtype {b.dtype} != {a.dtype}"
    assert b.shape == a.shape, f"{path}: shape {tuple(b.shape)} != {tuple(a.shape)}"
    assert torch.equal(tensor_bytes_of(a), tensor_bytes_of(b)), f"{path}: tensor bytes differ"


def assert_same_ndarray(a: np.ndarray, b: Any, path: str = "") -> None:
    assert type(b) is np.ndarray, f"{path}: expected an ndarray, got {type(b).__name__}"
    assert b.dtype.str == a.dtype.str, f"{path}: dtype {b.dtype.str} != {a.dtype.str}"
    assert b.shape == a.shape, f"{path}: shape {b.shape} != {a.shape}"
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{path}: array bytes differ"


def assert_same_state(expected: Any, actual: Any, path: str = "") -> None:
    """Assert ``actual`` equals ``expected`` exactly: same types, structure, key order and bits."""
    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        assert_same_tensor(expected, actual, where)
        return
    assert type(actual) is type(expected), f"{where}: type {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, np.ndarray):
        assert_same_ndarray(expected, actual, where)
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes(), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert type(next(k for k in actual if k == key)) is type(key), f"{where}: key {key!r} changed type"
            assert_same_state(expected[key], actual[key], f"{path}.{key}" if path else str(key))
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same_state(e, a, f"{path}.{i}" if path else str(i))
    elif isinstance(expected, float):
        same = (math.isnan(expected) and math.isnan(actual)) or expected.hex() == actual.hex()
        assert same, f"{where}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def ordered(pairs: list[tuple[Any, Any]]) -> collections.OrderedDict[Any, Any]:
    return collections.OrderedDict(pairs)


@pytest.fixture(scope="module")
def worker() -> Any:
    """A hostile-vault worker process (tests/hostile/worker.py) shared by a module's tests, closed after them."""
    from hostile.worker import Worker

    w = Worker()
    yield w
    w.close()
