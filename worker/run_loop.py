"""How every long-running ``kvbridge`` command runs: start, say so, serve until stopped, stop.

``kvbridge serve``, ``kvbridge serve-control`` and ``kvbridge offload serve`` differ in
what they start and in the line they print once it serves; :func:`serve_until_stopped`
is the rest, the same for each: SIGTERM and SIGINT (Ctrl-C) ask for a clean stop
(exit status 0), everything the command started is closed in reverse order (also when
starting fails half way), and the previous signal handlers are restored. Nothing heavy
is imported here.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

__all__ = ["Ready", "command_main", "serve_until_stopped"]

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the waiting main thread wakes (a signal handler runs between two waits)."""


@dataclass(frozen=True, slots=True)
class Ready:
    """What a started command says: ``line`` on stdout (and in the ready file), ``name``
    in the log line when it stops."""

    line: str
    name: str


def serve_until_stopped(
    start: Callable[[ExitStack], Ready], *, ready_file: Path | None = None
) -> int:
    """Run ``start`` (it enters what it starts into the stack), print its ready line
    (flushed: a parent reads it), write it to ``ready_file`` atomically when given,
    then wait for SIGTERM or SIGINT and close everything. Returns the exit status."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with ExitStack() as stack:
            ready = start(stack)
            print(ready.line, flush=True)
            if ready_file is not None:
                tmp = ready_file.with_suffix(".tmp")
                tmp.write_text(ready.line)
                tmp.rename(ready_file)
            while not stop.wait(POLL_S):
                pass
            log.info("%s stopping", ready.name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def command_main(
    add_parser: Callable[[argparse._SubParsersAction], None],  # type: ignore[type-arg]
    command: Sequence[str],
    argv: Sequence[str] | None,
) -> int:
    """``python -m <module> ARGS``: parse ``command + ARGS`` with the module's parser, log
    at INFO, run the command (the same as ``kvbridge <command> ARGS``)."""
    parser = argparse.ArgumentParser(prog="kvbridge")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([*command, *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    code: int = args.func(args)
    return code
