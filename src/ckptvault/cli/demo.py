"""``ckptvault demo``: train a small GPT with checkpoints, restore in a fresh process, compare with torch.save."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

from ..demo.run import DemoOptions, DemoReport, OnStep, run_demo
from ..options import SAVERS
from .common import EXIT_DAMAGED, emit_json, group_storage_options, json_option, parse_options, progress_enabled, progress_option
from .render import human_bytes, table


@click.command("demo")
@click.option("--vault", "--store", "vault", default="./demo-vault", show_default=True, metavar="URL",
              help="Vault to checkpoint into: a path, or s3://bucket/prefix (credentials and AWS_ENDPOINT_URL from the "
                   "environment, or --storage-option).")
@click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
              help="A storage option of the --vault URL (for s3://: endpoint_url, profile, ...); repeatable.")
@click.option("--codec-rules", default=None, metavar="PRESET",
              help="Per-tensor codec preset, e.g. fp16 (the seed workflow: fp16 weights with LZ4; lossy tensors are "
                   "then checked for dtype and shape, and their measured error is reported). Default: lossless.")
@click.option("--keep-last", type=click.IntRange(min=1), default=None, metavar="N",
              help="Retention: after each save keep the N newest checkpoints (plus their keyframes) and collect garbage.")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Training time budget (ignored with --steps).")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Train exactly this many steps instead.")
@click.option("--every", type=click.IntRange(min=1), default=50, show_default=True,
              help="Checkpoint every K steps (and always at the last step).")
@click.option("--predict", is_flag=True,
              help="Store a checkpoint one optimizer step after the previous one as its difference from its "
                   "prediction from it (DeltaOptions(predict=True), keyframe_every=20, max_chain=19); with --every 1, "
                   "a checkpoint every step.")
@click.option("--saver", type=click.Choice(SAVERS), default="thread", show_default=True,
              help="Where the work after each checkpoint's host copy runs: a thread of the training process, a "
                   "saver process, or a saver process in Linux's idle scheduling class (AsyncOptions(saver=...)).")
@click.option("--codec", default="zstd", show_default=True, help="Vault codec: zstd, zstd-N, lz4, none/fast.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from the vault's latest checkpoint.")
@click.option("--fresh", is_flag=True, help="Delete the vault first (only if it is a ckptvault vault).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Restores (and torch.loads) timed in the fresh process; the median is shown.")
@json_option
@progress_option
def demo(vault: str, storage_options: tuple[str, ...], codec_rules: str | None, keep_last: int | None, minutes: float,
         steps: int | None, every: int, predict: bool, saver: str, codec: str, batch_size: int, seed: int, resume: bool,
         fresh: bool, repeat: int, as_json: bool, progress: bool | None) -> None:
    """Train a GPT, checkpoint it, check a restore.

    Trains a small GPT on the Python standard library's sources for about --minutes (or --steps) with AdamW and a warmup-cosine LR
    schedule, saving model, optimizer, scheduler, step and every RNG state
    every --every steps. Each checkpoint is also written with torch.save
    (fsync included) for comparison. Then a fresh Python process restores the
    latest checkpoint and checks it bit for bit against digests the training
    process took, and a table compares sizes and times.

    Exit status 1 if the restored state differs from the saved one.
    A vault that already holds checkpoints needs --resume or --fresh.
    """
    opts = DemoOptions(vault=vault, minutes=minutes, steps=steps, every=every, codec=codec, resume=resume,
                       fresh=fresh, batch_size=batch_size, seed=seed, repeat=repeat,
                       storage_options=_demo_storage_options(storage_options), codec_rules=codec_rules,
                       keep_last=keep_last, predict=predict, saver=saver)
    with _training_bar(progress) as on_step:
        report = run_demo(opts, on_step)
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(format_report(report))
    if not report.ok:
        raise click.exceptions.Exit(EXIT_DAMAGED)


@contextmanager
def _training_bar(progress: bool | None) -> Iterator[OnStep | None]:
    """A tqdm bar of training steps on stderr (loss in its postfix), or None when bars are off."""
    if not progress_enabled(progress):
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(desc="training", unit="step", file=sys.stderr, dynamic_ncols=True)

    def on_step(done: int, planned: int | None, loss: float) -> None:
        if bar.total != planned:
            bar.total = planned
        bar.update(done - bar.n)
        if done % 10 == 0 or done == planned:
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if done == planned:
            bar.close()  # training is over; checkpoint and check output follow

    try:
        yield on_step
    finally:
        bar.close()


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def format_report(r: DemoReport) -> str:
    """The demo's result as text: a headline, the comparison table and the bit-exact check."""
    m = r.medians()
    n = len(r.steps)
    trained = r.final_step - r.start_step
    head = (f"ckptvault demo: {r.params / 1e6:.2f}M-parameter GPT trained {trained} steps "
            f"(step {r.start_step} -> {r.final_step}) in {r.train_s:.0f} s, final loss {r.final_loss:.3f}\n"
            f"vault: {r.vault} (codec {r.codec})")
    rows: list[tuple[str, str, str]] = [
        ("checkpoints", f"{n} ({_span(r.steps)})", _plural(len(r.torch_save_s), "file") + " written"),
        ("logical bytes per checkpoint", human_bytes(r.logical_bytes), "-"),
        ("stored bytes per checkpoint", f"{human_bytes(r.stored_bytes)} ({r.stored_bytes / r.logical_bytes:.3f}x)",
         f"{human_bytes(r.torch_save_bytes)} ({r.torch_save_bytes / r.logical_bytes:.3f}x)"),
        ("added bytes per checkpoint (median)", human_bytes(m["added_bytes"]), human_bytes(r.torch_save_bytes)),
        (f"total for {_plural(n, 'checkpoint')}", human_bytes(r.vault_bytes), human_bytes(r.torch_save_bytes * n)),
        ("save: training blocked (median)", _seconds(m["save_blocked_s"]), _seconds(m["torch_save_s"])),
        ("save: until durable (median)", _seconds(m["save_s"]), _seconds(m["torch_save_s"]) + " (fsync included)"),
        ("restore time (median, fresh process)", _seconds(m["restore_s"]),
         _seconds(m["torch_load_s"]) + " (torch.load, unpickler)"),
    ]
    check = r.check
    if r.ok:
        verdict = (f"restore of step {check['step']} in a fresh process: bit-exact "
                   f"({check['entries']} tensors, arrays and values compared)")
        if check.get("lossy"):
            verdict += (f", except {check['lossy']} tensors stored lossy by --codec-rules (dtype and shape match; "
                        f"max relative L2 error {check['lossy_max_rel_l2']:.2e}, as measured at save)")
    else:
        shown = ", ".join(check.get("mismatches", [])[:5])
        verdict = (f"restore of step {check['step']} in a fresh process: MISMATCH in "
                   f"{check.get('num_mismatches')} of {check['entries']} entries: {shown}")
    return "\n".join([head, "", table(["", "ckptvault", "torch.save"], rows), "", verdict])


def _span(steps: list[int]) -> str:
    """``steps 2, 4, 6`` / ``step 6`` / ``steps 100, 200, ..., 1100``."""
    shown = ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"
    return f"step{'s' if len(steps) != 1 else ''} {shown}"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _demo_storage_options(values: tuple[str, ...]) -> dict | None:
    """The group's ``--storage-option`` values, overridden by the demo's own."""
    merged = {**(group_storage_options() or {}), **(parse_options(values, "--storage-option") or {})}
    return merged or None
