"""Reading checkpoints back (docs/DESIGN.md §8): ``tensors`` selects records, fetches and verifies their chunks in
parallel and scatters the bytes into new tensors or into the caller's (in place); ``live`` restores into live
objects (modules, optimizers, schedulers: anything with ``state_dict``/``load_state_dict``) on top of it."""
