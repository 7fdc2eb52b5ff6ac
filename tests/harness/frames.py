"""Length-prefixed msgpack frames between a test and a helper process, and the helper's loop.

A frame is a 4-byte big-endian length and a msgpack map. The helper prints one
``READY {json}`` line first (what :class:`kvbridge.worker.ChildProcess` waits for),
then answers each request ``{"op": NAME, **kwargs}`` with ``{"ok": True, ...}`` or
``{"ok": False, "error": <type name>, "message": ...}``.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
from collections.abc import Callable
from typing import IO, Any

import msgpack

MAX_FRAME = 1 << 30


def read_frame(stream: IO[bytes]) -> Any:
    """The next frame's object, or ``None`` at end of stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    assert n <= MAX_FRAME, f"frame of {n} bytes"
    body = stream.read(n)
    if len(body) < n:
        return None
    return msgpack.unpackb(body, raw=False)


def write_frame(stream: IO[bytes], obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def serve_ops(make_handler: Callable[[], object], name: str) -> None:
    """The helper side: build the handler, print ``READY {"name", "pid"}``, then call
    ``handler.op_<op>(**kwargs)`` per frame until stdin ends or after ``close``."""
    # keep the frame channel private: libraries that print to fd 1 go to stderr instead
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    handler = make_handler()
    out.write(f"READY {json.dumps({'name': name, 'pid': os.getpid()})}\n".encode())
    out.flush()
    stdin = sys.stdin.buffer
    while (req := read_frame(stdin)) is not None:
        op = req.pop("op")
        try:
            reply = {"ok": True, **getattr(handler, f"op_{op}")(**req)}
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        write_frame(out, reply)
        if op == "close":
            break
