"""Multi-rank checkpoints: torch.distributed.checkpoint (DCP) saving into and loading from a vault.

In a job, ``ckptvault.CheckpointManager`` is collective and uses these itself (README, "Distributed training";
``DistributedOptions``). A script that already calls DCP changes one argument::

    import torch.distributed.checkpoint as dcp
    from ckptvault.distributed import VaultReader, VaultWriter

    dcp.save(state, storage_writer=VaultWriter("s3://bucket/run", step))     # every rank
    dcp.load(state, storage_reader=VaultReader("s3://bucket/run", step))     # any world size

What a vault adds to DCP: chunks deduplicated across steps and ranks, compressed, verified on every read; one
manifest committed last for all ranks; no pickle (non-tensor values are stored as JSON; DCP's metadata is rebuilt
from the manifest). ``VaultSavePlanner`` / ``VaultLoadPlanner`` are DCP's default planners without pickle for
other storage too. ``CheckpointManager(url).restore(step)`` reads such a checkpoint without a process group,
each tensor whole, nested as the state given to ``dcp.save``. Errors: see ``ckptvault.distributed.dcp``.
"""

from .dcp import VaultReader, VaultWriter
from .planners import VaultLoadPlanner, VaultSavePlanner

__all__ = ["VaultLoadPlanner", "VaultReader", "VaultSavePlanner", "VaultWriter"]
