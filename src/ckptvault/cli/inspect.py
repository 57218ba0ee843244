"""Read-only commands: ``ls``, ``show`` and ``du``."""

from __future__ import annotations

import logging
import time
from typing import Any

import click

from .._format.records import Manifest
from .._maintenance.retention import RetentionInfo, decide
from .._reports.usage import VaultUsage, vault_usage
from .._save.commit import non_finite_as_str
from ..errors import VaultError
from ..info import CheckpointInfo, TensorInfo, info_from_manifest
from ..rules import any_match
from .common import EXIT_DAMAGED, emit_json, json_option, open_manager, step_argument, url_argument
from .render import (
    compact_mapping,
    dtype_label,
    human_bytes,
    iso_time,
    key_value_block,
    local_time,
    percent,
    shape_label,
    table,
)

log = logging.getLogger("ckptvault.cli")


def info_json(info: CheckpointInfo) -> dict[str, Any]:
    """The JSON object of one checkpoint in ``ls``/``show`` output (stable keys). ``ratio`` is stored / logical,
    ``compression`` logical / stored; non-finite metrics are the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict
    JSON, as in the manifest)."""
    return {
        "step": info.step, "time": info.time, "time_iso": iso_time(info.time), "logical_bytes": info.logical_bytes,
        "stored_bytes": info.stored_bytes, "added_bytes": info.added_bytes, "ratio": info.ratio,
        "compression": compression(info), "num_chunks": info.num_chunks, "num_tensors": len(info.tensors),
        "sharded": info.sharded, "num_shards": info.num_shards, "max_shards": info.max_shards,
        "metrics": non_finite_as_str(info.metrics), "metadata": info.metadata,
        "keyframe_step": info.keyframe_step, "chain": info.chain,
    }


def compression(info: CheckpointInfo) -> float:
    """Logical / stored bytes: how many times smaller the checkpoint is stored than its arrays (1.0 when empty)."""
    return info.logical_bytes / info.stored_bytes if info.stored_bytes else 1.0


def compression_label(info: CheckpointInfo) -> str:
    """``"1.16x"``: logical / stored, the COMPRESSION column of ``ls``."""
    return f"{compression(info):.2f}x"


def kept_reasons(manifests: list[Manifest], pins: dict[int, frozenset[str]]) -> dict[int, list[str]]:
    """step -> why every prune keeps it whatever its policies (``pinned:TAG``, ``keyframe of N``: a kept delta
    needs it); the latest step, always kept, is left out."""
    infos = [RetentionInfo(m.step, m.time, m.metrics, pins.get(m.step, frozenset()), m.keyframe) for m in manifests]
    return {d.step: [r for r in d.reasons if r != "latest"] for d in decide(infos, (), time.time())}


# -- ls -----------------------------------------------------------------------------
@click.command("ls", short_help="List checkpoints: time, sizes, compression, pins, metrics.")
@url_argument
@json_option
def ls(url: str, as_json: bool) -> None:
    """List the committed checkpoints of the vault at URL, oldest first.

    One row per step: commit time (local), LOGICAL bytes (the arrays
    uncompressed), STORED bytes (every chunk the checkpoint references, as
    stored), ADDED bytes (chunks this checkpoint added to the vault; the rest
    it shares with earlier ones), COMPRESSION logical/stored (2.00x: stored in
    half the bytes), KEPT (why no prune removes it, when it is not the
    latest: pinned:TAG, or keyframe of the kept deltas that need it) and its
    metrics (non-finite ones as nan, inf).

    A checkpoint whose manifest cannot be read is reported on stderr and the
    exit status is 1.

    \b
    JSON: {"url", "checkpoints": [{"step", "time", "time_iso", "logical_bytes",
    "stored_bytes", "added_bytes", "ratio" (stored/logical), "compression"
    (logical/stored), "num_chunks", "num_tensors" (arrays), "sharded" (a DCP
    checkpoint of sharded arrays), "num_shards" (records holding the arrays),
    "max_shards" (most shards of one array), "metrics", "metadata",
    "keyframe_step" (the keyframe its deltas are against; its own step for a
    keyframe), "chain" (earlier checkpoints a restore rebuilds first:
    predicted deltas), "pins", "kept"}], "damaged": [{"step", "error"}]}
    """
    with open_manager(url) as mgr:
        manifests: list[Manifest] = []
        damaged: list[dict[str, Any]] = []
        steps = mgr.steps()
        pins = mgr.pins()
        log.info("ls: %d committed steps in %s, %d pinned", len(steps), mgr.url, len(pins))
        for step in steps:
            try:
                manifests.append(mgr.vault.read_manifest(step))
            except VaultError as exc:
                log.info("ls: step %d cannot be read: %s", step, exc)
                damaged.append({"step": step, "error": str(exc)})
                continue
            m = manifests[-1]
            log.debug("ls: step %d: %d tensors in %d chunks, keyframe %d", step, len(m.tensors), len(m.chunks), m.keyframe)
        infos = [info_from_manifest(m) for m in manifests]
        kept = kept_reasons(manifests, pins)
        if as_json:
            emit_json({"url": mgr.url, "checkpoints": [
                info_json(i) | {"pins": sorted(pins.get(i.step, ())), "kept": kept[i.step]} for i in infos],
                "damaged": damaged})
        else:
            _print_ls(mgr.url, infos, damaged, kept)
    if damaged:
        raise click.exceptions.Exit(EXIT_DAMAGED)


