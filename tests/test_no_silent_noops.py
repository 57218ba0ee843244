"""No silent no-ops: what used to be refused, ignored or left unexplained now works or says what to do.

Non-finite metrics, use after close, codec rules that match nothing, warnings that point at the caller's line,
dict subclasses, the best step and pins, and the CLI's wording (compression, storage options, unreachable
endpoints, -v logging, presets).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckptvault import CheckpointManager, KeepBest
from ckptvault.cli import main
from ckptvault.errors import (
    InvalidArgumentError,
    ManagerClosedError,
    PinNotFoundError,
    RetryableStorageError,
    UnmatchedRuleWarning,
    VaultError,
)
from ckptvault.rules import PRESETS

ROOT = Path(__file__).resolve().parent.parent


def _state(scale: float = 1.0) -> dict[str, Any]:
    return {"model": {"fc.weight": torch.full((8, 4), scale), "fc.bias": torch.zeros(8)},
            "optimizer": {"state": {0: {"exp_avg": torch.ones(8) * scale}}}}


def _cli(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """``-v`` sets the level of the ckptvault logger for the process; put it back afterwards."""
    logger = logging.getLogger("ckptvault")
    level = logger.level
    yield
    logger.setLevel(level)


# -- 1. non-finite metrics -----------------------------------------------------------------
def test_non_finite_metrics_are_stored_warned_at_the_caller_and_read_back_as_floats(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.warns(RuntimeWarning, match=r"metric loss=nan is not a finite number.*save\(metrics=") as caught:
            mgr.save(1, _state(), metrics={"loss": float("nan"), "lr": 0.1})
        assert [w.filename for w in caught] == [__file__]  # the save() line above, not ckptvault's
        with pytest.warns(RuntimeWarning, match=r"metrics loss=inf, curve\[1\]=-inf are not finite numbers"):
            mgr.save(2, _state(2), metrics={"loss": float("inf"), "curve": [1.0, float("-inf")]})
        assert mgr.manifest(1)["metrics"] == {"loss": "nan", "lr": 0.1}  # strict JSON on storage
        assert mgr.manifest(2)["metrics"] == {"loss": "inf", "curve": [1.0, "-inf"]}
        loss = mgr.info(1).metrics["loss"]
        assert isinstance(loss, float) and math.isnan(loss)
        assert mgr.info(2).metrics == {"loss": math.inf, "curve": [1.0, -math.inf]}
        with pytest.raises(InvalidArgumentError, match="metadata must be JSON-serialisable.*non-finite"):
            mgr.save(3, _state(), metadata={"x": float("nan")})  # metadata stays strict: no silent conversion


def test_ls_and_show_print_non_finite_metrics_and_keep_json_strict(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with CheckpointManager(tmp_path, async_save=False) as mgr:
            mgr.save(1, _state(), metrics={"loss": float("nan")})
            mgr.save(2, _state(2), metrics={"loss": float("-inf")})
    text = _cli("ls", tmp_path)
    assert text.exit_code == 0, text.output
    rows = text.stdout.strip().splitlines()[1:]
    assert rows[0].split()[-1] == "loss=nan" and rows[1].split()[-1] == "loss=-inf"
    listed = _strict_json(_cli("ls", tmp_path, "--json").stdout)
    assert [c["metrics"] for c in listed["checkpoints"]] == [{"loss": "nan"}, {"loss": "-inf"}]
    shown = _cli("show", tmp_path, 1)
    assert "metrics   loss=nan" in shown.stdout
    assert _strict_json(_cli("show", tmp_path, 1, "--json").stdout)["metrics"] == {"loss": "nan"}


def test_keep_best_and_best_step_ignore_non_finite_and_missing_metrics(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with CheckpointManager(tmp_path, async_save=False, incremental=False) as mgr:
            for step, loss in ((1, float("nan")), (2, 3.0), (3, float("-inf")), (4, 2.0), (5, None), (6, 9.0)):
                mgr.save(step, _state(step), metrics={} if loss is None else {"loss": loss, "acc": -step * 1.0})
            plan, _ = mgr.prune(KeepBest(1, "loss"), dry_run=True)
            kept = {d.step: d.reasons for d in plan.decisions if d.keep}
            assert kept == {4: ("best 1 by loss (min)",), 6: ("latest",)}  # not the -inf of step 3
            assert mgr.best_step("loss") == 4 and mgr.best_step("loss", mode="max") == 6
            assert mgr.best_step("acc", mode="max") == 1 and mgr.best_step("missing") is None
            with pytest.raises(InvalidArgumentError, match="mode must be 'min' or 'max'"):
                mgr.best_step("loss", mode="lowest")


# -- 2. use after close ----------------------------------------------------------------------
def test_a_closed_manager_refuses_every_use_and_says_to_open_a_new_one(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state())
    mgr.close()
    mgr.close()  # closing twice is harmless
    for call, name in ((lambda: mgr.save(2, _state()), "save()"), (mgr.steps, "steps()"), (mgr.restore, "restore()"),
                       (lambda: mgr.info(1), "info()"), (mgr.verify, "verify()"), (mgr.latest_step, "steps()"),
                       (lambda: mgr.pin(1, "best"), "pin()"), (mgr.pins, "pins()"), (mgr.gc, "gc()"),
                       (lambda: mgr.prune(KeepBest(1, "loss")), "prune()"), (lambda: mgr.best_step("loss"), "best_step()")):
        with pytest.raises(ManagerClosedError, match="open a new CheckpointManager") as caught:
            call()
        assert name in str(caught.value) and isinstance(caught.value, RuntimeError)
    with CheckpointManager(tmp_path) as again:
        assert again.steps() == [1]  # the refused save did not happen


# -- 3. codec rules that match nothing -------------------------------------------------------
def test_a_rule_that_matches_nothing_warns_once_with_close_key_paths(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False, codec_rules={"modle.*": "bf16", "optimizer.*": "lz4",
                                                                     "model.*@float16": "bf16"}) as mgr:
        with pytest.warns(UnmatchedRuleWarning) as caught:
            mgr.save(1, _state())
        assert len(caught) == 1 and caught[0].filename == __file__
        message = str(caught[0].message)
        assert "'modle.*' (did you mean 'model.*'" in message
        assert "'model.*@float16' (its key paths hold float32, not float16)" in message
        assert "'optimizer.*'" not in message and "'model.fc.weight'" in message  # matched rules are not named
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.save(2, _state(2))  # only the first save checks


def test_preset_patterns_are_checked_but_not_the_catch_all(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False, codec_rules="moments-compact") as mgr:
        with pytest.warns(UnmatchedRuleWarning) as caught:
            mgr.save(1, {"model": {"w": torch.ones(4)}})
    message = str(caught[0].message)
    assert "'*exp_avg_sq'" in message and "'*exp_avg'" in message and "'*' " not in message
    with CheckpointManager(tmp_path / "full", async_save=False, codec_rules="lossless") as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.save(1, _state())  # no rules, nothing to warn about


def test_an_unmatched_rule_can_be_made_an_error_that_stops_the_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, codec_rules={"modle.*": "bf16"}) as mgr:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", category=UnmatchedRuleWarning)
            with pytest.raises(UnmatchedRuleWarning, match="did you mean 'model.*'") as caught:
                mgr.save(1, _state())
        assert isinstance(caught.value, VaultError)
        mgr.wait()
        assert mgr.steps() == []  # nothing was written


# -- 4. warnings point at the caller ---------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True])
def test_the_lossy_fallback_warning_points_at_the_callers_line(tmp_path: Path, async_save: bool) -> None:
    tiny = {"x": torch.full((1000,), 1e-9)}  # fp16 flushes all of it to zero: falls back to bf16
    with CheckpointManager(tmp_path, async_save=async_save, codec_rules={"x": "fp16"}) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = mgr.save(1, tiny)
            handle.wait()
        fallback = [w for w in caught if "fell back to bf16" in str(w.message)]
        assert len(fallback) == 1 and fallback[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
        assert mgr.info(1).tensors[0].codec.startswith("bf16")


# -- 5. dict subclasses ----------------------------------------------------------------------
def test_dict_subclasses_are_stored_as_plain_dicts_with_a_one_time_warning(tmp_path: Path) -> None:
    class Hparams(dict):  # like Lightning's AttributeDict
        pass

    counts: collections.defaultdict[str, Any] = collections.defaultdict(int, {"seen": 3})
    state = {"hparams": Hparams(lr=0.1, layers=[1, 2]), "counts": counts, "w": torch.ones(3),
             "order": collections.OrderedDict(b=1, a=2)}
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.warns(UserWarning, match="stored as a plain dict") as caught:
            mgr.save(1, state)
        messages = sorted(str(w.message) for w in caught if "plain dict" in str(w.message))
        assert len(messages) == 2 and "collections.defaultdict at key path 'counts'" in messages[0]
        assert "Hparams at key path 'hparams'" in messages[1] and "allow_pickle=True" in messages[1]
        assert all(w.filename == __file__ for w in caught)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.save(2, state)  # once per type
        restored = mgr.restore(1)
    assert type(restored["hparams"]) is dict and restored["hparams"] == {"lr": 0.1, "layers": [1, 2]}
    assert type(restored["counts"]) is dict and restored["counts"] == {"seen": 3}
    assert type(restored["order"]) is collections.OrderedDict and list(restored["order"]) == ["b", "a"]
    assert torch.equal(restored["w"], torch.ones(3))


def test_with_pickle_allowed_a_dict_subclass_keeps_its_type(tmp_path: Path) -> None:
    counts: collections.defaultdict[str, int] = collections.defaultdict(int, {"a": 1})
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"counts": counts}, allow_pickle=True)
        restored = mgr.restore(allow_pickle=True)["counts"]
    assert type(restored) is collections.defaultdict and restored["missing"] == 0


# -- 6. best step, tags and pins -------------------------------------------------------------
def test_step_of_finds_a_pinned_step_for_restore_and_names_the_tags_otherwise(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step), metrics={"loss": 4.0 - step if step != 3 else 5.0})
        with pytest.raises(PinNotFoundError, match="pinned as 'best'; the vault has no pins"):
            mgr.step_of("best")
        best = mgr.best_step("loss")
        assert best == 2
        mgr.pin(best, "best")
        mgr.pin(1, "release")
        assert mgr.step_of("best") == 2
        assert torch.equal(mgr.restore(mgr.step_of("best"))["model"]["fc.weight"], torch.full((8, 4), 2.0))
        assert torch.equal(mgr.restore("best")["model"]["fc.weight"], torch.full((8, 4), 2.0))  # a tag for a step
        assert mgr.info("release").step == 1 and mgr.manifest("best")["step"] == 2
        with pytest.raises(PinNotFoundError, match="tags in use: best, release"):
            mgr.restore("nope")
        with pytest.raises(InvalidArgumentError, match=r"got '2': pass int\('2'\) for that step, or "
                                                       r"mgr.step_of\('2'\) for a pin tag of digits"):
            mgr.restore("2")  # text of a step number is not taken for a tag
        with pytest.raises(PinNotFoundError, match=r"tags in use: best, release\. Pin one with mgr.pin") as caught:
            mgr.step_of("nope")
        assert isinstance(caught.value, LookupError)


def test_ls_show_and_pins_show_pins_and_why_checkpoints_are_kept(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False, keyframe_every=10) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step))
        mgr.pin(2, "best")
        mgr.pin(2, "release-1")
        keyframe = {step: mgr.manifest(step)["keyframe_step"] for step in (1, 2, 3, 4)}
    assert keyframe[1] == keyframe[2] == 1 and keyframe[4] in (1, 3)  # 2 is a delta; so is 4 (of 1, or of 3)
    listing = _cli("ls", tmp_path)
    assert listing.exit_code == 0, listing.output
    header, *rows = listing.stdout.strip().splitlines()
    assert header.split() == ["STEP", "TIME", "LOGICAL", "STORED", "ADDED", "COMPRESSION", "KEPT", "METRICS"]
    kept = {int(r.split()[0]): r.split("x  ", 1)[1].strip() for r in rows}  # after the COMPRESSION cell ("1.23x")
    # kept whatever a prune's policies say: the pinned step, and the keyframes of it and of the latest (4, itself
    # kept as the latest, which ls does not repeat)
    expected = {1: "keyframe of 2, 4" if keyframe[4] == 1 else "keyframe of 2", 2: "pinned:best; pinned:release-1",
                3: "keyframe of 4" if keyframe[4] == 3 else "-", 4: "-"}
    assert kept == expected
    out = _strict_json(_cli("ls", tmp_path, "--json").stdout)["checkpoints"]
    assert [(c["step"], c["pins"], c["keyframe_step"]) for c in out] == [
        (1, [], 1), (2, ["best", "release-1"], 1), (3, [], keyframe[3]), (4, [], keyframe[4])]
    assert out[1]["kept"] == ["pinned:best", "pinned:release-1"] and out[3]["kept"] == []
    shown = _cli("show", tmp_path, 2)
    assert "pins      best, release-1" in shown.stdout
    assert _strict_json(_cli("show", tmp_path, 2, "--json").stdout)["pins"] == ["best", "release-1"]
    assert "pins      -" in _cli("show", tmp_path, 3).stdout
    pins = _cli("pins", tmp_path)
    assert pins.exit_code == 0, pins.output
    assert [line.split() for line in pins.stdout.strip().splitlines()] == [
        ["TAG", "STEP", "CHECKPOINT"], ["best", "2", "committed"], ["release-1", "2", "committed"]]
    assert _strict_json(_cli("pins", tmp_path, "--json").stdout)["pins"] == [
        {"tag": "best", "step": 2, "committed": True}, {"tag": "release-1", "step": 2, "committed": True}]


def test_pins_of_an_empty_vault_and_of_deleted_steps(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state(2))
        assert "no pins in" in _cli("pins", tmp_path).stdout
        mgr.pin(1, "old")
        mgr.delete(1)
        with pytest.raises(PinNotFoundError):
            mgr.step_of("old")  # a pin whose checkpoint is gone names nothing to restore
    assert "gone (unpin it)" in _cli("pins", tmp_path).stdout


# -- 7. CLI polish ---------------------------------------------------------------------------
def test_ls_shows_compression_as_logical_over_stored(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"zeros": torch.zeros(100_000)})
        info = mgr.info(1)
    row = _cli("ls", tmp_path).stdout.strip().splitlines()[1]
    expected = f"{info.logical_bytes / info.stored_bytes:.2f}x"
    assert expected in row.split() and info.logical_bytes / info.stored_bytes > 10  # zeros compress: "100.00x"-like
    shown = _cli("show", tmp_path).stdout
    assert f"compression {expected}" in shown and "of logical)" in shown


def _no_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _refusing_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: connections are refused


def test_the_cli_names_its_storage_option_flag_for_missing_credentials(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    _no_aws(monkeypatch, tmp_path)
    result = _cli("--storage-option", f"endpoint_url=http://127.0.0.1:{_refusing_port()}", "--storage-option",
                  "region_name=us-east-1", "ls", "s3://bucket/p")
    assert result.exit_code == 3
    line = result.stderr.strip()
    assert line.startswith("error: no usable S3 credentials") and "storage_options aws_access_key_id" in line
    assert "`ckptvault --storage-option KEY=VALUE COMMAND ...`" in line
    local = _cli("--storage-option", "bogus=1", "ls", tmp_path)  # a local vault's unknown option: same hint
    assert "unknown storage_options for local vaults" in local.stderr and "--storage-option KEY=VALUE" in local.stderr


def test_a_refused_connection_says_to_check_the_endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    from ckptvault.stores.s3 import S3Store

    _no_aws(monkeypatch, tmp_path)
    store = S3Store("s3://bucket/p", endpoint_url=f"http://127.0.0.1:{_refusing_port()}", aws_access_key_id="a",
                    aws_secret_access_key="b", region_name="us-east-1", check_lifecycle=False, max_attempts=1)
    try:
        with pytest.raises(RetryableStorageError, match="transient S3 failure on 'p/k'") as caught:
            store.get("k")
    finally:
        store.close()
    assert "Nothing answered at the endpoint: check the endpoint URL (storage_options endpoint_url, " \
           "AWS_ENDPOINT_URL" in str(caught.value)


def test_verbose_ls_and_verify_log_what_they_do(tmp_path: Path, cli_logging: None,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state(2))
        mgr.pin(1, "keep")
    with caplog.at_level(logging.DEBUG, logger="ckptvault"):
        assert _cli("-v", "ls", tmp_path).exit_code == 0
        info = [r.getMessage() for r in caplog.records if r.name == "ckptvault.cli"]
        assert info == [f"ls: 2 committed steps in {tmp_path}, 1 pinned"]  # -v: no per-step detail
        caplog.clear()
        assert _cli("-vv", "ls", tmp_path).exit_code == 0
        assert any(m.startswith("ls: step 2: 3 tensors in ") for m in caplog.messages)
        caplog.clear()
        assert _cli("-vv", "verify", tmp_path).exit_code == 0
        messages = [r.getMessage() for r in caplog.records if r.name == "ckptvault.cli"]
    assert messages[0].startswith(f"verify: 2 checkpoints in {tmp_path}, ") and "of distinct chunks" in messages[0]
    assert any(m.startswith("verify: read ") and "0 of 2 checkpoints damaged" in m for m in messages)
    assert "verify: step 1: ok" in messages and "verify: step 2: ok" in messages


# -- 8. presets described plainly --------------------------------------------------------------
def test_presets_and_readme_describe_the_fp16_preset_plainly() -> None:
    summary = PRESETS["fp16"]["summary"]
    assert "seed" not in summary and "fp16" in summary and "LZ4" in summary and "moments" in summary
    shown = _cli("presets", "fp16").stdout
    assert "seed" not in shown and "LZ4" in shown
    readme = (ROOT / "README.md").read_text()
    assert "seed workflow" not in readme and "seed's" not in readme
