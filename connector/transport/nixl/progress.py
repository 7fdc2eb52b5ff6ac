"""Making the NIXL agent, with NIXL's own progress thread sleeping until UCX has work.

Used by :class:`~kvbridge.connector.transport.nixl.agent.NixlAgent` only. Why the
thread: between two processes on one host UCX moves a READ's bytes with CMA, but its
active messages (NIXL notifications, so every lease release) go over TCP on loopback, and
NIXL ends every READ with an endpoint flush. After a notification to a peer, the next
READ from that peer is not done when posted: it completes only once the *peer's* worker
has been progressed (measured: 0 of 30 READs done at the post after a notification, done
after ~the peer's progress period, 2 ms with kvbridge's Python loop; 30 of 30 without a
notification before). A Python progress loop in the peer answers at its next wake-up, and
only when it gets the interpreter lock from the peer's engine thread.

NIXL's UCX backend has a native progress thread that ``poll()``\\s the UCX worker's event
file descriptor with a timeout of ``pthrDelay`` (rounded up to whole milliseconds), so it
wakes as soon as a peer's message arrives and costs nothing between messages but one
wake-up per timeout. NIXL's Python API enables it with ``pthrDelay = 0``, hard-coded, which
makes ``poll()`` return at once: the thread spins a core. :func:`new_agent` makes the agent
with the thread on and :data:`NATIVE_PROGRESS_DELAY_US` as its delay, by handing NIXL's
Python constructor a config class that keeps that delay; where NIXL's API does not have the
shape this relies on, it makes the agent without the thread (and says so).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvbridge.connector.transport.nixl.config import NixlConfig

__all__ = ["NATIVE_PROGRESS_DELAY_US", "new_agent"]

log = logging.getLogger(__name__)

NATIVE_PROGRESS_DELAY_US = 1000
"""``pthrDelay`` of NIXL's progress thread: its ``poll()`` timeout (1 ms, NIXL's smallest
non-spinning value). Events wake it at once; the timeout only bounds what UCX does not
signal. Measured idle cost: ~2 % of a core on the loaded 2-core machine; 10 ms left READ
tails of 6-8 ms (p90), 1 ms kept them under 1 ms."""

_CONSTRUCTING = threading.Lock()
"""Held while NIXL's Python constructor runs with the delay-keeping config class in place."""


def new_agent(api: Any, config: NixlConfig) -> tuple[Any, bool]:
    """A NIXL agent for ``config``, and whether NIXL's own progress thread runs in it."""
    native = config.native_progress and _can_keep_delay(api)
    if config.native_progress and not native:
        log.warning(
            "this NIXL's Python API has no nixlBind.nixlAgentConfig.pthrDelay to set: its "
            "progress thread stays off (READs after a notification wait for the peer's "
            "Python progress loop)"
        )
    agent_config = api.nixl_agent_config(
        enable_prog_thread=native, backends=list(config.backends), capture_telemetry=True
    )
    if not native:
        return api.nixl_agent(config.name, agent_config), False
    bind = api.nixlBind
    plain = bind.nixlAgentConfig

    class KeepDelay(plain):  # type: ignore[misc, valid-type]
        """NIXL's agent config, except that ``pthrDelay`` is never set below ours."""

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay":
                value = max(int(value), NATIVE_PROGRESS_DELAY_US)
            super().__setattr__(name, value)

    with _CONSTRUCTING:
        bind.nixlAgentConfig = KeepDelay
        try:
            agent = api.nixl_agent(config.name, agent_config)
        finally:
            bind.nixlAgentConfig = plain
    return agent, True


def _can_keep_delay(api: Any) -> bool:
    bind = getattr(api, "nixlBind", None)
    cls = getattr(bind, "nixlAgentConfig", None)
    return isinstance(cls, type) and hasattr(cls, "pthrDelay")
