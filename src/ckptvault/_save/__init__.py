"""The save pipeline, in the order a save runs (docs/DESIGN.md §1; chunking: §5).

``snapshot`` (the only step training waits for; ``staging`` holds its host copy) -> ``lossy`` (per-tensor casts a
rule asks for) -> ``chunking`` (cut arrays into fixed-size chunks) -> ``chunks`` (hash, dedup, encode, write;
``guard`` decides which existing chunks a save may rely on) -> ``commit`` (write the manifest, the only commit).
``pipeline`` runs these steps for synchronous and asynchronous saves alike.
"""
