"""Package and wire versions.

``SCHEMA_VERSION`` versions every msgpack structure kvbridge puts on the wire
(layouts, step metadata, transfer params); ``PROTOCOL_VERSION`` versions the
gRPC services. A peer with another version is rejected with a message naming
both.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["__version__", "SCHEMA_VERSION", "PROTOCOL_VERSION"]

try:
    __version__ = metadata.version("kvbridge")
except metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+source"

SCHEMA_VERSION = 1
PROTOCOL_VERSION = 1
