"""VaultCheckpointIO: PyTorch Lightning's checkpoints in a vault (ckptvault.integrations.lightning).

Real ``Trainer.fit`` runs on the CPU (tests/helpers/lightning_model.py): checkpoints land at their global steps
and hold what torch.save would have written, bit for bit; top-k rotation deletes exactly the steps Lightning
removes; ``last.ckpt`` at a top-k file's step is stored once; a run resumed from the vault ends bit-identical to
an uninterrupted one; bad paths, options and values, and a failed background save, raise typed errors.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptvault import DeltaOptions, LossySafety
from ckptvault.errors import (
    CheckpointPathNotFoundError,
    InvalidArgumentError,
    LossyCodecError,
    PickleNotAllowedError,
    StepExistsError,
    UnsupportedObjectError,
)
from ckptvault.integrations.lightning import POINTER_FORMAT, VaultCheckpointIO, path_key, path_tag
from ckptvault.stores import LocalStore
from helpers import lightning_model as lm

pytest.register_assert_rewrite("conftest_s3")
from conftest_s3 import Gateway  # noqa: E402

pytest_plugins = ["conftest_s3"]  # the fixtures rgw (the real Ceph gateway) and s3_url
ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",  # Lightning's advice (num_workers, dirpath not empty)
                                        "ignore:.*isinstance.treespec, LeafSpec.*")


@pytest.fixture(autouse=True)
def torch_determinism_restored() -> Any:
    """Trainer(deterministic=True) turns on torch.use_deterministic_algorithms for the whole process; later tests
    (torch.empty of every dtype) must not inherit it."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture(params=["local", "fsspec"])
def vault_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A local vault, and one behind an fsspec URL (fsspec's in-memory file system)."""
    return str(tmp_path / "vault") if request.param == "local" else f"fsspec+memory://ckv-{uuid.uuid4().hex}"


def _saved_steps(files: list[str], dirpath: Path) -> dict[str, int]:
    return {name: json.loads((dirpath / name).read_text())["step"] for name in files}


def test_checkpoints_land_at_their_global_steps_and_hold_what_torch_save_writes(tmp_path: Path, vault_url: str) -> None:
    dirpath = tmp_path / "ckpts"
    lm.fit(lm.trainer(dirpath, 6, every_n_train_steps=2, save_top_k=-1), lm.model())  # Lightning's own torch.save
    expected = {name: torch.load(dirpath / name, weights_only=False) for name in lm.ckpt_files(dirpath)}
    shutil.rmtree(dirpath)  # the same dirpath again: the paths inside the checkpoints agree too

    io = VaultCheckpointIO(vault_url)
    lm.fit(lm.trainer(dirpath, 6, [io], every_n_train_steps=2, save_top_k=-1), lm.model())
    assert lm.ckpt_files(dirpath) == sorted(expected) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                          "epoch=1-step=6.ckpt"]
    assert io.manager.steps() == [2, 4, 6]
    for name, saved in expected.items():
        pointer = json.loads((dirpath / name).read_text())
        assert pointer == {"format": POINTER_FORMAT, "vault": io.url, "step": saved["global_step"]}
        assert lm.differences(io.load_checkpoint(dirpath / name), saved) == []
        info = io.manager.info(saved["global_step"])
        assert info.metadata == {"lightning": {"path": str(dirpath / name), "epoch": saved["epoch"]}}
        assert io.manager.pins()[saved["global_step"]] == {path_tag(path_key(dirpath / name))}
    io.teardown()


