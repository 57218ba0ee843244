"""Small states pay no fixed costs they do not use: no numba and no torch.distributed.checkpoint for lossless
saves and restores, the byte-plane kernels loaded only once a process has split or joined enough bytes, and a
lossy save still loading (and using) the lossy kernels.

The import tests run in a fresh interpreter, where ``sys.modules`` shows what a process imported; the last two
check that a restore leaves a collection that is due to the process."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ckptvault._codecs import planes


def run_fresh(script: str) -> dict:
    """Run ``script`` in a new interpreter; the JSON object its last output line prints."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


#: modules ckptvault needs only for lossy codecs, DCP, S3, fsspec or the CLI (torch itself imports tqdm)
HEAVY = ("numba", "llvmlite", "torch.distributed.checkpoint", "boto3", "botocore", "fsspec", "tqdm", "click")
#: the start of each script: which of HEAVY the process imports beyond what ``import torch`` imports
PRELUDE = f"""
import json, sys
import torch
before = set(sys.modules)
def heavy():
    return sorted(m for m in {HEAVY!r} if m in sys.modules and m not in before)
"""


def test_importing_ckptvault_imports_nothing_heavy() -> None:
    found = run_fresh(PRELUDE + """
import ckptvault
print(json.dumps(heavy()))
""")
    assert found == []


@pytest.mark.parametrize("async_save", [False, True])
def test_lossless_save_and_restore_import_neither_numba_nor_dcp(tmp_path: Path, async_save: bool) -> None:
    """A lossless save (default codec: byte planes + zstd, so planes are split and joined) and its restore, by a
    manager and by the one-liners, in one fresh process: every value comes back, and neither numba nor
    torch.distributed.checkpoint was imported."""
    out = run_fresh(PRELUDE + f"""
import ckptvault
state = {{"w": torch.randn(300_000), "h": torch.randn(70_000).bfloat16(), "d": torch.randn(9_000).double(),
          "i": torch.arange(5_000), "step": 3}}
with ckptvault.CheckpointManager({str(tmp_path / "a")!r}, async_save={async_save}) as mgr:
    mgr.save(3, state).wait()
    back = mgr.restore(3)
ckptvault.save(state, {str(tmp_path / "b")!r}, step=4)
again = ckptvault.load({str(tmp_path / "b")!r})
same = all(torch.equal(r[k], state[k]) for r in (back, again) for k in ("w", "h", "d", "i"))
print(json.dumps({{"same": same, "steps": [back["step"], again["step"]],
                   "heavy": heavy()}}))
""")
    assert out == {"same": True, "steps": [3, 3], "heavy": []}


def test_the_plane_kernels_load_once_a_process_has_split_enough_bytes(tmp_path: Path) -> None:
    """Past ``planes.LOAD_AFTER`` bytes through the numpy loops, the kernels load in the background; splits use
    them once loaded, and what is stored and restored is the same either way."""
    out = run_fresh(f"""
import json, sys
import torch
import ckptvault
from ckptvault._codecs import planes
planes.LOAD_AFTER = 1 << 20
state = {{"w": torch.randn(600_000)}}  # 2.4 MB: past the threshold within the first save
with ckptvault.CheckpointManager({str(tmp_path / "v")!r}, async_save=False) as mgr:
    mgr.save(1, state)
    planes.wait_for_kernel_loading()
    loaded = planes._kernels is not None and planes._kernels is not False
    original = state["w"].clone()
    state["w"] += 1
    mgr.save(2, state)
    back = [mgr.restore(step)["w"] for step in (1, 2)]
print(json.dumps({{"loaded": loaded, "numba": "numba" in sys.modules,
                   "same": torch.equal(back[1], state["w"]) and torch.equal(back[0], original)}}))
""")
    assert out["loaded"] and out["numba"] and out["same"], out


def test_a_lossy_save_loads_the_lossy_kernels_and_then_the_plane_kernels(tmp_path: Path) -> None:
    """A lossy rule imports numba (the fused lossy kernels); the byte-plane kernels then load at once, as numba
    is there already. The restored values are the bfloat16 rounding of the saved ones."""
    out = run_fresh(f"""
import json, sys
import torch
import ckptvault
from ckptvault._codecs import planes
torch.manual_seed(0)
state = {{"optimizer": {{"m": torch.randn(200_000)}}, "model": {{"w": torch.randn(50_000)}}}}
with ckptvault.CheckpointManager({str(tmp_path / "v")!r}, async_save=False, codec_rules={{"optimizer.*": "bf16"}}) as mgr:
    mgr.save(1, state)
    planes.wait_for_kernel_loading()
    back = mgr.restore(1)
print(json.dumps({{
    "lossy_kernels": "ckptvault._codecs.lossy_kernels" in sys.modules,
    "plane_kernels": planes._kernels is not None and planes._kernels is not False,
    "rounded": torch.equal(back["optimizer"]["m"], state["optimizer"]["m"].bfloat16().float()),
    "exact": torch.equal(back["model"]["w"], state["model"]["w"])}}))
""")
    assert out == {"lossy_kernels": True, "plane_kernels": True, "rounded": True, "exact": True}


