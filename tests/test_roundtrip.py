"""Round trips through the public API: every supported value comes back with the same type, structure and bits.

Hypothesis draws nested states (dict / OrderedDict with str and int keys, list, tuple) whose leaves are torch
tensors of every torch dtype that holds data (0-d, empty, transposed, strided, offset and conj views), numpy arrays
of every numeric dtype in both byte orders (also non-contiguous), numpy scalars and Python scalars (huge ints,
nan/inf/-0.0, unicode, bytes, None). Example-based tests cover tied tensors, views of one storage and Parameters,
then the restore modes (``keys=``, ``into=``, pickle) and what saving does to
storage (chunk packing, dedup, codec choice, raw fallback).
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptvault
from ckptvault._format.chunk_object import chunk_key
from ckptvault.stores import LocalStore
from conftest import assert_same_state, chunk_files, drop_memory_store, fresh_memory_url

QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
TORCH_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)} - QUANTIZED, key=str)


def _copyable(dtype: torch.dtype) -> bool:
    """Whether torch can copy a strided view of this dtype (the sub-byte uint1..7/int1..7 cannot)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
            torch.empty(2, 3, dtype=dtype).t().contiguous()
        return True
    except (RuntimeError, NotImplementedError):
        return False


COPYABLE = {d for d in TORCH_DTYPES if _copyable(d)}
NUMPY_DTYPES = ["?", "i1", "u1", "g", "G"] + [
    order + code for code in ("i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16") for order in "<>"
]
NUMPY_SCALAR_DTYPES = ["?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16"]


def test_dtype_list_covers_every_family() -> None:
    """Guards the strategy below: it must keep drawing from every kind of dtype torch has."""
    names = {str(d) for d in TORCH_DTYPES}
    for expected in ("float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128", "bool",
                     "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float8_e4m3fn",
                     "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "bits8", "bits16", "uint1", "uint7",
                     "int1", "int7"):
        assert f"torch.{expected}" in names, expected


# -- strategies ------------------------------------------------------------------------

def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    numel = int(np.prod(shape)) if shape else 1
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


@st.composite
def torch_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    seed = draw(st.integers(0, 2**31))
    if dtype not in COPYABLE:
        return _random_tensor(dtype, shape, seed)
    view = draw(st.sampled_from(["plain", "transpose", "step", "offset", "conj"]))
    if view == "transpose" and len(shape) >= 2:
        return _random_tensor(dtype, shape, seed).transpose(0, -1)
    if view == "step" and shape:
        base = _random_tensor(dtype, (shape[0] * 2 + 1, *shape[1:]), seed)
        return base[::2]
    if view == "offset":
        return _random_tensor(dtype, (int(np.prod(shape)) + 3,), seed)[3:].reshape(shape)
    if view == "conj" and dtype.is_complex:
        return _random_tensor(dtype, shape, seed).conj()
    return _random_tensor(dtype, shape, seed)


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    n = int(np.prod(shape)) if shape else 1
    if dtype.kind == "b":
        arr = rng.integers(0, 2, n).astype(bool).reshape(shape)
    else:
        arr = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype).reshape(shape).copy()
    layout = draw(st.sampled_from(["C", "F", "T", "step"]))
    if layout == "F":
        return np.asfortranarray(arr)
    if layout == "T":
        return arr.T
    if layout == "step" and arr.ndim:
        return arr[::2]
    return arr


@st.composite
def numpy_scalars(draw: st.DrawFn) -> np.generic:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_SCALAR_DTYPES)))
    if dtype.kind == "b":
        return np.bool_(draw(st.booleans()))
    return np.frombuffer(draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize)), dtype=dtype)[0]


python_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**200), 2**200), st.floats(),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 5e-324]),
    st.text(max_size=12), st.binary(max_size=12),
)
leaves = st.one_of(torch_tensors(), numpy_arrays(), numpy_scalars(), python_scalars)
keys = st.one_of(st.text(max_size=8), st.integers(-5, 1000))


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.lists(st.tuples(keys, children), max_size=4).map(collections.OrderedDict),
    )


