"""Both ends of the no-RPC load: the reader checks a lease's seal, the owner hears releases.

Reader (decode's worker half): :class:`SealReader` keeps a few scratch slots in
registered memory, links to each peer's seal table, and after a block READ
reads the lease's probe slots and compares them with the seal it expects
(:mod:`kvbridge.connector.control.seal` says what that proves). A good seal
lets the load finish without a control RPC; the lease is then given back by a
NIXL notification (:func:`release_message`), which costs no round trip.

Owner (prefill's worker half, beside its lease table): :class:`ReleaseListener`
polls the transport's notifications and releases the leases they name. A
notification is only a hint to free early: a forged one can end a lease
sooner, which makes its reader recompute, never read reused blocks.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbridge.connector.control.seal import (
    PROBES,
    SEAL_GROUP,
    expected_seal,
    probe_slots,
    seal_layout,
    slot_rows,
)
from kvbridge.proto.errors import KVBridgeError, OutOfBlocksError
from kvbridge.proto.types import BlockId, LeaseId

if TYPE_CHECKING:
    from kvbridge.connector.transport.base import PeerLink, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["RELEASE_PREFIX", "ReleaseListener", "SealReader", "release_message"]

log = logging.getLogger(__name__)

RELEASE_PREFIX = b"kvbridge-release\0"
_LEASE_ID = re.compile(rb"[0-9a-f]{32}")


def release_message(lease_id: str) -> bytes:
    return RELEASE_PREFIX + lease_id.encode()


class SealReader:
    """Decode's side: scratch slots and seal checks; thread-safe (loads run in a pool)."""

    def __init__(self, transport: Transport, max_concurrent: int) -> None:
        self.transport = transport
        layout = seal_layout(PROBES * max(1, max_concurrent))
        self._caches = layout.allocate("cpu")
        (tensor,) = self._caches.values()
        self._slots = slot_rows(tensor, layout.groups[0].num_blocks)
        self.memory = transport.register(layout, self._caches)
        self._free = [BlockId(i) for i in range(layout.groups[0].num_blocks)]
        self._lock = threading.Lock()

    def connect(self, peer_name: str, metadata: bytes, seal: KVLayout) -> PeerLink:
        """A link from the scratch slots to a peer's seal table."""
        return self.transport.connect(peer_name, metadata, seal, self.memory)

    def holds(self, link: PeerLink, lease_id: str, digest: bytes, timeout_s: float) -> bool:
        """READ the lease's probe slots from the owner; True if one holds exactly the
        expected seal. Any failure is False (the caller takes the slow path)."""
        try:
            want = expected_seal(lease_id, digest)
        except ValueError:
            return False
        with self._lock:
            if len(self._free) < PROBES:
                raise OutOfBlocksError("no free seal scratch slots (more loads than configured)")
            mine, self._free = self._free[:PROBES], self._free[PROBES:]
        try:
            remote = probe_slots(lease_id, link.remote_layout.groups[0].num_blocks)
            handle = self.transport.read_blocks(link, SEAL_GROUP, mine, remote, timeout_s=timeout_s)
            try:
                handle.wait(timeout_s)
            finally:
                handle.release()
            return any(self._slots[s].numpy().tobytes() == want for s in mine)
        except KVBridgeError as exc:
            log.info("reading the seal of lease %s failed (%s)", lease_id, exc)
            return False
        finally:
            with self._lock:
                self._free.extend(mine)

    def release(self, link: PeerLink, lease_id: str) -> None:
        """Give a lease back without a round trip (best effort: unsent, it expires)."""
        try:
            self.transport.send_notification(link, release_message(lease_id))
        except KVBridgeError as exc:
            log.info("release notification for lease %s failed (%s); it will expire", lease_id, exc)

    def close(self) -> None:
        self.transport.unregister(self.memory)


class ReleaseListener:
    """The owner's side: a thread that releases the leases peers' notifications name."""

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
                    lease = message[len(RELEASE_PREFIX) :]
                    if not message.startswith(RELEASE_PREFIX) or not _LEASE_ID.fullmatch(lease):
                        log.debug("ignoring a notification from %s", peer)
                        continue
                    try:
                        self._release(LeaseId(lease.decode()))
                    except Exception:  # the listener must outlive one bad release
                        log.exception("releasing lease %s for %s failed", lease, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