def _print_ls(url: str, infos: list[CheckpointInfo], damaged: list[dict[str, Any]], kept: dict[int, list[str]]) -> None:
    if not infos and not damaged:
        click.echo(f"no checkpoints in {url}")
        return
    rows = [(str(i.step), local_time(i.time), human_bytes(i.logical_bytes), human_bytes(i.stored_bytes),
             human_bytes(i.added_bytes), compression_label(i), "; ".join(kept.get(i.step, ())) or "-",
             compact_mapping(i.metrics)) for i in infos]
    rows += [(str(d["step"]), "-", "-", "-", "-", "-", "-", "DAMAGED (see stderr)") for d in damaged]
    rows.sort(key=lambda r: int(r[0]))
    click.echo(table(("STEP", "TIME", "LOGICAL", "STORED", "ADDED", "COMPRESSION", "KEPT", "METRICS"), rows, "rlrrrrl"))
    for d in damaged:
        click.echo(f"warning: step {d['step']}: {d['error']}", err=True)


# -- show ---------------------------------------------------------------------------
@click.command("show", short_help="Show a checkpoint: header and tensor table.")
@url_argument
@step_argument()
@click.option("--keys", "-k", "patterns", multiple=True, metavar="PATTERN",
              help="Only tensors whose key path matches PATTERN (shell-style, e.g. 'model.*'; "
                   "a bare prefix such as 'optimizer' matches its subtree). Repeatable.")
@json_option
@click.option("--manifest", "as_manifest", is_flag=True,
              help="Print the checkpoint's manifest body instead: the JSON docs/DESIGN.md section 4 describes, "
                   "unpacked where it is stored packed (pipe it to jq).")
def show(url: str, step: int | None, patterns: tuple[str, ...], as_json: bool, as_manifest: bool) -> None:
    """Show checkpoint STEP (default: the latest): header and tensor table.

    A header with the step, time, sizes, what a restore reads (a keyframe, a
    delta against one, or predicted deltas and how many earlier checkpoints a
    restore rebuilds first), metrics, metadata and pins, then one row per
    stored array: KEY PATH, DTYPE (numpy arrays as np.<dtype>), SHAPE, LOGICAL
    bytes, STORED bytes (its share of the compressed chunks it lives in) and
    CODEC (a lossy one as LOSSY+LOSSLESS, e.g. bf16+zstd). When any listed
    tensor is stored as its residual against a prediction, PREDICTED names
    the prediction (adam-param-1: the weights from the step's moments, ...).
    When any listed tensor is stored lossily, its measured error follows: MAX
    ABS ERR, REL L2 (relative L2 error) and FLUSHED (non-zero values restored
    as zero), and notes say where an unsafe lossy codec fell back to a safer
    one. Python scalars, strings and containers are kept in the manifest's
    skeleton and are not listed.

    A DCP checkpoint (saved by every rank with ckptvault.distributed.VaultWriter)
    stores an array as the shards its ranks held: it is listed once, with the
    whole array's SHAPE, bytes summed over its shards, and SHARDS, how many
    there are and, when they cut it along one dimension, where (2 (dim 0:
    65+64): 65 rows, then 64).

    \b
    JSON: the ls fields (without "kept") plus "pins": [TAG], "tensors": [{"path", "kind", "dtype", "shape",
    "nbytes", "stored_bytes", "codec", "error", "notes", "shards", "boxes":
    [{"offsets", "shape"}], "predicted"}]; "error" is null or {"max_abs",
    "rel_l2", "flushed", "overflow", "nan"}; "boxes" is empty for an array not
    stored as shards; "predicted" is null or the prediction's name

    --manifest: the manifest body itself, as JSON (every field the vault stores for the checkpoint).
    """
    if as_manifest:
        if patterns:
            raise click.UsageError("--manifest prints the whole manifest body; leave out --keys (or use jq on it)")
        with open_manager(url) as mgr:
            emit_json(mgr.manifest(step))
        return
    with open_manager(url) as mgr:
        info = mgr.info(step)
        tags = sorted(mgr.pins().get(info.step, ()))
    tensors = [t for t in info.tensors if not patterns or any_match(t.path, patterns)]
    if as_json:
        emit_json(info_json(info) | {"pins": tags, "tensors": [_tensor_json(t) for t in tensors]})
        return
    click.echo(key_value_block(_header(info, mgr.url, tags)))
    shown = f"{len(tensors)} of {len(info.tensors)} match {' '.join(patterns)}" if patterns else str(len(info.tensors))
    click.echo(f"{'tensors':8}  {shown}")
    if tensors:
        click.echo()
        lossy = any(t.error is not None for t in tensors)  # measured error columns only where a codec was lossy
        sharded = info.sharded  # the SHARDS column only for DCP checkpoints
        predicted = any(t.predicted is not None for t in tensors)
        click.echo(table(("KEY PATH", "DTYPE", "SHAPE") + (("SHARDS",) if sharded else ())
                         + ("LOGICAL", "STORED", "CODEC") + (("PREDICTED",) if predicted else ())
                         + (("MAX ABS ERR", "REL L2", "FLUSHED") if lossy else ()), [
            (t.path, dtype_label(t.kind, t.dtype), shape_label(t.shape)) + ((shards_label(t),) if sharded else ())
            + (human_bytes(t.nbytes), human_bytes(t.stored_bytes), t.codec)
            + ((t.predicted or "-",) if predicted else ())
            + (_error_cells(t.error) if lossy else ()) for t in tensors],
            ("llll" if sharded else "lll") + "rrl" + ("l" if predicted else "") + "rrr"))
        for t in tensors:
            for note in t.notes:
                click.echo(f"note: {t.path}: {note}")


