"""SaveHandle: the two moments of a save, as futures.

``staged`` completes once the state has been captured (training may modify
it from then on); ``committed`` completes once the checkpoint is durable and
visible, with its :class:`CheckpointInfo`, or with the error that stopped it
(in which case nothing was committed).
"""

from __future__ import annotations

from concurrent.futures import Future

from ._feedback import reissue_deferred
from .info import CheckpointInfo


class SaveHandle:
    """What :meth:`CheckpointManager.save` returns: ``staged`` and ``committed`` futures (module docstring),
    :meth:`wait` for the commit, and ``skipped`` for a save that ``on_busy="skip"`` did not run."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.skipped = False
        self.reported = False  # wait() raised this save's error to the caller
        self.staged: Future[None] = Future()
        self.committed: Future[CheckpointInfo | None] = Future()

    @classmethod
    def skipped_save(cls, step: int) -> SaveHandle:
        """A handle for a save that was skipped (another save was in flight): ``wait()`` returns None."""
        handle = cls(step)
        handle.skipped = True
        handle.staged.set_result(None)
        handle.committed.set_result(None)
        return handle

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Block until committed; return its info (None if skipped) or raise the save's error.

        An error raised here is not raised again by the manager's next save, wait or close. Warnings the
        background save issued (a lossy codec's fallback) are issued again here, at the caller's line.
        """
        try:
            return self.committed.result(timeout)
        except BaseException:
            if self.committed.done():
                self.reported = True
            raise
        finally:
            reissue_deferred()

    def done(self) -> bool:
        return self.committed.done()

    def __repr__(self) -> str:
        if self.skipped:
            return f"<SaveHandle step={self.step} skipped>"
        state = "committed" if self.done() and not self.committed.exception() else (
            "failed" if self.done() else "staged" if self.staged.done() else "staging")
        return f"<SaveHandle step={self.step} {state}>"