def test_top_k_rotation_deletes_exactly_the_steps_lightning_removes(tmp_path: Path) -> None:
    settings: dict[str, Any] = {"every_n_train_steps": 2, "save_top_k": 2, "monitor": "train_loss", "save_last": True}
    reference = tmp_path / "reference"
    lm.fit(lm.trainer(reference, 10, **settings), lm.model())
    kept = {name: torch.load(reference / name, weights_only=False)["global_step"] for name in lm.ckpt_files(reference)}

    dirpath, io = tmp_path / "ckpts", VaultCheckpointIO(tmp_path / "vault")
    lm.fit(lm.trainer(dirpath, 10, [io], **settings), lm.model())
    assert lm.ckpt_files(dirpath) == sorted(kept)  # the same files, each a pointer to its global step
    assert _saved_steps(lm.ckpt_files(dirpath), dirpath) == kept
    assert io.manager.steps() == sorted(set(kept.values()))  # every other step saved on the way was deleted
    assert kept == {"epoch=1-step=6.ckpt": 6, "epoch=2-step=10.ckpt": 10, "last.ckpt": 10}  # steps 2, 4, 8 removed
    assert io.manager.info(10).metadata["lightning"]["path"] == str(dirpath / "epoch=2-step=10.ckpt")  # stored once
    pins = io.manager.pins()
    assert pins == {step: {path_tag(path_key(dirpath / n)) for n, s in kept.items() if s == step} for step in pins}
    last, top = io.load_checkpoint(dirpath / "last.ckpt"), io.load_checkpoint(dirpath / "epoch=2-step=10.ckpt")
    assert lm.differences(last["state_dict"], top["state_dict"]) == []
    assert lm.differences(last["optimizer_states"], top["optimizer_states"]) == []
    io.teardown()


def test_a_run_resumed_from_the_vault_ends_bit_identical_to_an_uninterrupted_one(tmp_path: Path) -> None:
    straight_io = VaultCheckpointIO(tmp_path / "straight-vault")
    straight, straight_module = lm.trainer(tmp_path / "straight", 8, [straight_io], every_n_train_steps=4,
                                           save_top_k=-1, save_last=True), lm.model()
    lm.fit(straight, straight_module)

    first_io = VaultCheckpointIO(tmp_path / "vault")
    lm.fit(lm.trainer(tmp_path / "ckpts", 4, [first_io], every_n_train_steps=4, save_top_k=-1, save_last=True),
           lm.model())
    resumed_io = VaultCheckpointIO(tmp_path / "vault")  # a fresh plugin, as in a new process
    resumed, resumed_module = lm.trainer(tmp_path / "ckpts", 8, [resumed_io], every_n_train_steps=4, save_top_k=-1,
                                         save_last=True), lm.model(seed=1)  # other weights: all must come back
    lm.fit(resumed, resumed_module, ckpt_path="last")  # Lightning finds last.ckpt by listing dirpath

    assert resumed.global_step == straight.global_step == 8
    assert lm.differences(resumed_module.state_dict(), straight_module.state_dict()) == []
    assert lm.differences(resumed.optimizers[0].state_dict(), straight.optimizers[0].state_dict()) == []
    assert lm.differences(resumed.lr_scheduler_configs[0].scheduler.state_dict(),
                          straight.lr_scheduler_configs[0].scheduler.state_dict()) == []
    a, b = resumed_io.load_checkpoint(tmp_path / "ckpts/last.ckpt"), straight_io.load_checkpoint(tmp_path / "straight/last.ckpt")
    for part in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch"):
        assert lm.differences(a[part], b[part]) == [], part
    assert resumed_io.manager.steps() == [4, 8]
    # at step 4, last.ckpt's state differed (ModelCheckpoint's last_model_path), so it replaced the top-k save's:
    # resumed from it, ModelCheckpoint goes on saving last.ckpt, as with torch.save (not last-v1.ckpt)
    assert resumed_io.manager.info(4).metadata["lightning"]["path"] == str(tmp_path / "ckpts" / "last.ckpt")
    assert lm.ckpt_files(tmp_path / "ckpts") == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert resumed_io.manager.info(8).metadata["lightning"]["path"] == str(tmp_path / "ckpts" / "epoch=1-step=8.ckpt")
    resumed_io.teardown()
    straight_io.teardown()


def _predicted(io: VaultCheckpointIO, step: int) -> set[str]:
    return {t["path"] for t in io.manager.manifest(step)["tensors"] if "predict" in t}