def _error_cells(error: dict[str, float] | None) -> tuple[str, str, str]:
    if error is None:
        return ("-", "-", "-")
    return (f"{error['max_abs']:.3g}", f"{error['rel_l2']:.3g}", percent(error["flushed"], 1))


def shards_label(t: TensorInfo) -> str:
    """The SHARDS cell: ``"2 (dim 0: 65+64)"`` when every shard spans the array but in one dimension (FSDP, tensor
    parallel), else the count (``"1"``: stored whole, such as a replicated tensor saved once)."""
    if len(t.boxes) < 2:
        return str(t.shards)
    cut = [d for d in range(len(t.shape)) if any(shape[d] != t.shape[d] for _offsets, shape in t.boxes)]
    if len(cut) != 1:
        return str(t.shards)
    dim = cut[0]
    return f"{t.shards} (dim {dim}: {'+'.join(str(s[dim]) for _o, s in sorted(t.boxes, key=lambda b: b[0][dim]))})"


def _tensor_json(t: TensorInfo) -> dict[str, Any]:
    return t.to_dict()


def _header(info: CheckpointInfo, url: str, tags: list[str]) -> list[tuple[str, str]]:
    return [
        ("step", str(info.step)),
        ("vault", url),
        ("time", iso_time(info.time)),
        ("logical", f"{human_bytes(info.logical_bytes)} ({info.logical_bytes} bytes)"),
        ("stored", f"{human_bytes(info.stored_bytes)} in {info.num_chunks} chunks, compression {compression_label(info)} "
                   f"({percent(info.stored_bytes, info.logical_bytes)} of logical)"),
        ("added", f"{human_bytes(info.added_bytes)} new to the vault with this checkpoint"),
        ("restore", _restore_label(info)),
        *([("layout", f"sharded (a DCP checkpoint): {len(info.tensors)} arrays stored as {info.num_shards} shards, "
                      f"at most {info.max_shards} per array")] if info.sharded else []),
        ("metrics", compact_mapping(info.metrics) or "-"),
        ("metadata", compact_mapping(info.metadata) or "-"),
        ("pins", ", ".join(tags) or "-"),
    ]


def _restore_label(info: CheckpointInfo) -> str:
    """What a restore of the checkpoint reads: the header's ``restore`` line."""
    if info.chain:
        earlier = "checkpoint" if info.chain == 1 else f"{info.chain} checkpoints"
        return (f"predicted from step {info.step - 1}: rebuilds {earlier} first, from keyframe "
                f"{info.keyframe_step}")
    if info.keyframe_step == info.step:
        return "a keyframe (no earlier checkpoint needed)"
    return f"deltas against keyframe {info.keyframe_step}"


