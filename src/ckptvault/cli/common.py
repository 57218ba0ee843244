"""Shared pieces of every ``ckptvault`` command.

Command modules (``inspect.py``, ``remove.py``, and those other features add)
build on these:

* :class:`VaultGroup`: the group class of ``main``; turns library errors into
  one-line ``error: ...`` messages and the exit codes below, for every command
  registered on it, so commands need no try/except of their own.
* :func:`open_manager`: a CheckpointManager for a URL, closed afterwards, that
  fails with exit code 2 when no vault is there (``must_exist=True``).
* :func:`url_argument`, :func:`step_argument`, :func:`json_option`,
  :func:`progress_option`: decorators that give every command the same
  arguments and options.
* :func:`emit_json`: the one way to print ``--json`` output (stdout, indented).
* :func:`progress_bar`: a tqdm byte counter on stderr, shown only when stderr
  is a terminal unless ``--progress``/``--no-progress`` decides.
* :func:`fail`: stop a command with ``error: ...`` and an exit code.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import click

from .. import errors
from ..manager import CheckpointManager

F = TypeVar("F", bound=Callable[..., Any])

#: exit status of a command that did what was asked (verify: everything is intact)
EXIT_OK = 0
#: damage found: verify saw a damaged checkpoint, or a command met a corrupt object
EXIT_DAMAGED = 1
#: the request cannot be served as asked: bad arguments, no vault at the URL, unknown step
EXIT_USAGE = 2
#: any other library error: storage failure, unsupported format version, failed save
EXIT_ERROR = 3
#: interrupted with Ctrl-C
EXIT_INTERRUPTED = 130

_USAGE_ERRORS = (
    errors.VaultNotFoundError,
    errors.StepNotFoundError,
    errors.StepExistsError,
    errors.InvalidArgumentError,
    errors.KeyMismatchError,
    errors.PickleNotAllowedError,
)


def exit_code_for(exc: errors.VaultError) -> int:
    """The exit status a library error maps to (see the ``EXIT_*`` constants)."""
    if isinstance(exc, errors.CorruptDataError):
        return EXIT_DAMAGED
    if isinstance(exc, _USAGE_ERRORS):
        return EXIT_USAGE
    return EXIT_ERROR


def error_line(message: str) -> str:
    """``error: <message>`` on one line (newlines in library messages are folded)."""
    return "error: " + " ".join(str(message).split())


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    click.echo(error_line(message), err=True)
    raise click.exceptions.Exit(code)


class VaultGroup(click.Group):
    """A click group whose commands report VaultError as ``error: ...`` without a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.VaultError as exc:
            fail(cli_message(str(exc)), exit_code_for(exc))
        except KeyboardInterrupt:
            fail("interrupted", EXIT_INTERRUPTED)
        except BrokenPipeError:
            _silence_stdout()
            raise click.exceptions.Exit(EXIT_ERROR) from None


def cli_message(message: str) -> str:
    """A library message as the CLI reports it: where it names ``storage_options`` (the library's keyword), it also
    says how to give them on the command line."""
    if "storage_options" not in message:
        return message
    return (f"{message} (on the command line, give storage options as `ckptvault --storage-option KEY=VALUE "
            "COMMAND ...`; cp takes --src-option/--dst-option)")


def _silence_stdout() -> None:
    """After a closed pipe (``ckptvault ls ... | head``), keep Python from complaining at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def parse_options(values: tuple[str, ...], flag: str) -> dict[str, Any] | None:
    """``("endpoint_url=http://h:9000", "max_concurrency=16")`` -> dict; values are JSON when they parse as JSON."""
    if not values:
        return None
    out: dict[str, Any] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE", param_hint=flag)
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def group_storage_options() -> dict[str, Any] | None:
    """The ``--storage-option`` values given before the command (``ckptvault --storage-option K=V ls URL``)."""
    ctx = click.get_current_context(silent=True)
    return None if ctx is None else (ctx.find_root().obj or {}).get("storage_options")


@contextmanager
def open_manager(url: str, *, must_exist: bool = True, **kwargs: Any) -> Iterator[CheckpointManager]:
    """A CheckpointManager for ``url``, closed on exit.

    With ``must_exist`` (the default) a URL without a vault raises
    VaultNotFoundError, which the group reports with exit code 2. ``kwargs``
    go to CheckpointManager (``codec``, ``workers``, ...); the group's
    ``--storage-option`` values become its ``storage_options``.
    """
    options = group_storage_options()
    if options is not None and "storage_options" not in kwargs:
        kwargs["storage_options"] = options
    with CheckpointManager(url, **kwargs) as mgr:
        if must_exist:
            mgr.vault.require()
        yield mgr


def require_steps(mgr: CheckpointManager, steps: list[int]) -> list[int]:
    """Raise StepNotFoundError (exit 2) for the first of ``steps`` that is not committed; return them."""
    committed = set(mgr.steps())
    for step in steps:
        if step not in committed:
            raise errors.StepNotFoundError(step, mgr.url, sorted(committed))
    return steps


# -- arguments and options ------------------------------------------------------
def url_argument(func: F) -> F:
    """The vault URL: a directory path, ``file://...`` or another supported URL."""
    return click.argument("url", metavar="URL")(func)


def step_argument(required: bool = False, nargs: int = 1) -> Callable[[F], F]:
    """A STEP argument (non-negative int); optional by default (the command picks the latest)."""
    return click.argument("step", type=click.IntRange(min=0), required=required, nargs=nargs, metavar=(
        "STEP..." if nargs != 1 else "STEP" if required else "[STEP]"))


def json_option(func: F) -> F:
    """``--json``: print one JSON document on stdout instead of text (passed as ``as_json``)."""
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout instead of text.")(func)


def progress_option(func: F) -> F:
    """``--progress/--no-progress``: passed as ``progress`` (None = only when stderr is a terminal)."""
    return click.option("--progress/--no-progress", "progress", default=None,
                        help="Show or hide progress bars on stderr [default: shown when stderr is a terminal].")(func)


# -- output ---------------------------------------------------------------------
def emit_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout (the only output of a ``--json`` command)."""
    click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def progress_enabled(progress: bool | None) -> bool:
    """``--progress`` forces bars on, ``--no-progress`` off; by default only when stderr is a terminal."""
    if progress is not None:
        return progress
    return sys.stderr.isatty()


@contextmanager
def progress_bar(total: int | None, desc: str, progress: bool | None) -> Iterator[Callable[[int], None]]:
    """Yield a thread-safe ``update(nbytes)`` callback that drives a byte progress bar on stderr.

    The callback suits the ``progress=`` parameter of CheckpointManager's
    ``save``, ``restore`` and ``verify``. When bars are off it does nothing.
    """
    if not progress_enabled(progress):
        yield _ignore
        return
    from tqdm import tqdm

    lock = threading.Lock()
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              dynamic_ncols=True, leave=False) as bar:
        def update(n: int) -> None:
            with lock:
                bar.update(n)

        yield update


def _ignore(_n: int) -> None:
    return None


def configure_logging(verbose: int) -> None:
    """``-v``: INFO from ckptvault on stderr; ``-vv``: DEBUG."""
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("ckptvault").setLevel(level)
