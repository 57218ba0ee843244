"""Test helpers for stores and for code built on ckptvault, shipped with the package (as ``zarr.testing`` is).

* :mod:`ckptvault.testing.store_conformance`: ``StoreConformance``, the pytest suite every ``Store``
  implementation must pass (subclass it and provide a ``store`` fixture); needs ``pytest``.
* :mod:`ckptvault.testing.faults`: ``FaultyStore`` and ``FaultProxy``, stores that inject transient or permanent
  failures and stalls into another store, for testing retries and crash safety.

Nothing in the library imports this package.
"""
