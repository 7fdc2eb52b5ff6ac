"""Decode's load of a remote engine's blocks, top to bottom (fail closed).

:class:`RemoteLoader` (``loader``) runs one load: link to the peer (``links``),
post every READ at once (``reads``: straight into the KV cache, or through a staging
cache for a peer with another inner order), prove them (the lease seal of
:mod:`kvbridge.connector.control.seal`, or the owner naming the blocks), verify
the bytes that landed (``verify``), give the lease back; ``inline`` drives such a load
from the engine's own thread, by non-blocking polls. ``ranks`` loads one
request from several remote TP ranks (heterogeneous TP); ``result`` builds every
:class:`~kvbridge.connector.base.LoadResult`.
"""

from kvbridge.connector.load.attempt import Attempt
from kvbridge.connector.load.inline import InlineLoad
from kvbridge.connector.load.links import STAGING_BLOCKS, ClientFactory, LinkCache, Peer, Staging
from kvbridge.connector.load.loader import RELEASE_TIMEOUT_S, RemoteLoader
from kvbridge.connector.load.ranks import load_from_ranks
from kvbridge.connector.load.reads import ReadFigures, ReadRequest, post_reads
from kvbridge.connector.load.result import load_result

__all__ = [
    "Attempt",
    "ClientFactory",
    "InlineLoad",
    "LinkCache",
    "Peer",
    "RELEASE_TIMEOUT_S",
    "ReadFigures",
    "ReadRequest",
    "RemoteLoader",
    "STAGING_BLOCKS",
    "Staging",
    "load_from_ranks",
    "load_result",
    "post_reads",
]
