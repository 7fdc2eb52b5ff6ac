"""Who may commit what in the offload daemon: worker sessions and WRITE notifications.

Owned by the daemon's handlers (:mod:`kvbridge.worker.offload.server`), called
from its gRPC threads and its reaper. The token (checked by the gRPC server
before any handler runs) says a caller may use the daemon at all and, with one
token per peer (a token file), which peer it is. This module does:

- :class:`Sessions`: every handshake opens a session, a 128-bit random id
  bound to the NIXL agent name the worker declared and to the caller's
  authenticated identity (its token's hash; its host when the daemon has no
  token). Later calls carry the id, from the same identity only; the daemon
  turns it back into the agent name, and that name and identity own the stores
  and loads the call makes (:class:`~kvbridge.worker.offload.pool.HostPool`
  ``writer`` and ``peer``). Caps are charged to the identity: a declared name
  costs nothing to make up. The table is bounded per identity and in all.
- :func:`route_notifications`: a worker's WRITE into a store's slots carries
  :func:`~kvbridge.connector.offload.wire.store_notification` (``notif_msg``);
  NIXL delivers it to the daemon, keyed by the sending agent, only once the
  WRITE completed. The daemon marks
  the store written only when the sender is the store's own writer, so
  CommitStore can refuse slots nobody wrote. Anything else is dropped.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence

from kvbridge.connector.offload.wire import STORE_NOTIFY_PREFIX
from kvbridge.proto.errors import ConfigError, ControlPlaneError, WireError

__all__ = ["Sessions", "check_agent_name", "route_notifications"]

log = logging.getLogger(__name__)

MAX_AGENT_NAME = 128


def check_agent_name(name: str) -> str:
    """A worker's declared NIXL agent name: 1..128 printable ASCII characters."""
    if not 0 < len(name) <= MAX_AGENT_NAME or not name.isascii() or not name.isprintable():
        raise WireError(
            f"agent_name {name[:64]!r} must be the worker's NIXL agent name: "
            f"1..{MAX_AGENT_NAME} printable ASCII characters"
        )
    return name


class Sessions:
    """Session id -> the agent name it was opened for and the peer (authenticated identity)
    that opened it.

    At most ``max_sessions`` in all, ``per_peer`` per peer (all agent names it handshakes
    under together) and ``per_agent`` per agent name of one peer. A peer at its cap drops
    its own least recently used session, never another peer's: handshaking under many
    names cannot push other peers' workers out. Only when the whole table is full does the
    least recently used session of anyone go (its worker handshakes again on its next call).
    """

    def __init__(self, max_sessions: int, per_agent: int = 4, per_peer: int = 64) -> None:
        if max_sessions < 1 or per_agent < 1 or per_peer < 1:
            raise ConfigError(
                f"max_sessions ({max_sessions}), per_agent ({per_agent}) and per_peer "
                f"({per_peer}) must be >= 1"
            )
        self._max = max_sessions
        self._per_agent = per_agent
        self._per_peer = per_peer
        self._lock = threading.Lock()
        # least recently used first: session -> (agent, peer)
        self._sessions: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._count: Counter[tuple[str, str]] = Counter()  # (agent, peer) -> sessions
        self._peers: Counter[str] = Counter()  # peer -> sessions

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def open(self, agent: str, peer: str = "") -> str:
        """A new session for ``agent`` (a checked name) opened by ``peer``; drops the least
        recently used one of that agent of that peer if it has ``per_agent``, else of that
        peer if it has ``per_peer``, else of anyone if the table is full."""
        session = secrets.token_hex(16)
        key = (agent, peer)
        with self._lock:
            if self._count[key] >= self._per_agent:
                self._drop(next(s for s, k in self._sessions.items() if k == key))
            elif self._peers[peer] >= self._per_peer:
                self._drop(next(s for s, k in self._sessions.items() if k[1] == peer))
            while len(self._sessions) >= self._max:
                name, _ = self._drop(next(iter(self._sessions)))
                log.info("session of %s dropped (more than %d sessions)", name, self._max)
            self._sessions[session] = key
            self._count[key] += 1
            self._peers[peer] += 1
        return session

    def _drop(self, session: str) -> tuple[str, str]:
        key = self._sessions.pop(session)
        self._count[key] -= 1
        if not self._count[key]:
            del self._count[key]
        self._peers[key[1]] -= 1
        if not self._peers[key[1]]:
            del self._peers[key[1]]
        return key

    def agent(self, session: str, peer: str = "") -> str:
        """The agent that ``session`` names; FAILED_PRECONDITION if unknown (handshake
        again) or opened by another peer (a session id is no credential of its own)."""
        with self._lock:
            key = self._sessions.get(session)
            if key is not None and key[1] == peer:
                self._sessions.move_to_end(session)
                return key[0]
        raise ControlPlaneError(
            f"unknown session {session[:40]!r} (never opened, or dropped): handshake again",
            code="FAILED_PRECONDITION",
        )

    def of_peer(self, peer: str) -> int:
        """How many sessions ``peer`` holds (tests, logs)."""
        with self._lock:
            return self._peers[peer]


def route_notifications(
    notifications: Mapping[str, Sequence[bytes]], mark_written: Callable[[str, str], bool]
) -> int:
    """Mark the stores whose writers' WRITEs completed; returns how many were marked.

    ``notifications`` is :meth:`Transport.poll_notifications`'s answer (by
    sending agent); ``mark_written(store_id, agent)`` is the pool's, which
    ignores a store that is unknown or not that agent's.
    """
    marked = 0
    for agent, messages in notifications.items():
        for message in messages:
            if not message.startswith(STORE_NOTIFY_PREFIX):
                log.debug("ignored a notification from %.64r", agent)
                continue
            store_id = message[len(STORE_NOTIFY_PREFIX) :].decode("ascii", "replace")
            if mark_written(store_id, agent):
                marked += 1
            else:
                log.debug("ignored a WRITE notification from %.64r for %.40r", agent, store_id)
    return marked