def test_a_checkpoint_every_step_with_predictions_resumes_bit_identical(tmp_path: Path) -> None:
    """Lightning's checkpoint dict (``state_dict``, ``optimizer_states`` as a list) checkpointed every step with
    predicted deltas: every weight and moment of a step after the first is stored against its prediction (the
    resumed run's first save too), every step loads as the plain vault of an uninterrupted run holds it, and a run
    resumed from step 4 ends where that run does, bit for bit."""
    every_step = {"delta": DeltaOptions(predict=True, keyframe_every=20, max_chain=19)}
    straight_io = VaultCheckpointIO(tmp_path / "straight-vault")
    straight, straight_module = lm.trainer(tmp_path / "straight", 8, [straight_io], every_n_train_steps=1,
                                           save_top_k=-1), lm.model()
    lm.fit(straight, straight_module)

    first_io = VaultCheckpointIO(tmp_path / "vault", **every_step)
    lm.fit(lm.trainer(tmp_path / "ckpts", 4, [first_io], every_n_train_steps=1, save_top_k=-1), lm.model())
    first_io.teardown()
    resumed_io = VaultCheckpointIO(tmp_path / "vault", **every_step)
    resumed, resumed_module = lm.trainer(tmp_path / "ckpts", 8, [resumed_io], every_n_train_steps=1,
                                         save_top_k=-1), lm.model(seed=1)
    lm.fit(resumed, resumed_module, ckpt_path=str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt"))

    assert lm.differences(resumed_module.state_dict(), straight_module.state_dict()) == []
    assert lm.differences(resumed.optimizers[0].state_dict(), straight.optimizers[0].state_dict()) == []
    assert resumed_io.manager.steps() == list(range(1, 9))
    for name in lm.ckpt_files(tmp_path / "straight"):
        a, b = resumed_io.load_checkpoint(tmp_path / "ckpts" / name), straight_io.load_checkpoint(tmp_path / "straight" / name)
        for part in ("state_dict", "optimizer_states", "lr_schedulers", "global_step"):
            assert lm.differences(a[part], b[part]) == [], (name, part)
    names = [name for name, _ in resumed_module.named_parameters()]
    moments = {f"optimizer_states.0.state.{i}.{m}" for i in range(len(names)) for m in ("exp_avg", "exp_avg_sq")}
    expected = {f"state_dict.{name}" for name in names} | moments
    # step 5, the resumed process's first save, predicts from step 4 as the plugin restored it
    assert {step: _predicted(resumed_io, step) for step in range(2, 9)} == dict.fromkeys(range(2, 9), expected)
    assert _predicted(resumed_io, 1) == set()
    resumed_io.teardown()
    straight_io.teardown()


def test_a_path_with_no_checkpoint_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    io = VaultCheckpointIO(tmp_path / "vault")
    missing = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    with pytest.raises(CheckpointPathNotFoundError, match=r"no committed checkpoint of .*vault is stored for "
                                                          r".*epoch=0-step=3\.ckpt: the vault holds no checkpoint"):
        io.load_checkpoint(missing)
    lm.fit(lm.trainer(tmp_path / "ckpts", 2, [io], every_n_train_steps=2), lm.model())
    with pytest.raises(FileNotFoundError, match=r"the vault holds steps \[2\]; `ckptvault pins"):
        lm.fit(lm.trainer(tmp_path / "ckpts", 4, [io], every_n_train_steps=2), lm.model(), ckpt_path=str(missing))

    other = VaultCheckpointIO(tmp_path / "other-vault")  # the pointer file names the vault that holds it
    with pytest.raises(CheckpointPathNotFoundError, match=r"names step 2 of another vault, .*vault: load it with "
                                                          r"VaultCheckpointIO\("):
        other.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    torch.save({"not": "a pointer"}, tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointPathNotFoundError, match="not a VaultCheckpointIO pointer"):
        io.load_checkpoint(tmp_path / "plain.ckpt")
    io.manager.delete(2)  # by hand: the pin and the pointer outlive it
    with pytest.raises(CheckpointPathNotFoundError, match="names step 2, whose save did not commit or was deleted"):
        io.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    io.teardown()
    other.teardown()


def test_hyper_parameters_that_need_pickle_are_refused_unless_allowed(tmp_path: Path) -> None:
    io = VaultCheckpointIO(tmp_path / "vault")
    with pytest.raises(UnsupportedObjectError, match=r"cannot store pathlib\.\w*Path at key path 'hyper_parameters"
                                                     r"\.data_dir'.*allow_pickle=True"):
        lm.fit(lm.trainer(tmp_path / "ckpts", 2, [io], every_n_train_steps=2), lm.model(data_dir=tmp_path))
    assert io.manager.steps() == []  # nothing stored
    io.teardown()

    pickling = VaultCheckpointIO(tmp_path / "vault", allow_pickle=True)
    lm.fit(lm.trainer(tmp_path / "ckpts", 2, [pickling], every_n_train_steps=2), lm.model(data_dir=tmp_path))
    path = tmp_path / "ckpts" / "epoch=0-step=2.ckpt"
    assert pickling.load_checkpoint(path)["hyper_parameters"]["data_dir"] == tmp_path
    with pytest.raises(PickleNotAllowedError, match="'hyper_parameters.data_dir' was saved with pickle"):
        pickling.load_checkpoint(path, weights_only=True)
    pickling.teardown()


def test_a_background_save_that_fails_surfaces_and_commits_nothing(tmp_path: Path) -> None:
    io = VaultCheckpointIO(tmp_path / "vault", codec_rules={"state_dict.big": "fp16"},
                           lossy_safety=LossySafety(on_unsafe="fail"))  # 1e6 overflows float16: the save fails
    module = lm.model()
    module.register_buffer("big", torch.full((64,), 1e6))
    with pytest.raises(LossyCodecError, match="big"):
        lm.fit(lm.trainer(tmp_path / "ckpts", 4, [io], every_n_train_steps=2), module)
    assert io.manager.steps() == []
    assert lm.ckpt_files(tmp_path / "ckpts") == []  # the pointer of the failed save is gone again
    io.teardown()


def test_a_global_step_another_run_stored_is_refused(tmp_path: Path) -> None:
    first = VaultCheckpointIO(tmp_path / "vault")
    lm.fit(lm.trainer(tmp_path / "run1", 2, [first], every_n_train_steps=2), lm.model())
    second = VaultCheckpointIO(tmp_path / "vault")
    with pytest.raises(StepExistsError, match=r"global step 2 is already stored in .*vault by another run .*"
                                              r"epoch=0-step=2\.ckpt cannot be stored.*`ckptvault rm .*vault 2`"):
        lm.fit(lm.trainer(tmp_path / "run2", 2, [second], every_n_train_steps=2), lm.model())
    assert lm.ckpt_files(tmp_path / "run2") == []
    second.teardown()
    first.teardown()


def test_removing_a_path_whose_save_is_in_flight_deletes_its_step_after_the_commit(tmp_path: Path) -> None:
    io = VaultCheckpointIO(tmp_path / "vault")
    state = {"global_step": 5, "epoch": 0, "state_dict": {"w": torch.arange(1000.0)}}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    io.save_checkpoint(state, tmp_path / "b.ckpt")  # the same global step: an alias, nothing stored again
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    assert lm.differences(io.load_checkpoint(tmp_path / "b.ckpt"), state) == []
    io.remove_checkpoint(tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "never-saved.ckpt")  # as TorchCheckpointIO: nothing there, nothing to do
    io.teardown()
    assert io.manager.steps() == [] and io.manager.pins() == {}  # reopened after teardown
    io.teardown()


def test_save_last_link_loads_through_the_link(tmp_path: Path) -> None:
    io = VaultCheckpointIO(tmp_path / "vault")
    lm.fit(lm.trainer(tmp_path / "ckpts", 4, [io], every_n_train_steps=2, save_top_k=1, save_last="link"), lm.model())
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.is_symlink() and last.resolve() == tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    assert io.load_checkpoint(last)["global_step"] == 4 and io.manager.steps() == [4]
    io.teardown()


def test_the_readme_recipe_runs_and_then_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "README.md").read_text()
    marker = text.index("<!-- lightning-recipe:")
    code = text[text.index("```python\n", marker) + len("```python\n"):text.index("```\n", marker + 30)]
    monkeypatch.chdir(tmp_path)
    runs = []
    for _ in range(2):  # the second run finds ./ckpts/last.ckpt, resumes at step 40 and ends there
        namespace: dict[str, Any] = {"__name__": "readme"}
        exec(compile(code, "README.md", "exec"), namespace)
        namespace["vault"].teardown()
        runs.append((namespace["trainer"].global_step, lm.ckpt_files("ckpts"), namespace["vault"].manager.steps()))
    assert runs[0] == runs[1]
    assert runs[0][0] == 40 and "last.ckpt" in runs[0][1] and len(runs[0][1]) == 3 and 40 in runs[0][2]
    namespace["vault"].teardown()


