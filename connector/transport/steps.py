"""Which step of making a link is under way, so that a load that gave up waiting can say.

A link to a peer is made in steps on a handshake thread (the handshake RPC, NIXL's
``add_remote_agent``, descriptor list prep, the seal link, the warm-up READ). The link
cache (:mod:`kvbridge.connector.load.links`) keeps one :class:`LinkSteps` per link being
made and lets the code it calls name its steps with :func:`link_step` (a transport has no
handle on the link cache); a load that times out names the step that had not finished,
the ones before it and their seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["LinkSteps", "link_step", "link_steps"]

_steps = threading.local()


def link_step(step: str) -> None:
    """Say which step of making a link starts now on this thread (``connect`` says
    "NIXL add_remote_agent ...", then "descriptor list prep"), for whoever watches it
    (:func:`link_steps`); nothing when no one does."""
    sink: Callable[[str], None] | None = getattr(_steps, "sink", None)
    if sink is not None:
        sink(step)


@contextlib.contextmanager
def link_steps(sink: Callable[[str], None]) -> Iterator[None]:
    """Send this thread's :func:`link_step` calls to ``sink`` inside the block (the link
    cache names the step a link that did not finish in time was stuck in)."""
    before = getattr(_steps, "sink", None)
    _steps.sink = sink
    try:
        yield
    finally:
        _steps.sink = before


class LinkSteps:
    """Where a link being made stands: the step under way since when, and the steps done
    with their seconds. Written by the handshake thread, read by the loads waiting for it
    (a load that gives up names the step that did not finish)."""

    def __init__(self, first: str, always: str = "") -> None:
        self._always = always
        """A step :meth:`stuck` names even when it was quick (the handshake RPC: it
        answered)."""
        self._lock = threading.Lock()
        self._step, self._since = first, time.monotonic()
        self._done: list[tuple[str, float]] = []

    def enter(self, step: str) -> None:
        with self._lock:
            now = time.monotonic()
            self._done.append((self._step, now - self._since))
            self._step, self._since = step, now

    def done(self) -> str:
        """The steps finished so far and their seconds, in order."""
        with self._lock:
            return ", ".join(f"{step} {s:.3f}s" for step, s in self._done)

    def stuck(self) -> str:
        """The step under way and for how long, after the steps finished before it that
        took 10 ms or more (and the ``always`` step)."""
        with self._lock:
            before = "".join(
                f"{step} finished in {s:.2f}s, "
                for step, s in self._done
                if s >= 0.01 or step == self._always
            )
            return f"{before}{self._step} not finished after {time.monotonic() - self._since:.1f}s"
