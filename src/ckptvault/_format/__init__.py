"""The on-storage format: chunk objects, manifests and the vault descriptor.

``docs/DESIGN.md`` is the specification; this package is its implementation.
"""

FORMAT_VERSION = 1