@pytest.mark.parametrize("typesize", [2, 4, 8])
def test_numpy_loops_match_the_kernels_across_blocks(typesize: int) -> None:
    """The numpy split and join work block by block (``SPLIT_BLOCK`` and ``NUMPY_BLOCK`` elements); over several
    blocks and a partial last one they give the planes the kernels give, and join them back to the same bytes."""
    count = 2 * max(planes.SPLIT_BLOCK, planes.NUMPY_BLOCK) + 123
    raw = np.random.default_rng(typesize).integers(0, 256, typesize * count + 1, dtype=np.uint8).tobytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planes, "_kernels", False)
        numpy_planes, tail = planes.split_planes(raw, typesize)
        numpy_planes = numpy_planes.copy()
        joined = planes.assemble(list(numpy_planes), tail, np.empty(len(raw), np.uint8)).tobytes()
    expected = np.frombuffer(raw, np.uint8)[: typesize * count].reshape(-1, typesize).T
    np.testing.assert_array_equal(numpy_planes, expected)
    assert joined == raw
    assert planes._plane_kernels() is not None
    kernel_planes, _ = planes.split_planes(raw, typesize)
    np.testing.assert_array_equal(kernel_planes, numpy_planes)


def _collections_inside_ckptvault(run: Callable[[], object]) -> tuple[list[str], object]:
    """``run()`` with a collection due at every allocation; the ckptvault functions any automatic collection
    interrupted (each as its ckptvault frames, innermost first: ``module/path.py:function < ...``; none, when the
    restore pauses the collector), and what ``run`` returned."""
    interrupted: list[str] = []

    def on_collection(phase: str, info: dict) -> None:
        frame, stack = sys._getframe(1), []
        while frame is not None:
            if f"{os.sep}ckptvault{os.sep}" in frame.f_code.co_filename:
                where = frame.f_code.co_filename.rsplit(f"{os.sep}ckptvault{os.sep}", 1)[1].replace(os.sep, "/")
                stack.append(f"{where}:{frame.f_code.co_name}")
            frame = frame.f_back
        if stack:
            interrupted.append(" < ".join(stack))

    gc.collect()
    threshold = gc.get_threshold()
    gc.callbacks.append(on_collection)
    gc.set_threshold(1)
    try:
        result = run()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_collection)
    return interrupted, result


def test_a_restore_leaves_the_collection_due_to_the_process(tmp_path: Path) -> None:
    """A collection due (``import torch`` leaves one) is not paid inside a restore: the collector stays paused from
    ``load()`` or ``restore()`` until it returns, and is on again afterwards. The control shows that with the same
    threshold a save is interrupted by collections, so the probe sees them where they happen."""
    import torch

    import ckptvault

    state = {"model": {f"w{i}": torch.full((64,), float(i)) for i in range(40)}, "step": 7}
    saved, _ = _collections_inside_ckptvault(lambda: ckptvault.save(state, tmp_path / "v", step=7))
    assert saved, "control: a save with the same threshold was never interrupted, so the probe proves nothing"

    interrupted, back = _collections_inside_ckptvault(lambda: ckptvault.load(tmp_path / "v"))
    assert interrupted == []
    assert gc.isenabled()
    assert back["step"] == 7 and all(torch.equal(back["model"][k], v) for k, v in state["model"].items())

    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        interrupted, back = _collections_inside_ckptvault(lambda: mgr.restore(7, into={"model": state["model"]}))
    assert interrupted == [] and gc.isenabled()