states = st.recursive(leaves, _containers, max_leaves=12)


def _round_trip(state: Any, url: str, **manager_kwargs: Any) -> Any:
    with ckptvault.CheckpointManager(url, **manager_kwargs) as mgr:
        mgr.save(3, state).wait()
        return mgr.restore(3)


# -- property tests ----------------------------------------------------------------------

@settings(max_examples=60)
@given(state=states)
def test_round_trip_memory(state: Any) -> None:
    url = fresh_memory_url("rt")
    try:
        assert_same_state(state, _round_trip(state, url))
    finally:
        drop_memory_store(url)


@settings(max_examples=40)
@given(state=states)
def test_round_trip_local(state: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    url = str(tmp_path_factory.mktemp("rt") / "vault")
    assert_same_state(state, _round_trip(state, url))


@settings(max_examples=25)
@given(tensor=torch_tensors(), codec=st.sampled_from(["zstd", "lz4", "none", "fast", "zstd-3"]))
def test_round_trip_every_codec(tensor: torch.Tensor, codec: str) -> None:
    url = fresh_memory_url("codec")
    try:
        assert_same_state({"t": tensor}, _round_trip({"t": tensor}, url, codec=codec))
    finally:
        drop_memory_store(url)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_dtype_multi_chunk(dtype: torch.dtype, memory_url: str) -> None:
    """Every dtype, in a tensor spanning several 64 KiB chunks with a short last one, plus a 0-d one."""
    big = _random_tensor(dtype, (40_000 // dtype.itemsize + 7,), seed=1)
    state = {"big": big, "scalar": _random_tensor(dtype, (), seed=2), "empty": torch.empty(0, 4, dtype=dtype)}
    assert_same_state(state, _round_trip(state, memory_url, chunk_size=64 << 10))
    with ckptvault.CheckpointManager(memory_url) as mgr:
        assert mgr.info(3).tensors[0].dtype == str(dtype).removeprefix("torch.")


# -- example-based -----------------------------------------------------------------------------

def test_tied_tensor_restored_as_one_object(vault_url: str) -> None:
    w = torch.randn(8, 4)
    state = {"embed": w, "head": w, "nested": [w, {"again": w}]}
    restored = _round_trip(state, vault_url)
    assert_same_state(state, restored)
    assert restored["embed"] is restored["head"] is restored["nested"][0] is restored["nested"][1]["again"]
    with ckptvault.CheckpointManager(vault_url) as mgr:
        assert [t.path for t in mgr.info(3).tensors] == ["embed"]


def test_views_of_one_storage_restore_their_own_values(vault_url: str) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    z = torch.randn(5, dtype=torch.complex64)
    state = {"base": base, "t": base.t(), "row": base[1], "col": base[:, 2], "step": base.view(-1)[1::5],
             "flat": base.view(-1), "as_int": base.view(torch.int32), "z": z, "zc": z.conj(), "zneg": z._neg_view()}
    restored = _round_trip(state, vault_url)
    assert_same_state(state, restored)
    assert torch.equal(restored["zc"], z.conj().resolve_conj())
    assert torch.equal(restored["zneg"], -z)
    assert len({id(v) for v in restored.values()}) == len(state)  # views are not tied to each other


def test_model_state_dict_and_parameters(vault_url: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    param = torch.nn.Parameter(torch.randn(3))
    state = {"model": model.state_dict(), "param": param, "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False)}
    restored = _round_trip(state, vault_url)
    assert_same_state(state, restored)
    assert type(restored["param"]) is torch.nn.Parameter and restored["param"].requires_grad
    assert restored["model"]._metadata == model.state_dict()._metadata
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    fresh.load_state_dict(restored["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_scalars_and_containers_exact(vault_url: str) -> None:
    state = collections.OrderedDict([
        (2, (1, 2.5, None)), ("b", [True, False, 0, 1]), ("huge", -(10**100)), ("floats", [float("nan"), -0.0, float("-inf")]),
        ("text", "naïve ✓ \x00 \U0001f600"), ("raw", bytes(range(256))), ("empty", [{}, (), [], collections.OrderedDict()]),
        ("np", [np.float16(1.5), np.int64(-3), np.bool_(False), np.complex128(1 - 2j), np.array(7, dtype=">u2")]),
    ])
    restored = _round_trip(state, vault_url)
    assert_same_state(state, restored)
    assert type(restored["b"][0]) is bool and type(restored["b"][2]) is int  # bool and int stay apart


def test_the_skeleton_of_scalars_is_the_formats_wherever_they_sit() -> None:
    """Scalars as list and tuple items, dict values and dict keys get the nodes DESIGN's table gives; a subclass of
    a scalar type (an IntEnum) is not taken for that type."""
    import enum

    from ckptvault._tree import flatten
    from ckptvault.errors import UnsupportedObjectError

    values = [None, True, 3, -(10**30), 2.5, -0.0, "s"]
    nodes = [{"none": None}, {"bool": True}, {"int": 3}, {"int": -(10**30)}, {"float": "0x1.4000000000000p+1"},
             {"float": "-0x0.0p+0"}, {"str": "s"}]
    tree, leaves = flatten({"list": values, "tuple": tuple(values), "dict": dict(zip(values, values, strict=True))})
    assert leaves == []
    (_list_key, list_node), (_tuple_key, tuple_node), (_dict_key, dict_node) = tree["dict"]
    assert list_node == {"list": nodes} and tuple_node == {"tuple": nodes}
    assert dict_node == {"dict": [[n, n] for n in nodes]}
    assert flatten(b"\x00\xff")[0] == {"bytes": "AP8="}

    class Level(enum.IntEnum):
        LOW = 1

    for state in ([Level.LOW], {"a": Level.LOW}, {Level.LOW: 1}, {b"key": 1}):
        with pytest.raises(UnsupportedObjectError, match="key path"):
            flatten(state)


def test_one_liners_and_listing(local_url: str) -> None:
    info = ckptvault.save({"x": torch.ones(3)}, local_url, step=7, metrics={"loss": 1.25}, metadata={"run": "a"})
    assert info.step == 7 and info.metrics == {"loss": 1.25} and info.metadata == {"run": "a"}
    ckptvault.save({"x": torch.zeros(3)}, local_url, step=9)
    assert_same_state({"x": torch.zeros(3)}, ckptvault.load(local_url))
    assert_same_state({"x": torch.ones(3)}, ckptvault.load(local_url, 7))
    with ckptvault.CheckpointManager(local_url) as mgr:
        assert mgr.steps() == [7, 9] and mgr.latest_step() == 9
        assert mgr.info(7).logical_bytes == 12


# -- restore modes: keys=, into=, pickle --------------------------------------------------------

def _chunk_ids_of(manifest: dict[str, Any], prefix: str) -> set[str]:
    """Ids of the chunks holding the tensors whose key path starts with ``prefix``."""
    chunks = manifest["chunks"]
    return {chunks[c]["id"] for t in manifest["tensors"] if t["path"].startswith(prefix) for c, _o, _n in t["pieces"]}


def _train_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    return model, opt


def test_keys_reads_only_the_matching_chunks(local_url: str) -> None:
    big = {"model": {"w": torch.randn(64, 1024), "b": torch.randn(8)},
           "optimizer": {"m": torch.randn(64, 1024), "v": torch.randn(64, 1024)}, "step": 5}
    with ckptvault.CheckpointManager(local_url, chunk_size=64 << 10) as mgr:
        mgr.save(5, big).wait()
        manifest = mgr.manifest(5)
        model_chunks, opt_chunks = _chunk_ids_of(manifest, "model."), _chunk_ids_of(manifest, "optimizer.")
        assert model_chunks and opt_chunks and not model_chunks & opt_chunks
        for cid in opt_chunks:  # damage every chunk only the optimizer uses
            path = f"{local_url}/chunks/{cid[:2]}/{cid}"
            data = bytearray(open(path, "rb").read())
            data[-1] ^= 0xFF
            open(path, "wb").write(bytes(data))
        part = mgr.restore(5, keys=["model.*"])
        assert_same_state({"model": big["model"]}, part)
        assert_same_state({"model": {"w": big["model"]["w"]}, "step": 5}, mgr.restore(5, keys=["model.w", "step"]))
        with pytest.raises(ckptvault.errors.CorruptChunkError):
            mgr.restore(5, keys="optimizer")


def test_keys_selects_inside_lists_and_tuples(memory_url: str) -> None:
    state = {"layers": [{"w": torch.ones(2)}, {"w": torch.zeros(2)}], "pair": (torch.ones(1), "x"), "lr": 0.5}
    with ckptvault.CheckpointManager(memory_url) as mgr:
        mgr.save(1, state).wait()
        assert_same_state({"layers": [{"w": torch.zeros(2)}]}, mgr.restore(keys=["layers.1.*"]))
        assert_same_state({"pair": ("x",), "lr": 0.5}, mgr.restore(keys=["pair.1", "lr"]))


def test_into_restores_in_place(vault_url: str) -> None:
    model, opt = _train_state(seed=0)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    with ckptvault.CheckpointManager(vault_url) as mgr:
        mgr.save(10, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 10}).wait()
        fresh, fresh_opt = _train_state(seed=1)
        target = fresh.state_dict()
        before = {k: (v, v.data_ptr()) for k, v in target.items()}
        assert not torch.equal(target["0.weight"], saved_model["0.weight"])
        out = mgr.restore(10, into=target)  # mounts under the saved "model" subtree
        assert out is target
        for key, (tensor, ptr) in before.items():
            assert target[key] is tensor and tensor.data_ptr() == ptr
            assert_same_state(saved_model[key], tensor, key)
        assert torch.equal(fresh[0].weight, saved_model["0.weight"])  # the module's parameters changed in place
        opt_target = fresh_opt.state_dict()
        mgr.restore(10, into={"optimizer": opt_target}, strict=False)
        assert_same_state(opt.state_dict()["state"], opt_target["state"])


def test_into_non_contiguous_targets(memory_url: str) -> None:
    w, z = torch.randn(6, 4), torch.randn(3, dtype=torch.complex64)
    arr = np.arange(10, dtype=">i4")
    with ckptvault.CheckpointManager(memory_url) as mgr:
        mgr.save(1, {"w": w, "z": z, "arr": arr, "s": w[:, 1]}).wait()
        buf = torch.zeros(4, 6)
        big = torch.zeros(12)
        conj_target = torch.zeros(3, dtype=torch.complex64).conj()
        arr_target = np.zeros(20, dtype=">i4")[::2]
        mgr.restore(into={"w": buf.t(), "z": conj_target, "arr": arr_target, "s": big[::2]})
        assert torch.equal(buf.t(), w) and torch.equal(big[::2], w[:, 1]) and torch.equal(big[1::2], torch.zeros(6))
        assert torch.equal(conj_target, z)
        assert np.array_equal(arr_target, arr)


class ReadWatchingStore(LocalStore):
    """A LocalStore that calls ``before_get(key)`` before each read."""

    before_get: Any = None

    def get(self, key: str, max_size: int | None = None) -> bytes:
        if self.before_get:
            self.before_get(key)
        return super().get(key, max_size)

    def get_transient(self, key: str, max_size: int | None = None) -> memoryview:
        if self.before_get:
            self.before_get(key)
        return super().get_transient(key, max_size)


def test_into_targets_read_through_a_temporary_are_filled_while_later_chunks_are_read(tmp_path: Path) -> None:
    a, b = torch.randn(4096, 64), torch.randn(4096, 64)  # 1 MiB each: four 256 KiB chunks
    store = ReadWatchingStore(tmp_path / "v")
    with ckptvault.CheckpointManager(store, chunk_size=256 << 10, workers=1) as mgr:
        mgr.save(1, {"a": a, "b": b}).wait()
        manifest = mgr.manifest(1)
        by_path = {t["path"]: t for t in manifest["tensors"]}
        first_of_b = chunk_key(manifest["chunks"][by_path["b"]["pieces"][0][0]]["id"])
        target_a, target_b = torch.zeros(64, 4096).t(), torch.zeros(64, 4096).t()  # not contiguous: via temporaries
        seen: list[bool] = []
        store.before_get = lambda key: seen.append(torch.equal(target_a, a)) if key == first_of_b else None
        mgr.restore(1, into={"a": target_a, "b": target_b})
    assert seen == [True], "a was copied into its target only after every chunk was read"
    assert torch.equal(target_a, a) and torch.equal(target_b, b)


def test_into_many_same_shape_targets_through_reused_temporaries(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(512, 96) for i in range(12)}  # 192 KiB each: three 64 KiB chunks
    state["odd"] = torch.randn(96, 512)  # another shape, and an empty tensor
    state["empty"] = torch.empty(0, 5)
    with ckptvault.CheckpointManager(tmp_path / "v", chunk_size=64 << 10, workers=4) as mgr:
        mgr.save(1, state).wait()
        for _ in range(3):  # thread timing differs run to run
            into = {k: torch.full(tuple(reversed(v.shape)), -1.0).t() for k, v in state.items()}
            mgr.restore(1, into=into)
            assert_same_state(state, {k: v.contiguous() for k, v in into.items()})


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors and TypedStorage are deprecated in torch
def test_pickle_needs_allow_pickle_both_ways(vault_url: str) -> None:
    state = {"tags": {"a", "b"}, "q": torch.quantize_per_tensor(torch.randn(4), 0.1, 2, torch.qint8),
             "obj": np.array([{"k": 1}], dtype=object), "w": torch.ones(2)}
    with ckptvault.CheckpointManager(vault_url) as mgr:
        mgr.save(1, state, allow_pickle=True).wait()
        assert mgr.manifest(1)["pickle"] is True
        with pytest.raises(ckptvault.errors.PickleNotAllowedError, match=r"key path 'tags' was saved with pickle"):
            mgr.restore(1)
        assert_same_state({"w": torch.ones(2)}, mgr.restore(1, keys=["w"]))  # pickle-free parts need no permission
        restored = mgr.restore(1, allow_pickle=True)
        assert restored["tags"] == {"a", "b"} and restored["obj"][0] == {"k": 1}
        assert restored["q"].is_quantized and torch.equal(restored["q"].int_repr(), state["q"].int_repr())
        mgr.save(2, {"w": torch.ones(2)}, allow_pickle=True).wait()
        assert mgr.manifest(2)["pickle"] is False  # nothing needed pickle: the checkpoint stays loadable without it


# -- what a save does to storage ---------------------------------------------------------------

def _chunk_headers(vault_dir: str) -> dict[str, Any]:
    from ckptvault._format.chunk_object import parse_object

    return {p.name: parse_object(p.name, p.read_bytes())[0] for p in chunk_files(vault_dir)}


def test_ten_thousand_tiny_tensors_write_a_handful_of_chunks(local_url: str) -> None:
    state = {f"t{i}": torch.full((3,), float(i)) if i % 2 else torch.full((2,), i, dtype=torch.int64) for i in range(10_000)}
    with ckptvault.CheckpointManager(local_url) as mgr:
        info = mgr.save(1, state).wait()
        assert len(info.tensors) == 10_000
        assert_same_state(state, mgr.restore(1))
    assert 1 <= len(chunk_files(local_url)) <= 4  # one pack per (codec, element size)


def test_dedup_across_and_within_checkpoints(local_url: str) -> None:
    x = torch.randn(512, 1024)
    with ckptvault.CheckpointManager(local_url, chunk_size=1 << 20) as mgr:
        first = mgr.save(1, {"a": x, "step": 1}).wait()
        files = chunk_files(local_url)
        assert first.added_bytes == first.stored_bytes > 0
        second = mgr.save(2, {"a": x, "step": 2}).wait()
        assert second.added_bytes == 0 and chunk_files(local_url) == files
        third = mgr.save(3, {"a": x, "b": x.clone(), "c": x.clone()}).wait()  # identical tensors within one state
        assert third.added_bytes == 0 and chunk_files(local_url) == files
        assert third.logical_bytes == 3 * x.nbytes and third.stored_bytes == first.stored_bytes
        assert_same_state({"a": x, "b": x, "c": x}, mgr.restore(3))


def _stage_ids(specs: Any) -> set[str]:
    """Every codec stage id in a chunk header's codec chain, nested stages included."""
    if isinstance(specs, dict):
        return ({specs["id"]} if "id" in specs else set()) | set().union(*map(_stage_ids, specs.values()))
    if isinstance(specs, list):
        return set().union(*map(_stage_ids, specs))
    return set()


# the compressor each codec name must put into chunk headers, and the ones it must not
CODEC_COMPRESSOR = {"zstd": "zstd", "zstd-3": "zstd", "lz4": "lz4", "none": None, "fast": None}


def _assert_compressor(header: Any, codec: str) -> None:
    ids = _stage_ids(header.codec)
    wanted = CODEC_COMPRESSOR[codec]
    if wanted is None:
        assert header.codec == [], (codec, header.codec)
    else:
        assert wanted in ids and not ids & ({"zstd", "lz4"} - {wanted}), (codec, header.codec)


def test_codec_per_vault_and_per_tensor_rules(tmp_path: Any) -> None:
    ramp = torch.arange(300_000, dtype=torch.float32)  # compressible, large enough for its own chunks
    for codec in CODEC_COMPRESSOR:
        url = str(tmp_path / codec)
        with ckptvault.CheckpointManager(url, codec=codec) as mgr:
            info = mgr.save(1, {"w": ramp}).wait()
            assert [t.codec for t in info.tensors] == [codec]
            assert_same_state({"w": ramp}, mgr.restore(1))
        headers = _chunk_headers(url)
        assert headers
        for header in headers.values():
            _assert_compressor(header, codec)
        if CODEC_COMPRESSOR[codec] is None:
            assert info.stored_bytes > info.logical_bytes  # raw + header
        else:
            assert info.stored_bytes < info.logical_bytes / 2
    url = str(tmp_path / "rules")
    with ckptvault.CheckpointManager(url, codec="zstd", codec_rules={"optimizer.*": "none", "model.b*": "lz4"}) as mgr:
        info = mgr.save(1, {"model": {"w": ramp, "bias": ramp + 1}, "optimizer": {"m": ramp + 2}}).wait()
        assert {t.path: t.codec for t in info.tensors} == {"model.w": "zstd", "model.bias": "lz4", "optimizer.m": "none"}
        manifest = mgr.manifest(1)
    headers = _chunk_headers(url)
    for prefix, codec in (("model.w", "zstd"), ("model.bias", "lz4"), ("optimizer.", "none")):
        ids = _chunk_ids_of(manifest, prefix)
        assert ids, prefix
        for cid in ids:
            _assert_compressor(headers[cid], codec)


def test_incompressible_data_is_stored_raw(local_url: str) -> None:
    noise = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with ckptvault.CheckpointManager(local_url, codec="zstd-3") as mgr:
        info = mgr.save(1, {"noise": noise}).wait()
    headers = _chunk_headers(local_url)
    assert headers and all(h.codec == [] for h in headers.values())
    for path in chunk_files(local_url):
        raw = headers[path.name].raw
        assert raw < path.stat().st_size <= raw + 128
    assert info.stored_bytes <= info.logical_bytes + 128 * len(headers)
