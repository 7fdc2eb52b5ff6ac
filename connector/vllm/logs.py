"""kvbridge's log lines in vLLM's output (vLLM configures only its own loggers).

No vLLM import: :func:`follow_vllm_logging` hands the ``kvbridge`` logger the
handlers vLLM configured on its ``vllm`` logger (same stream, same format),
once per process, when the connector is built.
"""

from __future__ import annotations

import logging

__all__ = ["follow_vllm_logging"]


def follow_vllm_logging(source: str = "vllm", target: str = "kvbridge") -> bool:
    """Make ``target``'s records go where ``source``'s go; True if this call attached them.

    Idempotent and never duplicating a line: nothing is done when ``target``
    already has a handler (attached earlier, or configured by the operator) or
    ``source`` has none (vLLM's logging is off, ``VLLM_CONFIGURE_LOGGING=0``).
    Like vLLM's own logger, ``target`` then stops propagating to the root
    logger, so a root handler does not print each line twice. Its level is
    ``source``'s unless the operator set one.
    """
    src = logging.getLogger(source)
    dst = logging.getLogger(target)
    handlers = list(src.handlers)
    if dst.handlers or not handlers:
        return False
    for handler in handlers:
        dst.addHandler(handler)
    if dst.level == logging.NOTSET:
        dst.setLevel(src.getEffectiveLevel())
    dst.propagate = False
    return True
