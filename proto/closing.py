"""``Closing``: the ``with`` protocol for every kvbridge object that holds something to close.

A class that owns a server, a channel, a child process or registered memory
defines an idempotent ``close()`` and inherits ``with obj: ...`` from here,
instead of repeating ``__enter__``/``__exit__``.
"""

from __future__ import annotations

from typing import Self

__all__ = ["Closing"]


class Closing:
    """``with obj:`` returns ``obj`` and calls ``obj.close()`` on the way out."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
