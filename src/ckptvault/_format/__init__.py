"""The on-storage format: chunk objects, manifests and the vault descriptor.

``docs/DESIGN.md`` is the specification; this package is its implementation.
"""

import re

FORMAT_VERSION = 1
#: a BLAKE3 hex digest as the format writes it (chunk ids, predicted outputs' digests): 64 lowercase hex digits
HEX_DIGEST = re.compile(r"[0-9a-f]{64}", re.ASCII)
