"""Build the hostile-vault corpus: adversarial vault files, each one edit of a small pristine vault.

What is committed under ``tests/hostile/``:

* ``base/``: a pristine vault holding one checkpoint (step 3) of :func:`base_state`, saved with
  ``chunk_size=65536`` and the default codec. Its three chunk objects: chunk 0 packs ``model.w``,
  ``model.b`` and ``np`` (byte planes + zstd), chunk 1 holds ``model.big`` (byte planes + zstd), chunk 2
  holds ``model.mask`` (raw).
* ``cases/<name>/<key>``: for each case, the one object that replaces the base object at ``<key>``
  (``vault.json``, ``manifests/00000000000000000003.json`` or a chunk object). A case is the base
  vault with that file swapped in.
* ``cases.json``: per case, what was done, the key replaced, and for every command to run against it
  (restore, verify, ls, show, gc --dry-run, cp; library calls and ``ckptvault`` commands) what must
  happen: which error class and which message fragments (the file and the field), or that it works.
  ``tests/test_hostile_corpus.py`` runs every one of them.

Edited manifests are re-wrapped with a valid BLAKE3 checksum (anyone can compute it), so every
manifest case gets past the checksum and tests what a reader does with the body. Edited chunk
objects keep their name; their fixed prefix carries the new header length.

Regenerate (deterministic: the same bytes for the same ckptvault, torch and zstandard versions; the
fields that vary between saves, ``time``, ``writer`` and ``created``, are pinned)::

    .venv/bin/python tests/hostile/make_corpus.py

It saves :func:`base_state` into a fresh temporary vault, pins those fields, applies every case of
:func:`cases`, then replaces ``base/``, ``cases/`` and ``cases.json``. Add a case by adding an entry
to :func:`cases` and regenerating; commit the whole ``tests/hostile/`` folder.

Expectations follow the conventions of the hardened readers: a damaged or hostile manifest or
``vault.json`` is a ``CorruptManifestError`` whose message names the file and the field path
(``tensors[0].shape``, ``chunks[0].id``, ``chunk_size``); a version above 1 or an unknown required
feature is a ``FormatVersionError``; a damaged chunk object is a ``CorruptChunkError`` naming the chunk
id and the header field (``raw``, ``base``, ``codec``); a ``ckptvault`` command prints one
``error: ...`` line and exits 1 for damage, 3 for other library errors.
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BASE_DIR = HERE / "base"
CASES_DIR = HERE / "cases"
CASES_JSON = HERE / "cases.json"

STEP = 3
CHUNK_SIZE = 64 << 10
MANIFEST_KEY = f"manifests/{STEP:020d}.json"
DESCRIPTOR_KEY = "vault.json"
PINNED_TIME = 1700000000.0
PINNED_WRITER = "ckptvault hostile corpus"
PINNED_CREATED = 1700000000.0
#: a file the tests place next to the vault copy (``<tmp>/bait``): where ``../bait`` ids lead from ``chunks/``
BAIT_NAME = "bait"
TRAVERSAL_ID = "../" + BAIT_NAME  # chunk_key() makes chunks/../../bait of it: the vault's parent folder

#: the commands every case lists, and what each runs (tests/test_hostile_corpus.py implements them)
COMMANDS = {
    "restore": "CheckpointManager(vault).restore(3)",
    "restore_keys_big": "CheckpointManager(vault).restore(3, keys='model.big') (chunk 1 only)",
    "restore_keys_w": "CheckpointManager(vault).restore(3, keys='model.w') (chunk 0 only)",
    "restore_into": "CheckpointManager(vault).restore(3, into=<base_state() with every array zeroed>)",
    "info": "CheckpointManager(vault).steps(), then .info(step) of each (what `ckptvault ls` reads)",
    "verify": "CheckpointManager(vault).verify(3): a VerifyReport",
    "gc_plan": "plan_gc(Vault(vault)) (what `ckptvault gc --dry-run` computes)",
    "cli_verify": "ckptvault verify VAULT",
    "cli_ls": "ckptvault ls VAULT",
    "cli_show": "ckptvault show VAULT 3",
    "cli_gc": "ckptvault gc VAULT --dry-run",
    "cli_cp": "ckptvault cp VAULT DST (DST: a fresh folder beside the vault)",
    "cli_cp_verify": "ckptvault cp --verify VAULT DST",
}

#: what "expect" means in cases.json
EXPECTATIONS = {
    "ok": "works: no exception (CLI: exit 0, no traceback); a restore equals the base state (or its keys= part)",
    "raises": "raises one of 'errors' (isinstance) whose message holds every fragment (CLI: exactly one stderr line "
              "'error: ...' holding them, no traceback, nothing on stdout, an exit status in 'exit')",
    "reports": "verify returns a report that is not ok, whose problems for the step hold every fragment; CLI verify "
               "and ls: exit 1, no traceback, the fragments in their output",
    "raises_or_reports": "either of 'raises' and 'reports'",
}


def base_state() -> dict[str, Any]:
    """The state of the base vault's only checkpoint: tiny, fixed, and compressible (so chunks 0 and 1 are coded)."""
    return {
        "model": {
            "w": (torch.arange(128, dtype=torch.float32) / 7).reshape(8, 16),  # 512 bytes, record 0
            "b": torch.linspace(-1.0, 1.0, 16),  # record 1
            "big": torch.linspace(0.0, 1.0, 4096),  # 16 KiB >= chunk_size / 4: a chunk of its own, record 2
            "mask": torch.tensor([True, False, True]),  # record 3
        },
        "np": np.arange(6, dtype="<i4"),  # record 4
        "step": STEP,
        "name": "hostile",
        "lr": 0.5,
    }


