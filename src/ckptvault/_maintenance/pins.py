"""Pins: tags that protect a checkpoint from every retention policy.

A pin is an object ``pins/<step, 20 digits>/<tag>`` (JSON body, for people),
so pins survive restarts and are seen by a prune in any other process.
``pin`` writes the pin object *before* checking that the step is committed,
and a prune re-lists pins just before it deletes a manifest, so a pin that
returned normally protects its step from every prune that starts afterwards.
"""

from __future__ import annotations

import json
import logging
import time

from .._format import keys
from .._format.manifest import check_step, manifest_key
from .._vault import Vault
from ..errors import ObjectNotFoundError, StepNotFoundError
from .retention import validate_tag

log = logging.getLogger(__name__)

PINS_PREFIX = "pins/"


def pin_key(step: int, tag: str) -> str:
    return f"{PINS_PREFIX}{step:020d}/{tag}"


def parse_pin_key(key: str) -> tuple[int, str] | None:
    """(step, tag) of ``pins/<20 ASCII digits>/<valid tag>``, or None for any other key."""
    return keys.parse_pin_key(key)


def pin(vault: Vault, step: int, tag: str) -> None:
    """Pin committed ``step`` under ``tag`` (idempotent). StepNotFoundError if the step is not committed."""
    check_step(step)
    validate_tag(tag)
    vault.require()
    key = pin_key(step, tag)
    body = json.dumps({"step": step, "tag": tag, "time": time.time()}).encode()
    vault.store.put(key, body)
    if not vault.store.exists(manifest_key(step)):
        vault.store.delete(key)
        raise StepNotFoundError(step, vault.url, vault.steps())
    log.info("pinned step %d as %r in %s", step, tag, vault.url)


def unpin(vault: Vault, step: int, tag: str) -> bool:
    """Remove the pin; True if it existed. The checkpoint itself is untouched."""
    check_step(step)
    validate_tag(tag)
    key = pin_key(step, tag)
    try:
        vault.store.stat(key)
    except ObjectNotFoundError:
        return False
    vault.store.delete(key)
    log.info("unpinned step %d tag %r in %s", step, tag, vault.url)
    return True


def list_pins(vault: Vault) -> dict[int, frozenset[str]]:
    """Every pin in the vault: step -> tags (including pins of steps no longer committed)."""
    found: dict[int, set[str]] = {}
    for info in vault.store.list(PINS_PREFIX):
        parsed = parse_pin_key(info.key)
        if parsed is not None:
            found.setdefault(parsed[0], set()).add(parsed[1])
    return {s: frozenset(tags) for s, tags in sorted(found.items())}