# -- du -----------------------------------------------------------------------------
@click.command("du", short_help="Logical vs stored bytes; dedup and compression savings.")
@url_argument
@json_option
def du(url: str, as_json: bool) -> None:
    """Show where the bytes of the vault at URL go.

    LOGICAL is the sum over every checkpoint of its arrays' bytes (what
    separate uncompressed copies would take). Identical chunks are stored once
    (dedup savings = logical - unique raw chunk bytes) and compressed
    (compression savings = unique raw - stored). PHYSICAL lists every object in
    the store: chunk objects, manifests and the vault descriptor. Chunks no
    checkpoint references (left by `ckptvault rm` or by interrupted saves) are
    reclaimed by `ckptvault gc`. Reads manifests only, never chunk data.

    \b
    JSON: {"url", "checkpoints", "logical_bytes", "unique_raw_bytes",
    "stored_bytes", "physical_bytes", "dedup_saved_bytes",
    "compression_saved_bytes", "ratio", "objects": {"chunks", "manifests",
    "other"}, "unreferenced_chunks", "missing_chunks",
    "steps": [{"step", "logical_bytes", "stored_bytes", "added_bytes"}],
    "damaged": [{"step", "error"}]}; object tallies are {"count", "bytes"}.
    """
    with open_manager(url) as mgr:
        usage = vault_usage(mgr.vault)
    if as_json:
        emit_json(_usage_json(mgr.url, usage))
    else:
        _print_du(mgr.url, usage)
    if usage.damaged:
        raise click.exceptions.Exit(EXIT_DAMAGED)


def _usage_json(url: str, u: VaultUsage) -> dict[str, Any]:
    return {
        "url": url, "checkpoints": len(u.steps), "logical_bytes": u.logical_bytes, "unique_raw_bytes": u.unique_raw_bytes,
        "stored_bytes": u.referenced.bytes, "physical_bytes": u.physical_bytes, "dedup_saved_bytes": u.dedup_saved_bytes,
        "compression_saved_bytes": u.compression_saved_bytes, "ratio": u.ratio,
        "objects": {"chunks": vars(u.chunks), "manifests": vars(u.manifests), "other": vars(u.other)},
        "unreferenced_chunks": vars(u.unreferenced), "missing_chunks": u.missing,
        "steps": [vars(s) for s in u.steps], "damaged": [{"step": s, "error": e} for s, e in sorted(u.damaged.items())],
    }


def _print_du(url: str, u: VaultUsage) -> None:
    span = f" (steps {u.steps[0].step}..{u.steps[-1].step})" if u.steps else ""
    lines = [
        ("vault", url),
        ("checkpoints", f"{len(u.steps)}{span}"),
        ("logical", f"{human_bytes(u.logical_bytes):>10}  sum over checkpoints"),
        ("unique raw", f"{human_bytes(u.unique_raw_bytes):>10}  distinct chunks referenced, uncompressed"),
        ("stored", f"{human_bytes(u.referenced.bytes):>10}  those chunks as stored ({u.referenced.count} objects)"),
        ("physical", f"{human_bytes(u.physical_bytes):>10}  whole store: {u.chunks.count} chunks "
                     f"{human_bytes(u.chunks.bytes)}, {u.manifests.count} manifests {human_bytes(u.manifests.bytes)}, "
                     f"other {human_bytes(u.other.bytes)}"),
        ("unreferenced", f"{human_bytes(u.unreferenced.bytes):>10}  {u.unreferenced.count} chunks no checkpoint uses "
                         "(reclaimed by `ckptvault gc`)"),
        ("dedup saves", f"{human_bytes(u.dedup_saved_bytes):>10}  {percent(u.dedup_saved_bytes, u.logical_bytes)} of logical"),
        ("compression", f"{human_bytes(u.compression_saved_bytes):>10}  "
                        f"{percent(u.compression_saved_bytes, u.unique_raw_bytes)} of unique raw"),
        ("ratio", f"{u.ratio:>10.3f}  physical / logical"),
    ]
    click.echo(key_value_block(lines))
    if u.missing:
        click.echo(f"warning: {u.missing} referenced chunks are missing from the store; run `ckptvault verify`", err=True)
    for step, error in sorted(u.damaged.items()):
        click.echo(f"warning: step {step} left out: {error}", err=True)
    if u.steps:
        click.echo()
        click.echo(table(("STEP", "LOGICAL", "STORED", "ADDED"), [
            (str(s.step), human_bytes(s.logical_bytes), human_bytes(s.stored_bytes), human_bytes(s.added_bytes))
            for s in u.steps], "rrrr"))