def test_the_standalone_pytorch_lightning_trainer_takes_the_plugin(tmp_path: Path) -> None:
    pytorch_lightning = pytest.importorskip("pytorch_lightning")  # installed apart from the unified lightning package
    io = VaultCheckpointIO(tmp_path / "vault")
    tr = pytorch_lightning.Trainer(max_steps=2, plugins=[io], logger=False, enable_progress_bar=False,
                                   enable_model_summary=False, default_root_dir=str(tmp_path),
                                   callbacks=[pytorch_lightning.callbacks.ModelCheckpoint(tmp_path / "ckpts",
                                                                                          every_n_train_steps=2)])
    module = lm.standalone_tiny_module()
    tr.fit(module, lm.loader())
    assert io.manager.steps() == [2]
    assert lm.differences(io.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")["state_dict"],
                          module.state_dict()) == []
    io.teardown()


def test_another_state_at_the_same_global_step_replaces_it_for_every_path(tmp_path: Path) -> None:
    io = VaultCheckpointIO(tmp_path / "vault")
    weights = torch.arange(1000.0)
    io.save_checkpoint({"global_step": 5, "w": weights}, tmp_path / "a.ckpt")
    io.save_checkpoint({"global_step": 5, "w": weights}, tmp_path / "b.ckpt")  # same tensor, unmodified: an alias
    assert io.manager.info(5).metadata["lightning"]["path"] == str(tmp_path / "a.ckpt")
    weights.add_(1)  # changed in place (a BatchNorm's running stats in a forward pass): the same memory, a new version
    io.save_checkpoint({"global_step": 5, "w": weights}, tmp_path / "c.ckpt")
    for name in ("a.ckpt", "b.ckpt", "c.ckpt"):
        assert torch.equal(io.load_checkpoint(tmp_path / name)["w"], torch.arange(1000.0) + 1), name
    assert io.manager.info(5).metadata["lightning"]["path"] == str(tmp_path / "c.ckpt")
    assert io.manager.steps() == [5] and len(io.manager.pins()[5]) == 3
    io.teardown()


