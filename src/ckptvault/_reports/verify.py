"""Verification: read every chunk a set of checkpoints references and check its hash, and every manifest's schema
(the levels of a restore chain stored in chunks included)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .._feedback import metered
from .._restore.chain import with_chain
from .._vault import Vault
from ..errors import CorruptChunkError, CorruptDataError, ObjectNotFoundError, VaultError


@dataclass
class VerifyReport:
    """Steps checked, and for each damaged step what is wrong with it."""

    checked: list[int] = field(default_factory=list)
    problems: dict[int, list[str]] = field(default_factory=dict)
    chunks_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_steps(vault: Vault, steps: list[int], progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check manifests and every chunk they name (each chunk once)."""
    report = VerifyReport()
    users: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for step in steps:
        report.checked.append(step)
        try:
            manifest = vault.read_manifest(step)
        except VaultError as exc:
            report.problems.setdefault(step, []).append(str(exc))
            continue
        for chunk in manifest.chunks:
            users.setdefault(chunk.id, []).append(step)
            sizes[chunk.id] = chunk.raw
        try:
            with_chain(vault, manifest)  # restore chain levels stored in chunks: checked as the manifest is
        except CorruptChunkError:
            pass  # the chunk checks below report it
        except CorruptDataError as exc:
            report.problems.setdefault(step, []).append(str(exc))

    progress = metered(progress, sum(sizes.values()))  # each chunk once, as checked

    def check(cid: str) -> str | None:
        try:
            vault.read_chunk(cid, expected_raw=sizes[cid])
            return None
        except ObjectNotFoundError:
            return f"chunk {cid} is missing"
        except CorruptChunkError as exc:  # its message would tell the user to run verify
            return f"chunk {exc.chunk} is corrupt: {exc.reason}"
        except CorruptDataError as exc:
            return str(exc)
        finally:
            if progress:
                progress(sizes[cid])

    for cid, problem in zip(users, vault.pool.map(check, list(users)), strict=True):
        report.chunks_checked += 1
        report.bytes_checked += sizes[cid]
        if problem:
            for step in users[cid]:
                report.problems.setdefault(step, []).append(problem)
    return report
