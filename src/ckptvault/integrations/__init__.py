"""Integrations of ckptvault with training frameworks; each module imports its framework and nothing imports them.

    lightning     VaultCheckpointIO: PyTorch Lightning's CheckpointIO plugin over a vault
    transformers  VaultTrainer / VaultTrainerMixin: the Hugging Face Trainer, its checkpoints as vault steps

The contracts (what is stored how, which path names which step, rotation, asynchronous saves, resume):
docs/INTEGRATIONS.md.
"""
