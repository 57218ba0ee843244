"""``ckptvault plot`` and the data it draws (``ckptvault._reports.plot_data``), on a vault a real training run wrote.

The vault: a small MLP trained with AdamW, saved every step with its loss (and other metrics), keyframes every 3
checkpoints (steps 1 and 4), step 5 with the model in bf16 (lossy) and step 3 pinned. Most commands run in-process
through click's runner; the missing-matplotlib case runs in a fresh interpreter where ``import matplotlib`` fails.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptvault
from ckptvault import DeltaOptions
from ckptvault._format.manifest import manifest_key
from ckptvault._reports.plot_data import StorageSeries, storage_series
from ckptvault._vault import Vault
from ckptvault.cli import main
from ckptvault.cli.plot import BAR_WIDTH, bar, plot, sparkline, text_chart
from ckptvault.cli.plot_draw import comparison, figure_size_px, load_matplotlib
from ckptvault.errors import InvalidArgumentError, VaultNotFoundError

STEPS = (1, 2, 3, 4, 5, 6)
KEYFRAMES = (1, 4)
LOSSY_STEP, PINNED_STEP = 5, 3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DELTA = DeltaOptions(keyframe_every=3, keyframe_growth=100.0)  # the cadence alone decides: keyframes at 1 and 4


def _save_run(root: Path) -> dict[int, dict[str, Any]]:
    """Train and save STEPS into ``root``; return the metrics each step was saved with."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y, frozen = torch.randn(64, 16), torch.randn(64, 4), torch.randn(20_000)
    saved: dict[int, dict[str, Any]] = {}
    for step in STEPS:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics: dict[str, Any] = {"loss": loss.item(), "lr": 1e-2, "phase": "warmup", "finite": True}
        if step % 2 == 0:
            metrics["val_loss"] = float("nan") if step == 6 else loss.item() + 0.1
        rules = {"model.*": "bf16"} if step == LOSSY_STEP else None
        with ckptvault.CheckpointManager(root, delta=DELTA, async_save=False, codec_rules=rules) as mgr:
            with pytest.warns(RuntimeWarning, match="not a finite number") if step == 6 else nullcontext():
                mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "frozen": frozen},
                         metrics=metrics)
            saved[step] = metrics
    with ckptvault.CheckpointManager(root) as mgr:
        mgr.pin(PINNED_STEP, "best")
    return saved


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("plot") / "vault"
    return root, _save_run(root)


@pytest.fixture
def vault(run: tuple[Path, dict[int, dict[str, Any]]]) -> Path:
    return run[0]


@pytest.fixture
def series(vault: Path) -> StorageSeries:
    return storage_series(Vault(vault))