def test_restores_keep_the_collector_as_the_process_set_it(tmp_path: Path) -> None:
    """Overlapping restores in several threads re-enable the collector once, after the last; a process that
    disabled the collector finds it disabled after a restore."""
    import torch

    import ckptvault

    ckptvault.save({"w": torch.arange(100_000.0)}, tmp_path / "v", step=1)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: ckptvault.load(tmp_path / "v"), range(8)))
    assert all(torch.equal(r["w"], torch.arange(100_000.0)) for r in results)
    assert gc.isenabled()

    gc.disable()
    try:
        ckptvault.load(tmp_path / "v")
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ckptvault.errors.StepNotFoundError):
        ckptvault.load(tmp_path / "v", step=2)
    assert gc.isenabled()


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_run_no_collection_inside_and_the_one_due_at_their_end(tmp_path: Path, async_save: bool) -> None:
    """From the snapshot to the commit (predictions and the write included) a save runs no automatic collection,
    so its temporaries die before the collector sees them; the collection that is due runs where the save ends
    (``resume``), so back-to-back saves never hold collection off."""
    import torch

    from ckptvault import CheckpointManager, DeltaOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = {}
    with CheckpointManager(tmp_path / "v", async_save=async_save, delta=DeltaOptions(predict=True)) as mgr:
        def train_and_save() -> None:
            for step in range(1, 5):
                model(torch.randn(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
                mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
                mgr.wait()
                expected[step] = {k: v.clone() for k, v in model.state_dict().items()}

        interrupted, _ = _collections_inside_ckptvault(train_and_save)
        assert gc.isenabled()
        paused = ("_save/snapshot.py:take_snapshot", "_save/pipeline.py:_run")
        assert [w for w in interrupted if any(span in w for span in paused)] == []
        assert any(w.startswith("_parallel.py:resume_collector < _save/pipeline.py:") for w in interrupted)
        assert any(t.get("predict") for t in mgr.manifest(4)["tensors"])
        back = mgr.restore(4)
        assert all(torch.equal(back["model"][k], v) for k, v in expected[4].items())


def test_staging_copies_every_kind_of_leaf_exactly() -> None:
    """The staging buffer holds the exact bytes of small tensors (numpy's copy), large ones (torch's, from
    PARALLEL_COPY bytes on), tensors that are not plain memory (a transpose, a conjugate), numpy arrays and empty
    tensors, each at its aligned offset."""
    import torch

    from ckptvault._arrays import host_contiguous, tensor_bytes
    from ckptvault._save.staging import PARALLEL_COPY, StagingBuffer, aligned_offsets

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, generator=gen), torch.randn(PARALLEL_COPY // 4 + 3, generator=gen),
               torch.randn(5, 9, generator=gen).t(), torch.randn(4, dtype=torch.complex64, generator=gen).conj(),
               torch.arange(11, dtype=torch.int16), torch.empty(0)]
    arrays = [np.arange(13, dtype=np.float64), np.arange(6, dtype=">i4")]
    values = [("torch", t) for t in tensors] + [("numpy", a) for a in arrays]
    sizes = [t.numel() * t.element_size() for t in tensors] + [a.nbytes for a in arrays]
    staging = StagingBuffer()
    views = staging.copy_in(values, sizes)
    expected = [bytes(tensor_bytes(host_contiguous(t))) for t in tensors]
    expected += [a.astype(a.dtype.newbyteorder("<")).tobytes() for a in arrays]
    assert [bytes(v) for v in views] == expected
    offsets, _ = aligned_offsets(sizes)
    base = staging.acquire(0).numpy()
    for view, offset, size in zip(views, offsets, sizes, strict=True):
        if size:
            assert np.shares_memory(np.frombuffer(view, np.uint8), base[offset:offset + size])


def test_tensor_bytes_are_the_values_in_c_order_whichever_way_they_are_viewed() -> None:
    """host_bytes gives every tensor's values in C order, little-endian: through numpy's view where numpy has one
    (aliasing the tensor's memory), else through a uint8 view of a contiguous copy (bfloat16, float8, uint16, a
    conjugate or negative view, a transpose, an expanded tensor, an empty one, a Parameter)."""
    import torch

    from ckptvault._arrays import host_bytes, tensor_bytes

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    complex_ = torch.randn(4, dtype=torch.complex64, generator=gen)
    cases = {
        "float32": base, "parameter": torch.nn.Parameter(base.clone()), "0-d": torch.tensor(2.5),
        "empty": torch.empty(0, 3), "bool": base > 0, "float16": base.half(), "bfloat16": base.bfloat16(),
        "float8": base.to(torch.float8_e4m3fn), "uint16": torch.arange(9, dtype=torch.int32).to(torch.uint16),
        "int64": torch.arange(7), "complex64": complex_, "conj": complex_.conj(), "neg view": complex_.conj().imag,
        "transpose": base.t(), "odd stride on a size-1 dim": base[::2][:1], "slice": base[2:4],
        "expanded": base[:1].expand(3, 5),
    }
    for name, t in cases.items():
        reference = t.detach().resolve_conj().resolve_neg().contiguous().flatten().view(torch.uint8)
        expected = reference.numpy().tobytes() if t.numel() else b""
        view = host_bytes(t)
        assert (view.format, view.ndim, bytes(view)) == ("B", 1, expected), name
    plain = torch.zeros(4)
    view = tensor_bytes(plain)
    view[4:8] = np.float32(1.5).tobytes()  # a view of the tensor's memory, not a copy
    assert plain.tolist() == [0.0, 1.5, 0.0, 0.0]
    assert np.shares_memory(np.frombuffer(host_bytes(base), np.uint8), base.numpy())
