"""Read-only reports over a vault: ``verify`` (every chunk against its hash), ``usage`` (space accounting) and
``diff`` (two checkpoints tensor by tensor)."""