def zeroed(state: Any) -> Any:
    """A copy of ``state`` with every array zeroed (the ``into=`` target of restore_into)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, np.ndarray):
        return np.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeroed(v) for k, v in state.items()}
    return state


# -- byte-level helpers ----------------------------------------------------------------------------

_CHUNK_PREFIX = struct.Struct("<4sBBH")


def wrap_manifest(body: bytes) -> bytes:
    """A manifest file around ``body`` (raw JSON text) with a valid checksum, as _format/manifest.py writes it."""
    return b'{"blake3":"' + blake3.blake3(body).hexdigest().encode() + b'","manifest":' + body + b"}"


def manifest_body_bytes(data: bytes) -> bytes:
    """The body of a manifest file (everything between the 88-byte prefix and the final ``}``)."""
    return data[88:-1]


def encode_body(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def split_chunk(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(fixed prefix, header JSON, payload) of a chunk object."""
    head_len = _CHUNK_PREFIX.unpack_from(data)[3]
    return data[: _CHUNK_PREFIX.size], data[_CHUNK_PREFIX.size : _CHUNK_PREFIX.size + head_len], data[
        _CHUNK_PREFIX.size + head_len :]


def join_chunk(header: bytes, payload: bytes, version: int = 1, length: int | None = None) -> bytes:
    """A chunk object: prefix (magic, ``version``, header length, or ``length`` to lie about it), header, payload."""
    return _CHUNK_PREFIX.pack(b"CKVC", version, 0, len(header) if length is None else length) + header + payload


