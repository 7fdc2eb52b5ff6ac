"""Leases given back by NIXL notification: the reader's message and the owner's listener.

A decode whose lease seal held (:mod:`kvbridge.connector.control.seal`) gives
the lease back without a round trip: it sends :func:`release_message` to the
owner as a NIXL notification, and the owner's :class:`ReleaseListener` (a
thread beside its lease table) releases it. A notification is only a hint to
free early: a forged one can end a lease sooner, which makes its reader
recompute, never read reused blocks.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbridge.proto.errors import KVBridgeError
from kvbridge.proto.types import LeaseId

if TYPE_CHECKING:
    from kvbridge.connector.transport.base import Transport

__all__ = [
    "MAX_READERS",
    "RELEASE_PREFIX",
    "ReleaseListener",
    "parse_release",
    "release_message",
]

log = logging.getLogger(__name__)

RELEASE_PREFIX = b"kvbridge-release\0"
_RELEASE = re.compile(rb"([0-9a-f]{32})(?:/([0-9]{1,4})/([0-9]{1,4}))?")
MAX_READERS = 1024
"""Most readers one release may name (decode TP ranks reading one prefill rank)."""
MAX_PARTIAL = 4096
"""Leases with some but not all of their readers' releases that a listener remembers."""


def release_message(lease_id: str, reader: int = 0, readers: int = 1) -> bytes:
    """The notification that gives a lease back; ``reader`` of ``readers`` when several
    decode ranks read one lease (heterogeneous TP): the owner releases once every one of
    them has (or the lease expires)."""
    if readers == 1:
        return RELEASE_PREFIX + lease_id.encode()
    if not 0 <= reader < readers <= MAX_READERS:
        raise ValueError(f"reader {reader} of {readers} is not a reader")
    return RELEASE_PREFIX + f"{lease_id}/{reader}/{readers}".encode()


def parse_release(message: bytes) -> tuple[str, int, int] | None:
    """``(lease id, reader, readers)`` of a release notification; None if it is none."""
    if not message.startswith(RELEASE_PREFIX):
        return None
    m = _RELEASE.fullmatch(message[len(RELEASE_PREFIX) :])
    if m is None:
        return None
    if m.group(2) is None:
        return m.group(1).decode(), 0, 1
    reader, readers = int(m.group(2)), int(m.group(3))
    if not 0 <= reader < readers <= MAX_READERS:
        return None
    return m.group(1).decode(), reader, readers


class ReleaseListener:
    """The owner's side: a thread that releases the leases peers' notifications name.

    A release naming ``readers > 1`` (decode ranks sharing one lease) releases the lease
    only once that many distinct readers sent theirs; at most ``MAX_PARTIAL`` such leases
    are remembered (the oldest forgotten: it then expires). Counting is a performance
    matter only: a reader whose seal no longer holds asks the owner and recomputes.
    """

    def __init__(
        self,
        transport: Transport,
        release: Callable[[LeaseId], object],
        interval_s: float = 0.005,
    ) -> None:
        self._transport = transport
        self._release = release
        self._interval = interval_s
        self._stop = threading.Event()
        self._partial: dict[str, set[int]] = {}
        """Readers heard from, per lease still waiting for others (listener thread only)."""
        self._thread = threading.Thread(target=self._run, name="kvb-release", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                notes = self._transport.poll_notifications()
            except KVBridgeError as exc:
                log.debug("polling notifications: %s", exc)
                continue
            for peer, messages in notes.items():
                for message in messages:
                    parsed = parse_release(message)
                    if parsed is None:
                        log.debug("ignoring a notification from %s", peer)
                        continue
                    lease = self._complete(*parsed)
                    if lease is None:
                        continue
                    try:
                        self._release(LeaseId(lease))
                    except Exception:  # the listener must outlive one bad release
                        log.exception("releasing lease %s for %s failed", lease, peer)

    def _complete(self, lease: str, reader: int, readers: int) -> str | None:
        """``lease`` once all of its readers released it, else None."""
        if readers == 1:
            return lease
        seen = self._partial.pop(lease, set())  # re-inserted last: the oldest go first
        seen.add(reader)
        if len(seen) >= readers:
            return lease
        self._partial[lease] = seen
        while len(self._partial) > MAX_PARTIAL:
            del self._partial[next(iter(self._partial))]
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