def test_arguments_the_plugin_cannot_use_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="takes the vault's URL or path .* got LocalStore"):
        VaultCheckpointIO(LocalStore(tmp_path / "vault"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="no distributed=: Lightning saves a checkpoint from global rank 0"):
        VaultCheckpointIO(tmp_path / "vault", distributed=None)
    with pytest.raises(InvalidArgumentError, match="no on_busy='skip'"):
        VaultCheckpointIO(tmp_path / "vault", on_busy="skip")
    with pytest.raises(InvalidArgumentError, match="allow_pickle must be a bool"):
        VaultCheckpointIO(tmp_path / "vault", allow_pickle="yes")  # type: ignore[arg-type]
    io = VaultCheckpointIO(tmp_path / "vault")
    with pytest.raises(InvalidArgumentError, match="takes no storage_options .* VaultCheckpointIO\\(url, storage_options"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "a.ckpt", storage_options={"x": 1})
    with pytest.raises(InvalidArgumentError, match="'global_step', which must be an int >= 0; got None"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "a.ckpt")
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, tmp_path / "a.ckpt")
    with pytest.raises(InvalidArgumentError, match="map_location as a device or its name .* got function"):
        io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: storage)
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt", map_location="cpu")["w"], torch.ones(3))
    assert not list(tmp_path.glob("*.tmp"))
    io.teardown()


def test_checkpoints_go_to_an_s3_vault_and_a_run_resumes_from_it(tmp_path: Path, s3_url: str, rgw: Gateway) -> None:
    dirpath = tmp_path / "ckpts"
    io = VaultCheckpointIO(s3_url, storage_options=rgw.options())
    lm.fit(lm.trainer(dirpath, 4, [io], every_n_train_steps=2, save_top_k=-1), lm.model())
    assert io.manager.steps() == [2, 4]
    saved = io.load_checkpoint(dirpath / "epoch=0-step=4.ckpt")
    io.teardown()

    resumed_io = VaultCheckpointIO(s3_url, storage_options=rgw.options())
    module = lm.model(seed=1)
    lm.fit(lm.trainer(tmp_path / "again", 4, [resumed_io], every_n_train_steps=2, save_top_k=-1), module,
           ckpt_path=str(dirpath / "epoch=0-step=4.ckpt"))  # max_steps reached: only the restore runs
    assert lm.differences(module.state_dict(), saved["state_dict"]) == []
    resumed_io.teardown()