def header_json(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def chunk_key(cid: str) -> str:
    return f"chunks/{cid[:2]}/{cid}"


# -- the base vault ----------------------------------------------------------------------------------

def build_base(target: Path) -> None:
    """Save :func:`base_state` into a new vault at ``target`` and pin the fields that vary between saves."""
    import ckptvault
    from ckptvault._format.manifest import decode_manifest, encode_manifest

    with ckptvault.CheckpointManager(target, chunk_size=CHUNK_SIZE, async_save=False) as mgr:
        mgr.save(STEP, base_state(), metrics={"loss": 1.5}, metadata={"run": "hostile"})
    mpath = target / MANIFEST_KEY
    body = decode_manifest(mpath.read_bytes(), "base")
    body.update(time=PINNED_TIME, writer=PINNED_WRITER)
    mpath.write_bytes(encode_manifest(body))
    dpath = target / DESCRIPTOR_KEY
    desc = json.loads(dpath.read_bytes())
    desc["created"] = PINNED_CREATED
    dpath.write_bytes(json.dumps(desc, indent=1).encode())
    shutil.rmtree(target / "tmp", ignore_errors=True)  # the local store's temporary folder: empty


class Base:
    """The base vault's files, parsed, for building cases."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.manifest_file = (root / MANIFEST_KEY).read_bytes()
        self.manifest = json.loads(manifest_body_bytes(self.manifest_file))
        self.descriptor = json.loads((root / DESCRIPTOR_KEY).read_bytes())
        self.chunk_ids = [c["id"] for c in self.manifest["chunks"]]

    def chunk(self, index: int) -> bytes:
        return (self.root / chunk_key(self.chunk_ids[index])).read_bytes()

    def chunk_header(self, index: int) -> dict[str, Any]:
        return json.loads(split_chunk(self.chunk(index))[1])

    def body(self) -> dict[str, Any]:
        """A deep copy of the manifest body, to edit."""
        return copy.deepcopy(self.manifest)


# -- cases ---------------------------------------------------------------------------------------------

Fragment = str | list[str]  # a list: any one of these strings


CHUNK0 = "<chunk 0>"  # the key of chunk cases, resolved to chunks/<id[:2]>/<id> of the base's chunk 0


@dataclass
class Case:
    """One hostile edit: ``make`` returns the bytes that replace the base object at ``key``; ``commands`` returns
    (given the base vault) what each command must do."""

    name: str
    what: str
    key: str
    make: Callable[[Base], bytes]
    commands: Callable[[Base], list[dict[str, Any]]]


_DAMAGE = ("CorruptManifestError", "CorruptChunkError", "CorruptDataError")


def exit_codes(errors: list[str]) -> list[int]:
    """The exit statuses a ckptvault command may end with for these error classes (cli/common.py)."""
    usage = {"VaultNotFoundError", "StepNotFoundError", "StepExistsError", "InvalidArgumentError", "KeyMismatchError",
             "PickleNotAllowedError"}
    return sorted({1 if e in _DAMAGE else 2 if e in usage else 3 for e in errors})


def raises(command: str, errors: list[str], fragments: list[Fragment], **extra: Any) -> dict[str, Any]:
    spec = {"id": command, "expect": "raises", "errors": errors, "fragments": fragments, **extra}
    if command.startswith("cli_"):
        spec["exit"] = exit_codes(errors)
    return spec


def reports(command: str, fragments: list[Fragment], errors: list[str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"id": command, "expect": "reports", "fragments": fragments}
    if errors is not None:  # raises_or_reports
        spec.update(expect="raises_or_reports", errors=errors)
        if command.startswith("cli_"):
            spec["exit"] = sorted({1, *exit_codes(errors)})
    elif command.startswith("cli_"):
        spec["exit"] = [1]
    return spec


def ok(command: str) -> dict[str, Any]:
    return {"id": command, "expect": "ok"}


def vault_commands(errors: list[str], fragments: list[Fragment]) -> list[dict[str, Any]]:
    """A damaged vault.json: every command fails, since every one reads the descriptor first."""
    out = [raises(c, errors, fragments) for c in ("restore", "restore_keys_big", "restore_into", "info", "gc_plan",
                                                  "cli_verify", "cli_ls", "cli_show", "cli_gc")]
    out.insert(4, reports("verify", fragments, errors))  # the library's verify may report it per step instead
    out.append(raises("cli_cp", errors, fragments, commits_nothing=True))
    return out


def manifest_commands(errors: list[str], fragments: list[Fragment]) -> list[dict[str, Any]]:
    """A damaged manifest: every reader of step 3 fails; verify and ls report the step; gc refuses."""
    fragments = [MANIFEST_KEY, *fragments]
    return [
        raises("restore", errors, fragments),
        raises("restore_keys_big", errors, fragments),
        raises("restore_into", errors, fragments),
        raises("info", errors, fragments),
        reports("verify", fragments),
        raises("gc_plan", ["MaintenanceRefusedError"], fragments),
        reports("cli_verify", fragments),
        reports("cli_ls", fragments),
        raises("cli_show", errors, fragments),
        raises("cli_gc", ["MaintenanceRefusedError"], fragments),
        raises("cli_cp", errors, fragments, commits_nothing=True),
    ]


def chunk_commands(cid: str, errors: list[str], fragments: list[Fragment]) -> list[dict[str, Any]]:
    """A damaged chunk 0 (model.w, model.b, np): what reads it fails, naming it; what does not read it works."""
    fragments = [cid, *fragments]
    newer = "FormatVersionError" in errors  # verify may stop at a chunk of a newer format instead of reporting it
    return [
        raises("restore", errors, fragments),
        ok("restore_keys_big"),
        raises("restore_keys_w", errors, fragments),
        raises("restore_into", errors, fragments),
        ok("info"),
        reports("verify", fragments, errors if newer else None),
        ok("gc_plan"),
        reports("cli_verify", fragments, errors if newer else None),
        ok("cli_ls"),
        ok("cli_show"),
        ok("cli_gc"),
        ok("cli_cp"),  # copies chunk objects byte for byte, without decoding them
        raises("cli_cp_verify", ["CorruptDataError", *errors], fragments),
    ]


def cases() -> list[Case]:
    out: list[Case] = []
    CME, FVE = ("CorruptManifestError",), ("FormatVersionError",)

    # -- vault.json ---------------------------------------------------------------------------------
    def vault_case(name: str, what: str, edit: Callable[[dict[str, Any]], Any] | None = None, raw: bytes | None = None,
                   errors: Sequence[str] = CME, fields: Sequence[Fragment] = ()) -> None:
        def make(base: Base) -> bytes:
            if raw is not None:
                return raw
            desc = copy.deepcopy(base.descriptor)
            result = edit(desc)
            return json.dumps(desc if result is None else result, indent=1).encode()
        out.append(Case(name, what, DESCRIPTOR_KEY, make,
                        lambda base: vault_commands(list(errors), [DESCRIPTOR_KEY, *fields])))

    def set_field(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda d: d.__setitem__(name, value)

    vault_case("vault_chunk_size_negative", "vault.json: chunk_size -65536", set_field("chunk_size", -65536),
               fields=["chunk_size"])
    vault_case("vault_chunk_size_1000", "vault.json: chunk_size 1000 (below the 64 KiB minimum)",
               set_field("chunk_size", 1000), fields=["chunk_size"])
    vault_case("vault_chunk_size_2pow50", "vault.json: chunk_size 2**50 (above the 256 MiB maximum)",
               set_field("chunk_size", 2**50), fields=["chunk_size"])
    vault_case("vault_chunk_size_65537", "vault.json: chunk_size 65537 (not a multiple of 64)",
               set_field("chunk_size", 65537), fields=["chunk_size"])
    vault_case("vault_chunk_size_string", "vault.json: chunk_size \"65536\" (a string)",
               set_field("chunk_size", "65536"), fields=["chunk_size"])
    vault_case("vault_hash_sha256", "vault.json: hash \"sha256\" (format 1 names chunks by BLAKE3 only)",
               set_field("hash", "sha256"), fields=["hash"])
    vault_case("vault_version_abc", "vault.json: version \"abc\"", set_field("version", "abc"), fields=["version"])
    vault_case("vault_version_list", "vault.json: version [1]", set_field("version", [1]), fields=["version"])
    vault_case("vault_version_true", "vault.json: version true (a bool is not a version)", set_field("version", True),
               fields=["version"])
    vault_case("vault_version_float", "vault.json: version 1.5", set_field("version", 1.5), fields=["version"])
    vault_case("vault_version_2", "vault.json: version 2 (a newer format)", set_field("version", 2), errors=FVE,
               fields=["version"])
    vault_case("vault_not_an_object", "vault.json: a JSON list instead of an object", lambda d: [d])
    vault_case("vault_missing_format", "vault.json: no \"format\" field", lambda d: d.__delitem__("format"),
               fields=["format"])
    vault_case("vault_not_json", "vault.json: bytes that are not UTF-8 JSON", raw=b"\xff\xfe{\"format\"")
    vault_case("vault_nested_2000", "vault.json: a field holding lists nested 2,000 deep (json RecursionError)",
               raw=b'{"format":"ckptvault.vault","version":1,"chunk_size":65536,"codec":"zstd","hash":"blake3","x":'
                   + b"[" * 2_000 + b"]" * 2_000 + b"}")

    # -- manifests --------------------------------------------------------------------------------------
    def manifest_case(name: str, what: str, edit: Callable[[dict[str, Any]], Any] | None = None,
                      text: Callable[[Base], bytes] | None = None, errors: Sequence[str] = CME,
                      fields: Sequence[Fragment] = (), commands: list[dict[str, Any]] | None = None) -> None:
        def make(base: Base) -> bytes:
            if text is not None:
                return wrap_manifest(text(base))
            body = base.body()
            result = edit(body)
            return wrap_manifest(encode_body(body if result is None else result))
        listed = commands if commands is not None else manifest_commands(list(errors), list(fields))
        out.append(Case(name, what, MANIFEST_KEY, make, lambda base: listed))

    def record(i: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
        return lambda b: b["tensors"][i].update(fields)

    def leaf_node(body: dict[str, Any], name: str) -> dict[str, Any]:
        """The tree node of model.<name>."""
        model = next(v for k, v in body["tree"]["dict"] if k == {"str": "model"})
        return next(v for k, v in model["dict"] if k == {"str": name})

    def set_leaf(name: str, node: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
        def edit(body: dict[str, Any]) -> None:
            target = leaf_node(body, name)
            target.clear()
            target.update(node)
        return edit

    def replace_text(old: bytes, new: bytes) -> Callable[[Base], bytes]:
        def text(base: Base) -> bytes:
            body = manifest_body_bytes(base.manifest_file)
            assert body.count(old) == 1, old
            return body.replace(old, new)
        return text

    manifest_case("manifest_body_list", "manifest body: a JSON list holding the real body", lambda b: [b])
    for name in ("chunks", "tensors", "tree", "time", "step", "metrics"):
        manifest_case(f"manifest_without_{name}", f"manifest body: no \"{name}\" field",
                      lambda b, name=name: b.__delitem__(name), fields=[name])
    manifest_case("manifest_version_abc", "manifest: version \"abc\"", lambda b: b.update(version="abc"),
                  fields=["version"])
    manifest_case("manifest_version_list", "manifest: version [1]", lambda b: b.update(version=[1]), fields=["version"])
    manifest_case("manifest_version_true", "manifest: version true", lambda b: b.update(version=True),
                  fields=["version"])
    manifest_case("manifest_version_2", "manifest: version 2 (a newer format)", lambda b: b.update(version=2),
                  errors=FVE, fields=["version"])
    manifest_case("manifest_time_inf", "manifest: \"time\": 1e309 (raw JSON text: parses to inf)",
                  text=replace_text(b'"time":1700000000.0', b'"time":1e309'), fields=["time"])
    manifest_case("manifest_time_string", "manifest: \"time\": \"x\"", lambda b: b.update(time="x"), fields=["time"])
    manifest_case("manifest_step_mismatch", "manifest of step 3 (by its key) says \"step\": 4",
                  lambda b: b.update(step=4), fields=["step"])
    manifest_case("manifest_step_negative", "manifest: \"step\": -3", lambda b: b.update(step=-3), fields=["step"])
    manifest_case("chunk_id_nul", "chunks[0].id: 64 NUL characters", lambda b: b["chunks"][0].update(id="\0" * 64),
                  fields=["chunks[0].id"])
    manifest_case("chunk_id_nul_suffix", "chunks[0].id: the real id followed by a NUL character",
                  lambda b: b["chunks"][0].update(id=b["chunks"][0]["id"] + "\0"), fields=["chunks[0].id"])
    manifest_case("chunk_id_number", "chunks[0].id: the number 12345", lambda b: b["chunks"][0].update(id=12345),
                  fields=["chunks[0].id"])
    manifest_case("chunk_id_not_hex", "chunks[0].id: 64 characters that are not hex digits",
                  lambda b: b["chunks"][0].update(id="zz" * 32), fields=["chunks[0].id"])
    manifest_case("chunk_id_uppercase", "chunks[0].id: the real id in upper case (ids are lowercase hex)",
                  lambda b: b["chunks"][0].update(id=b["chunks"][0]["id"].upper()), fields=["chunks[0].id"])
    manifest_case("chunk_id_traversal", f"chunks[0].id: {TRAVERSAL_ID!r}, which leads out of the vault to the bait "
                  "file beside it", lambda b: b["chunks"][0].update(id=TRAVERSAL_ID), fields=["chunks[0].id"])
    manifest_case("chunk_raw_2pow40", "chunks[1].raw: 2**40 (far above the vault's chunk_size)",
                  lambda b: b["chunks"][1].update(raw=2**40), fields=["chunks[1].raw"])
    manifest_case("shape_negative", "tensors[0].shape: [-1]", record(0, shape=[-1]), fields=["tensors[0].shape"])
    manifest_case("shape_2pow64", "tensors[0].shape: [2**64] (overflows int64)", record(0, shape=[2**64]),
                  fields=["tensors[0].shape"])
    manifest_case("shape_string_dim", "tensors[0].shape: [\"8\", 16]", record(0, shape=["8", 16]),
                  fields=["tensors[0].shape"])
    manifest_case("shape_2pow28_over_512_bytes", "tensors[0]: shape [2**28] float32 and nbytes 2**30, over its 512 "
                  "real bytes (a 1 GiB tensor of which 512 bytes would be read)", record(0, shape=[2**28], nbytes=2**30),
                  fields=["tensors[0]", ["tensors[0].shape", "tensors[0].nbytes", "tensors[0].pieces"]])
    manifest_case("shape_16x16_over_512_bytes", "tensors[0]: shape [16, 16] float32 (1024 bytes) over its 512 bytes "
                  "(half the tensor would be uninitialised memory)", record(0, shape=[16, 16]),
                  fields=["tensors[0]", ["tensors[0].shape", "tensors[0].nbytes", "tensors[0].pieces"]])
    manifest_case("piece_offset_beyond_chunk", "tensors[0].pieces: [[0, 10**9, 4], [0, 4, 508]] (offset far past "
                  "the end of its 600-byte chunk; lengths still add up)", record(0, pieces=[[0, 10**9, 4], [0, 4, 508]]),
                  fields=["tensors[0].pieces[0]"])
    manifest_case("piece_length_beyond_chunk", "tensors[2].pieces: [[1, 16000, 16384]] (runs past the end of its "
                  "16384-byte chunk)", record(2, pieces=[[1, 16000, 16384]]), fields=["tensors[2].pieces[0]"])
    manifest_case("piece_negative_offset", "tensors[0].pieces: [[0, -4, 512]]", record(0, pieces=[[0, -4, 512]]),
                  fields=["tensors[0].pieces[0]"])
    manifest_case("piece_chunk_index_99", "tensors[0].pieces: [[99, 0, 512]] (the chunk table has 3 entries)",
                  record(0, pieces=[[99, 0, 512]]), fields=["tensors[0].pieces[0]"])
    manifest_case("piece_not_a_triple", "tensors[0].pieces: [[0, 0]]", record(0, pieces=[[0, 0]]),
                  fields=["tensors[0].pieces[0]"])
    manifest_case("tree_index_999", "tree: model.w's node is {\"tensor\": 999} (5 records)",
                  set_leaf("w", {"tensor": 999}), fields=["tree"])
    manifest_case("tree_unknown_kind", "tree: model.w's node is {\"evil\": 0}", set_leaf("w", {"evil": 0}),
                  fields=["tree"])
    manifest_case("tree_empty_node", "tree: model.w's node is {}", set_leaf("w", {}), fields=["tree"])
    manifest_case("tree_bad_float", "tree: model.w's node is {\"float\": \"zz\"} (not float.hex())",
                  set_leaf("w", {"float": "zz"}), fields=["tree"])
    manifest_case("tree_bad_bytes", "tree: model.w's node is {\"bytes\": \"!!\"} (not base64)",
                  set_leaf("w", {"bytes": "!!"}), fields=["tree"])

    def unhashable_key(body: dict[str, Any]) -> None:
        body["tree"]["dict"].append([{"list": []}, {"int": 1}])

    manifest_case("tree_unhashable_key", "tree: a dict entry whose key node is a list", unhashable_key, fields=["tree"])

    def nested(depth: int) -> Callable[[Base], bytes]:
        return replace_text(b'"metadata":{"run":"hostile"}',
                            b'"metadata":{"run":"hostile","deep":' + b"[" * depth + b"]" * depth + b"}")

    manifest_case("metadata_nested_30000", "metadata: lists nested 30,000 deep (json RecursionError)", text=nested(30_000))
    manifest_case("metadata_nested_100000", "metadata: lists nested 100,000 deep (json RecursionError)",
                  text=nested(100_000))

    def deep_tree(body: dict[str, Any]) -> None:
        node: dict[str, Any] = {"int": 1}
        for _ in range(490):
            node = {"list": [node]}
        body["tree"]["dict"].append([{"str": "deep"}, node])

    manifest_case("tree_nested_490", "tree: an extra key holding lists nested 490 deep (the JSON still parses; a "
                  "recursive walk of it does not; writers refuse states over 100 deep)", deep_tree, fields=["tree"])
    manifest_case("requires_unknown_feature", "manifest: \"requires\": [\"teleport\"]",
                  lambda b: b.update(requires=["teleport"]), errors=FVE, fields=["requires"])
    for dtype in ("float128", "evil"):
        # an unknown dtype name may be damage or a newer torch's dtype: either class, naming the field
        manifest_case(f"dtype_{dtype}", f"tensors[0].dtype: {dtype!r}", record(0, dtype=dtype),
                      errors=["CorruptManifestError", "FormatVersionError"], fields=["tensors[0].dtype"])
    manifest_case("kind_evil", "tensors[0].kind: \"evil\"", record(0, kind="evil"), fields=["tensors[0].kind"])
    as_pickle = {"kind": "pickle", "dtype": "|u1", "shape": [512], "global_shape": [512], "offsets": [0]}

    def pickle_record(body: dict[str, Any]) -> None:
        body["tensors"][0].update(as_pickle)
        body["pickle"] = True

    manifest_case("kind_pickle_under_tensor_node", "tensors[0] made a well-formed pickle record (kind, dtype, shape, "
                  "the manifest's \"pickle\" flag) while its tree node still says {\"tensor\": 0}", pickle_record,
                  fields=[["tensors[0].kind", "tree"]])

    def pickle_leaf(body: dict[str, Any]) -> None:
        pickle_record(body)
        set_leaf("w", {"pickle": 0})(body)

    manifest_case(
        "pickle_leaf_refused", "model.w turned into a well-formed pickle leaf (kind, dtype, shape, tree node and the "
        "manifest's \"pickle\" flag all agree); restoring it without allow_pickle must refuse before unpickling",
        pickle_leaf, commands=[
            raises("restore", ["PickleNotAllowedError"], ["model.w", "allow_pickle"]),
            ok("restore_keys_big"),
            raises("restore_into", ["PickleNotAllowedError", "KeyMismatchError"], ["model.w"]),
            ok("info"), ok("verify"), ok("gc_plan"), ok("cli_verify"), ok("cli_ls"), ok("cli_show"), ok("cli_gc"),
            ok("cli_cp"),
        ])

    # -- chunk objects (chunk 0: model.w, model.b, np; byte planes + zstd) -------------------------------
    def chunk_case(name: str, what: str, make_object: Callable[[bytes, dict[str, Any]], bytes],
                   errors: Sequence[str] = ("CorruptChunkError",), fields: Sequence[Fragment] = ()) -> None:
        def make(base: Base) -> bytes:
            return make_object(base.chunk(0), base.chunk_header(0))
        out.append(Case(name, what, CHUNK0, make, lambda base: chunk_commands(base.chunk_ids[0], list(errors), list(fields))))

    def header_edit(**fields: Any) -> Callable[[bytes, dict[str, Any]], bytes]:
        def make(obj: bytes, header: dict[str, Any]) -> bytes:
            return join_chunk(header_json({**header, **fields}), split_chunk(obj)[2])
        return make

    def header_text(text: Callable[[dict[str, Any]], bytes]) -> Callable[[bytes, dict[str, Any]], bytes]:
        return lambda obj, header: join_chunk(text(header), split_chunk(obj)[2])

    chunk_case("chunk_header_nested_60000", "chunk header: '{\"base\":null,\"codec\":' then 60,000 '[' (json "
               "RecursionError; the header length field still fits in 16 bits)",
               header_text(lambda h: b'{"base":null,"codec":' + b"[" * 60_000), fields=[["header", "codec"]])
    chunk_case("chunk_header_raw_2pow31", "chunk header: raw 2**31 over its 600-byte chunk's small payload",
               header_edit(raw=2**31), fields=["raw"])
    chunk_case("chunk_header_raw_negative", "chunk header: raw -600", header_edit(raw=-600), fields=["raw"])
    chunk_case("chunk_header_raw_1e999", "chunk header: \"raw\": 1e999 (raw JSON text: parses to inf)",
               header_text(lambda h: header_json({**h, "raw": 999}).replace(b'"raw":999', b'"raw":1e999')), fields=["raw"])
    chunk_case("chunk_header_raw_string", "chunk header: raw \"600\"", header_edit(raw="600"), fields=["raw"])
    chunk_case("chunk_header_base_not_hex", "chunk header: base is 64 characters that are not hex digits",
               header_edit(base="zz" * 32), fields=["base"])
    chunk_case("chunk_header_base_traversal", f"chunk header: base {TRAVERSAL_ID!r}, which leads out of the vault",
               header_edit(base=TRAVERSAL_ID), fields=["base"])
    chunk_case("chunk_header_codec_not_list", "chunk header: codec 5", header_edit(codec=5), fields=["codec"])
    chunk_case("chunk_header_codec_unknown_stage", "chunk header: codec [{\"id\": \"teleport\"}] (an unknown stage)",
               header_edit(codec=[{"id": "teleport"}]), errors=["FormatVersionError"], fields=["codec"])
    chunk_case("chunk_header_planes_typesize_0", "chunk header: byte planes with typesize 0",
               lambda obj, h: header_edit(codec=[{**h["codec"][0], "typesize": 0}])(obj, h), fields=["codec"])
    chunk_case("chunk_header_planes_typesize_huge", "chunk header: byte planes with typesize 10**9",
               lambda obj, h: header_edit(codec=[{**h["codec"][0], "typesize": 10**9}])(obj, h), fields=["codec"])
    chunk_case("chunk_header_not_object", "chunk header: the JSON list []", header_text(lambda h: b"[]"))
    chunk_case("chunk_header_length_past_end", "chunk prefix: header length 65535, past the end of the object",
               lambda obj, h: join_chunk(split_chunk(obj)[1], split_chunk(obj)[2], length=65535))
    chunk_case("chunk_format_version_2", "chunk prefix: format version 2", lambda obj, h: join_chunk(
        split_chunk(obj)[1], split_chunk(obj)[2], version=2), errors=["FormatVersionError"], fields=["version"])
    return out


def resolve(case: Case, base: Base) -> tuple[str, list[dict[str, Any]]]:
    """The key a case replaces and its command list (chunk cases: chunk 0 of ``base``)."""
    key = chunk_key(base.chunk_ids[0]) if case.key == CHUNK0 else case.key
    return key, case.commands(base)


def write_corpus(root: Path = HERE) -> list[dict[str, Any]]:
    """Rebuild base/, cases/ and cases.json under ``root``; returns the case table."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "vault"
        build_base(fresh)
        base = Base(fresh)
        assert base.chunk_header(0)["codec"] and base.chunk_header(1)["codec"], "chunks 0 and 1 must be coded"
        table = []
        staged = Path(tmp) / "cases"
        for case in cases():
            key, commands = resolve(case, base)
            data = case.make(base)
            assert data != (fresh / key).read_bytes(), case.name
            target = staged / case.name / key
            target.parent.mkdir(parents=True)
            target.write_bytes(data)
            table.append({"name": case.name, "what": case.what, "key": key, "commands": commands})
        names = [c["name"] for c in table]
        assert len(names) == len(set(names)), "case names must be unique"
        shutil.rmtree(root / "base", ignore_errors=True)
        shutil.rmtree(root / "cases", ignore_errors=True)
        shutil.copytree(fresh, root / "base")
        shutil.copytree(staged, root / "cases")
    doc = {
        "about": "Hostile-vault corpus: each case is tests/hostile/base with the file at 'key' replaced by "
                 "tests/hostile/cases/<name>/<key>. Rebuild with tests/hostile/make_corpus.py.",
        "step": STEP, "manifest_key": MANIFEST_KEY, "bait": BAIT_NAME,
        "commands": COMMANDS, "expectations": EXPECTATIONS, "cases": table,
    }
    (root / "cases.json").write_text(json.dumps(doc, indent=1, ensure_ascii=True) + "\n")
    return table


if __name__ == "__main__":
    written = write_corpus()
    total = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file())
    print(f"wrote {len(written)} cases to {HERE} ({total / 1024:.0f} KiB in all)", file=sys.stderr)
