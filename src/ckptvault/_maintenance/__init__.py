"""Keeping a vault: ``retention`` (which checkpoints to keep, a pure function), ``prune`` (apply it), ``pins``
(tags that protect a checkpoint), ``gc`` (delete chunks nothing reaches), ``copy`` (between vaults), and ``mixin``
(these as :class:`~ckptvault.CheckpointManager` methods). Every destructive operation is a plan, then an execute.
"""