def cli(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_cli_error(result: Result, code: int, *fragments: str) -> None:
    """One ``error: ...`` line on stderr with ``fragments``, nothing on stdout, exit status ``code``."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    assert result.stdout == ""


# -- the data ----------------------------------------------------------------------------
def test_rows_hold_what_each_checkpoint_recorded(run: tuple[Path, dict[int, dict[str, Any]]], series: StorageSeries) -> None:
    root, saved = run
    rows = series.rows
    assert [r.step for r in rows] == list(STEPS) and series.damaged == {}
    assert [r.step for r in rows if r.keyframe] == list(KEYFRAMES)
    assert [r.keyframe_step for r in rows] == [1, 1, 1, 4, 4, 4]
    assert {r.step: r.lossy for r in rows if r.lossy} == {LOSSY_STEP: ("bf16",)}
    assert {r.step: r.pins for r in rows if r.pins} == {PINNED_STEP: ("best",)}
    with ckptvault.CheckpointManager(root) as mgr:
        for r in rows:
            info = mgr.info(r.step)
            assert (r.logical, r.stored, r.added, r.time) == (info.logical_bytes, info.stored_bytes, info.added_bytes,
                                                              info.time)
    assert [r.metrics["loss"] for r in rows] == [saved[s]["loss"] for s in STEPS]
    assert all("phase" not in r.metrics and "finite" not in r.metrics for r in rows)  # a string and a bool
    assert [r.metrics.get("val_loss") for r in rows[:4]] == [None, saved[2]["val_loss"], None, saved[4]["val_loss"]]
    assert math.isnan(rows[5].metrics["val_loss"])
    assert series.metric_names == ["loss", "lr", "val_loss"]


def test_cumulative_sizes_are_running_sums_of_added_and_logical_bytes(series: StorageSeries) -> None:
    rows = series.rows
    assert [r.cumulative_stored for r in rows] == list(itertools.accumulate(r.added for r in rows))
    assert [r.cumulative_torch for r in rows] == list(itertools.accumulate(r.logical for r in rows))
    assert rows[1].added < rows[0].added / 2  # a delta adds far less than its keyframe: the vault grows slower
    assert rows[-1].cumulative_stored < rows[-1].cumulative_torch / 2


def test_a_deleted_checkpoint_is_in_no_row_and_no_sum(vault: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(vault, tmp_path / "v"))
    with ckptvault.CheckpointManager(copy) as mgr:
        mgr.delete(2)
    rows = storage_series(Vault(copy)).rows
    assert [r.step for r in rows] == [1, 3, 4, 5, 6]
    assert rows[-1].cumulative_stored == sum(r.added for r in rows)


def test_metrics_are_chosen_by_name_and_an_unknown_one_is_refused(series: StorageSeries) -> None:
    assert series.select_metrics(()) == ["loss", "lr", "val_loss"]
    assert series.select_metrics(("val_loss", "loss", "val_loss")) == ["val_loss", "loss"]
    with pytest.raises(InvalidArgumentError, match=r"recorded a numeric metric 'phase'; numeric metrics: loss, lr, val_loss"):
        series.select_metrics(("phase",))


def test_an_empty_vault_has_nothing_to_plot(tmp_path: Path) -> None:
    with ckptvault.CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
        mgr.delete(1)
    empty = storage_series(Vault(tmp_path / "v"))
    assert empty.rows == () and empty.damaged == {}
    with pytest.raises(VaultNotFoundError, match="has no committed checkpoint to plot"):
        empty.require_checkpoints()
    assert_cli_error(cli("plot", tmp_path / "v"), 2, "has no committed checkpoint to plot")


# -- the PNG ------------------------------------------------------------------------------
def test_plot_writes_a_png_with_a_panel_per_metric(vault: Path, tmp_path: Path) -> None:
    import matplotlib.image

    png = tmp_path / "vault.png"
    result = cli("plot", vault, "-o", png)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {png}: 6 checkpoints, 3 metric panels\n"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    width, height = figure_size_px(3)
    assert matplotlib.image.imread(png).shape == (height, width, 4)


def test_json_gives_the_series_and_names_the_png(vault: Path, series: StorageSeries, tmp_path: Path) -> None:
    import matplotlib.image

    png = tmp_path / "loss.png"
    result = cli("plot", vault, "--metric", "loss", "-o", png, "--json")
    assert result.exit_code == 0, result.output

    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")

    out = json.loads(result.stdout, parse_constant=refuse)
    assert out["url"] == series.url and out["png"] == str(png) and out["metrics"] == ["loss"] and out["damaged"] == []
    assert [c["step"] for c in out["checkpoints"]] == list(STEPS)
    for c, r in zip(out["checkpoints"], series.rows):
        assert (c["added_bytes"], c["cumulative_stored_bytes"], c["cumulative_torch_bytes"]) == (
            r.added, r.cumulative_stored, r.cumulative_torch)
        assert (c["keyframe"], c["lossy"], c["pins"], c["metrics"]) == (
            r.keyframe, list(r.lossy), list(r.pins), {"loss": r.metrics["loss"]})
    width, height = figure_size_px(1)
    assert matplotlib.image.imread(png).shape == (height, width, 4)


def test_json_without_output_keeps_non_finite_metrics_strict(run: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    root, saved = run
    out = json.loads(cli("plot", root, "--json", "-m", "val_loss").stdout)
    assert out["png"] is None and out["metrics"] == ["val_loss"]
    assert [c["metrics"] for c in out["checkpoints"]] == [
        {}, {"val_loss": saved[2]["val_loss"]}, {}, {"val_loss": saved[4]["val_loss"]}, {}, {"val_loss": "nan"}]


def test_output_must_be_a_png_in_a_directory(vault: Path, tmp_path: Path) -> None:
    result = cli("plot", vault, "-o", tmp_path / "chart.jpg")
    assert result.exit_code == 2 and "does not end in .png" in result.stderr and not (tmp_path / "chart.jpg").exists()
    target = tmp_path / "no-such-dir" / "chart.png"
    with pytest.raises(InvalidArgumentError, match=f"cannot write the chart to {target}: {target.parent} is not a dir"):
        plot.main([str(vault), "-o", str(target)], standalone_mode=False)
    assert_cli_error(cli("plot", vault, "-o", target), 2, "cannot write the chart to", "is not a directory")


def test_a_png_that_cannot_be_written_is_a_usage_error(vault: Path, tmp_path: Path) -> None:
    link = tmp_path / "chart.png"
    link.symlink_to(tmp_path / "gone" / "chart.png")  # its directory exists; opening it fails when the chart is saved
    assert_cli_error(cli("plot", vault, "-o", link), 2, f"cannot write the chart to {link}: No such file or directory")


# -- the terminal chart -----------------------------------------------------------------------
def test_terminal_chart_lists_every_step_with_its_tags_bar_and_metrics(vault: Path, series: StorageSeries) -> None:
    result = cli("plot", vault)
    assert result.exit_code == 0, result.output
    assert result.stdout == text_chart(series, series.metric_names) + "\n"
    lines = result.stdout.splitlines()
    assert lines[0] == f"{series.url}: 6 checkpoints, steps 1..6"
    assert lines[1].startswith("vault ") and "as torch.save files" in lines[1] and "x smaller" in lines[1]
    header = next(i for i, line in enumerate(lines) if line.startswith("STEP"))
    assert all(w in lines[header] for w in ("LOGICAL", "STORED", "ADDED", "VAULT", "TORCH", "TAGS", "loss", "val_loss"))
    table = lines[header + 1: header + 1 + len(STEPS)]
    assert [int(line.split()[0]) for line in table] == list(STEPS)
    assert "keyframe" in table[0] and "keyframe" in table[3] and "keyframe" not in table[1]
    assert "lossy bf16" in table[4] and "pinned best" in table[2]
    assert "█" in table[-1] and "░" in table[-1]
    sparks = {line.split()[0]: line for line in lines if line.startswith(("loss ", "lr ", "val_loss "))}
    assert set(sparks) == {"loss", "lr", "val_loss"} and "min " in sparks["loss"]
    assert "TAGS: keyframe" in result.stdout and "pinned TAGS" in result.stdout and "lossy CODECS" in result.stdout


def test_terminal_chart_needs_no_matplotlib(vault: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = cli("plot", vault, "-m", "loss")
    assert result.exit_code == 0, result.output
    assert "STEP" in result.stdout and "loss" in result.stdout and "val_loss" not in result.stdout


def test_bar_and_sparkline_scale_to_their_data() -> None:
    assert bar(50, 100, 100, width=8) == "████░░░░" and bar(100, 100, 100, width=8) == "█" * 8
    assert bar(10, 10, 100, width=8) == "▊       "  # 6.4 eighths of a cell, no shade: torch.save's is as long
    assert bar(2, 50, 100, width=8) == "▏░░░    "
    assert len(bar(3, 7, 7)) == BAR_WIDTH
    assert sparkline([1.0, 2.0, 3.0]) == "▁▅█" and sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([1.0, math.nan, 3.0]) == "▁ █" and sparkline([math.nan]) == " "
    assert sparkline([float(i) for i in range(200)], width=10) == "▁▂▃▃▄▅▆▆▇█"
    assert comparison(100, 400) == "vault 100 B vs 400 B as torch.save files, 4.0x smaller"
    assert comparison(481, 400).endswith(", 1.2x larger")  # a tiny random state stores more than its arrays


# -- errors ---------------------------------------------------------------------------------
def test_missing_matplotlib_is_a_typed_error_naming_the_extra(vault: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    png = tmp_path / "x.png"
    wrapper = tmp_path / "no_matplotlib.py"  # the CLI in a fresh interpreter where matplotlib cannot be imported
    wrapper.write_text("import sys\nsys.modules['matplotlib'] = None\nfrom ckptvault.cli import main\nmain()\n")
    proc = subprocess.run([sys.executable, str(wrapper), "plot", str(vault), "-o", str(png)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: plot -o needs matplotlib, which is not installed: pip install "
                                   "'ckptvault[plot]', or leave out -o to print the chart in the terminal")
    assert proc.stdout == "" and not png.exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(InvalidArgumentError, match=r"pip install 'ckptvault\[plot\]'") as caught:
        load_matplotlib()
    assert isinstance(caught.value, ValueError)


def test_no_vault_at_the_url_is_a_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    assert_cli_error(cli("plot", missing), 2, "no ckptvault vault at", str(missing))
    assert not missing.exists()
    with pytest.raises(VaultNotFoundError, match="no ckptvault vault at"):
        plot.main([str(missing)], standalone_mode=False)


def test_unknown_metric_is_a_usage_error(vault: Path) -> None:
    assert_cli_error(cli("plot", vault, "-m", "accuracy"), 2, "numeric metric 'accuracy'", "loss, lr, val_loss")


def test_a_damaged_manifest_is_reported_and_left_out(vault: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(vault, tmp_path / "v"))
    path = copy / manifest_key(2)
    path.write_bytes(path.read_bytes()[:-20])  # truncated: fails its checksum
    series = storage_series(Vault(copy))
    assert [r.step for r in series.rows] == [1, 3, 4, 5, 6] and list(series.damaged) == [2]
    result = cli("plot", copy)
    assert result.exit_code == 1
    assert result.stdout.splitlines()[0].endswith("5 checkpoints, steps 1..6")
    assert result.stderr.startswith("warning: step 2 left out: ")
    out = json.loads(cli("plot", copy, "--json").stdout)
    assert [d["step"] for d in out["damaged"]] == [2] and len(out["checkpoints"]) == 5


def test_with_every_manifest_damaged_nothing_is_drawn(vault: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(vault, tmp_path / "v"))
    for step in STEPS:
        (copy / manifest_key(step)).write_bytes(b"{}")
    png = tmp_path / "x.png"
    result = cli("plot", copy, "-o", png, "--json")
    assert result.exit_code == 1 and not png.exists()
    out = json.loads(result.stdout)
    assert out["png"] is None and out["checkpoints"] == [] and [d["step"] for d in out["damaged"]] == list(STEPS)
    assert len(result.stderr.splitlines()) == len(STEPS)
    text = cli("plot", copy)
    assert text.exit_code == 1 and text.stdout.startswith("no readable checkpoints in ")
