"""``python -m ckptvault``: the same as the ``ckptvault`` command."""

from ckptvault.cli import main

if __name__ == "__main__":
    main(prog_name="ckptvault")
