"""Who may commit what in the offload daemon: worker sessions and WRITE notifications.

Owned by the daemon's handlers (:mod:`kvbridge.worker.offload.server`), called
from its gRPC threads and its reaper. The token (checked by the gRPC server
before any handler runs) says a caller may use the daemon at all; it is
shared, so it cannot tell workers apart. This module does:

- :class:`Sessions`: every handshake opens a session, a 128-bit random id
  bound to the NIXL agent name the worker declared. Later calls carry the id;
  the daemon turns it back into the agent name, and that name owns the stores
  and loads the call makes (:class:`~kvbridge.worker.offload.pool.HostPool`
  ``writer``). The table is bounded: the least recently used session goes
  first (its worker handshakes again on its next call).
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
from collections import OrderedDict
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
    """Session id -> the agent name it was opened for; at most ``max_sessions`` in all and
    ``per_agent`` per agent (a worker that reconnects in a loop drops its own old sessions,
    never another worker's)."""

    def __init__(self, max_sessions: int, per_agent: int = 4) -> None:
        if max_sessions < 1 or per_agent < 1:
            raise ConfigError(
                f"max_sessions ({max_sessions}) and per_agent ({per_agent}) must be >= 1"
            )
        self._max = max_sessions
        self._per_agent = per_agent
        self._lock = threading.Lock()
        self._agents: OrderedDict[str, str] = OrderedDict()  # least recently used first
        self._count: dict[str, int] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._agents)

    def open(self, agent: str) -> str:
        """A new session for ``agent`` (a checked name); drops the least recently used one
        of that agent if it has ``per_agent``, else of anyone if the table is full."""
        session = secrets.token_hex(16)
        with self._lock:
            if self._count.get(agent, 0) >= self._per_agent:
                oldest = next(s for s, a in self._agents.items() if a == agent)
                self._drop(oldest)
            while len(self._agents) >= self._max:
                name = self._drop(next(iter(self._agents)))
                log.info("session of %s dropped (more than %d sessions)", name, self._max)
            self._agents[session] = agent
            self._count[agent] = self._count.get(agent, 0) + 1
        return session

    def _drop(self, session: str) -> str:
        agent = self._agents.pop(session)
        left = self._count[agent] - 1
        if left:
            self._count[agent] = left
        else:
            del self._count[agent]
        return agent

    def agent(self, session: str) -> str:
        """The agent that ``session`` names; FAILED_PRECONDITION if unknown (handshake again)."""
        with self._lock:
            agent = self._agents.get(session)
            if agent is not None:
                self._agents.move_to_end(session)
                return agent
        raise ControlPlaneError(
            f"unknown session {session[:40]!r} (never opened, or dropped): handshake again",
            code="FAILED_PRECONDITION",
        )


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
