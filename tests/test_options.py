"""Typed option objects (``ckptvault.options``), the flat spellings they replace, ``ckptvault.save``/``load``
taking what the manager takes, typed storage options per store, and the public names of the package."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import ckptvault
from ckptvault import (
    AsyncOptions,
    CheckpointManager,
    DeltaOptions,
    KeepLast,
    LocalOptions,
    LossySafety,
    MemoryStore,
    Retention,
    S3Options,
)
from ckptvault.errors import InvalidArgumentError, LossyCodecError
from conftest import assert_same_state
from helpers.async_stores import GatedStore


def _state(scale: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    return {"w": w + scale * 1e-3, "b": torch.arange(256, dtype=torch.float32) * scale}


def _keyframes(mgr: CheckpointManager) -> list[tuple[int, int]]:
    return [(mgr.manifest(s)["keyframe_step"], mgr.manifest(s)["since_keyframe"]) for s in mgr.steps()]


def test_delta_options_and_the_flat_spelling_write_the_same_keyframes(tmp_path: Path) -> None:
    cadences = []
    for name, kwargs in (("typed", {"delta": DeltaOptions(keyframe_every=2)}), ("flat", {"keyframe_every": 2})):
        with CheckpointManager(tmp_path / name, async_save=False, **kwargs) as mgr:
            for step in range(5):
                mgr.save(step, _state(step))
            cadences.append(_keyframes(mgr))
    assert cadences[0] == cadences[1] == [(0, 0), (0, 1), (2, 0), (2, 1), (4, 0)]


def test_async_options_skip_a_save_while_one_is_in_flight(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "v")  # holds the background save until the gate opens
    with CheckpointManager(store, async_options=AsyncOptions(on_busy="skip")) as mgr:
        first = mgr.save(1, _state(1))
        assert store.blocked.wait(10)
        with pytest.warns(RuntimeWarning, match="skipping the save of step 2: step 1 is still being saved"):
            second = mgr.save(2, _state(2))
        store.gate.set()
        assert first.wait() is not None and second.wait() is None
        assert mgr.steps() == [1]


def test_lossy_safety_fail_fails_the_save(tmp_path: Path) -> None:
    tiny = {"m": torch.full((4096,), 1e-9)}  # fp16 flushes every value to zero
    with CheckpointManager(tmp_path / "v", async_save=False, codec_rules={"*": "fp16"},
                           lossy_safety=LossySafety(on_unsafe="fail")) as mgr:
        with pytest.raises(LossyCodecError, match="fp16 on 'm' is unsafe"):
            mgr.save(1, tiny)
        assert mgr.steps() == []


@pytest.mark.parametrize(("make", "message"), [
    (lambda: DeltaOptions(keyframe_every=0), "keyframe_every must be >= 1, got 0"),
    (lambda: DeltaOptions(keyframe_every="5"), "keyframe_every"),
    (lambda: DeltaOptions(keyframe_growth=0), "keyframe_growth must be > 0"),
    (lambda: DeltaOptions(cache_keyframe="yes"), "cache_keyframe"),
    (lambda: AsyncOptions(on_busy="later"), r"on_busy must be one of \('wait', 'skip'\), got 'later'"),
    (lambda: AsyncOptions(max_staging_bytes=-1), "max_staging_bytes must be at least 0"),
    (lambda: LossySafety(on_unsafe="maybe"), "on_unsafe must be one of"),
    (lambda: LossySafety(max_flushed=2), r"max_flushed must be within \[0, 1\], got 2"),
    (lambda: LocalOptions(direct_io="sometimes"), "direct_io must be true, false or 'auto'"),
    (lambda: LocalOptions(external_links=1), "external_links must be true or false"),
    (lambda: S3Options(workers=0), "workers, max_concurrency, max_attempts and max_pool_connections must be at least 1"),
    (lambda: S3Options(read_timeout="30"), "storage_options read_timeout"),
    (lambda: S3Options(multipart_chunksize=1 << 20), "multipart_chunksize must be at least 5 MiB"),
])
def test_option_objects_check_their_values_when_made(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=message):
        make()


def test_option_objects_are_frozen() -> None:
    for option in (DeltaOptions(), AsyncOptions(), LossySafety(), LocalOptions(), S3Options()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            option.__setattr__(dataclasses.fields(option)[0].name, None)


def test_a_flat_keyword_and_its_option_object_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"keyframe_every and delta= were both given: set keyframe_every "
                                                   r"inside delta=DeltaOptions\(...\) only"):
        CheckpointManager(tmp_path, delta=DeltaOptions(), keyframe_every=3)
    with pytest.raises(InvalidArgumentError, match="max_flushed and lossy_safety= were both given"):
        CheckpointManager(tmp_path, lossy_safety=LossySafety(), max_flushed=0.1)


def test_unknown_keywords_and_wrong_option_types_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="CheckpointManager\\(\\) got an unexpected keyword argument 'keyframes'"):
        CheckpointManager(tmp_path, keyframes=3)
    with pytest.raises(InvalidArgumentError, match="delta must be DeltaOptions"):
        CheckpointManager(tmp_path, delta={"keyframe_every": 3})  # type: ignore[arg-type]


def test_every_flat_spelling_folds_into_its_object(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keyframe_every=3, keyframe_growth=2.0, cache_keyframe=False, on_busy="skip",
                           max_staging_bytes=10, on_unsafe="keep", max_flushed=0.5) as mgr:
        saver = mgr._saver
        assert (mgr.delta_policy.every, mgr.delta_policy.growth, saver.cache_keyframe) == (3, 2.0, False)
        assert (saver.on_busy, saver.max_staging_bytes) == ("skip", 10)
        assert saver.safety == LossySafety("keep", 0.5)


def test_save_takes_every_keyword_the_manager_takes(tmp_path: Path) -> None:
    url = tmp_path / "v"
    for step in range(4):
        info = ckptvault.save(_state(step), url, step, keyframe_every=2, metrics={"loss": 1.0 / (step + 1)})
        assert info is not None and info.step == step and info.metrics == {"loss": 1.0 / (step + 1)}
    ckptvault.save(_state(9), url, 9, delta=DeltaOptions(keyframe_every=2), retention=Retention(KeepLast(2)),
                   codec_rules={"b": "lz4"}, storage_options=LocalOptions(), workers=2)
    with CheckpointManager(url) as mgr:
        assert mgr.steps() == [2, 3, 9]  # the last 2, and the keyframe step 3 is a delta against
        assert _keyframes(mgr) == [(2, 0), (2, 1), (9, 0)]
        assert mgr.info(9).tensors[0].codec in ("lz4", "zstd")
    assert_same_state(_state(9), ckptvault.load(url, 9, workers=2))


def test_save_and_load_refuse_what_they_cannot_honour(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"ckptvault.save\(\) is synchronous and takes no async_save"):
        ckptvault.save(_state(1), tmp_path, 1, async_save=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'keyframe_evry'"):
        ckptvault.save(_state(1), tmp_path, 1, keyframe_evry=2)
    ckptvault.save(_state(1), tmp_path, 1)
    with pytest.raises(TypeError, match="load\\(\\) got an unexpected keyword argument 'codec'"):
        ckptvault.load(tmp_path, codec="lz4")


def test_save_and_load_forward_every_keyword_of_the_methods_they_wrap() -> None:
    save_takes = set(inspect.signature(CheckpointManager.save).parameters) - {"self", "step", "state"}
    restore_takes = set(inspect.signature(CheckpointManager.restore).parameters) - {"self", "step"}
    assert save_takes == ckptvault._SAVE_KEYWORDS and restore_takes == ckptvault._RESTORE_KEYWORDS
    assert {"metrics", "metadata", "overwrite", "allow_pickle", "progress"} <= save_takes
    assert {"into", "keys", "strict"} <= restore_takes


def test_typed_storage_options_reach_the_local_store(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "v", storage_options=LocalOptions(external_links=True)) as mgr:
        assert mgr.vault.store.external_links is True  # type: ignore[attr-defined]
    with CheckpointManager(tmp_path / "w", storage_options={"external_links": True}) as mgr:
        assert mgr.vault.store.external_links is True  # type: ignore[attr-defined]


def test_storage_options_of_another_store_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=f"storage_options S3Options are not for {tmp_path}: it takes "
                                                   "LocalOptions or a dict"):
        CheckpointManager(tmp_path, storage_options=S3Options())
    with pytest.raises(InvalidArgumentError, match="storage_options LocalOptions are not for s3://b/p: it takes "
                                                   "S3Options or a dict"):
        CheckpointManager("s3://b/p", storage_options=LocalOptions())
    with pytest.raises(InvalidArgumentError, match=r"unknown storage_options for local vaults: \['endpoint_url'\]"):
        CheckpointManager(tmp_path, storage_options={"endpoint_url": "http://x"})
    with pytest.raises(InvalidArgumentError, match="storage_options are not used by memory:// stores"):
        CheckpointManager("memory://x", storage_options=LocalOptions())
    with pytest.raises(InvalidArgumentError, match="storage_options are for a URL; the store memory://y was given"):
        CheckpointManager(MemoryStore("y"), storage_options={"direct_io": True})


def test_s3_store_takes_an_options_object_or_keywords_not_both() -> None:
    pytest.importorskip("boto3")
    from ckptvault.stores.s3 import S3Store

    with pytest.raises(InvalidArgumentError, match="S3Store takes an S3Options or its fields as keywords, not "
                                                   "S3Options and keywords"):
        S3Store("s3://b/p", S3Options(), workers=2)


def test_the_public_names_are_exported_documented_and_importable() -> None:
    exported = set(ckptvault.__all__)
    assert {"Retention", "KeepBest", "KeepLast", "Store", "LocalStore", "DeltaOptions", "AsyncOptions", "LossySafety",
            "LocalOptions", "S3Options", "CheckpointManager", "save", "load", "copy_checkpoints"} <= exported
    namespace: dict[str, object] = {}
    exec("from ckptvault import *", namespace)  # noqa: S102 - what `import *` gives is the public surface
    assert exported <= set(namespace)
    undocumented = [n for n in exported - {"__version__", "StorageOptions"} if not inspect.getdoc(getattr(ckptvault, n))]
    assert not undocumented


def test_the_package_root_holds_about_a_dozen_modules_and_internals_are_underscored() -> None:
    root = Path(ckptvault.__file__).parent
    modules = sorted(p.stem for p in root.glob("*.py"))
    assert len(modules) <= 16, modules
    public = {"__init__", "__main__", "errors", "handle", "info", "manager", "options", "rng", "rules"}
    assert {m for m in modules if not m.startswith("_")} <= public
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    assert {p for p in packages if not p.startswith("_")} == {"cli", "demo", "distributed", "integrations", "interop", "stores",
                                                                   "testing"}
