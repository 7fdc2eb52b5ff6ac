"""A load posts every READ it needs before it waits for the first, and a failed READ
releases every other handle before its error comes back."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.connector.load import ReadRequest, post_reads
from kvbridge.connector.transport import TransferOp, Transport
from kvbridge.proto import BlockId, KVGroup, TransferError


class Handle:
    """Stands in for a TransferHandle: records its wait and release in the shared log."""

    def __init__(self, log: list[str], name: str, fail: bool) -> None:
        self.log, self.name, self.fail = log, name, fail
        self.released = 0

    def wait(self, timeout_s: float | None = None) -> None:
        self.log.append(f"wait {self.name}")
        if self.fail:
            raise TransferError(f"{self.name} failed (test)")

    def release(self) -> None:
        self.released += 1

    nbytes = 64
    num_descriptors = 1
    wire_descriptors = 1
    backend_seconds = 1e-4
    backend_post_seconds = 1e-4


class Posts:
    """Stands in for the transport: every read_blocks is a post in the log."""

    def __init__(self, fail: str = "") -> None:
        self.log: list[str] = []
        self.handles: list[Handle] = []
        self.fail = fail

    def read_blocks(self, link: Any, group: str, local: Any, remote: Any, **kw: Any) -> Handle:
        name = f"{link}/{group}"
        self.log.append(f"post {name}")
        self.handles.append(Handle(self.log, name, name == self.fail))
        return self.handles[-1]


def _requests() -> list[ReadRequest]:
    ids = [BlockId(1), BlockId(2)]
    links: list[Any] = ["r0", "r1"]
    return [ReadRequest(link, g, ids, ids) for link in links for g in (KVGroup.SELF, KVGroup.CROSS)]


def test_every_read_of_a_load_is_posted_before_the_first_wait() -> None:
    posts = Posts()
    figures = post_reads(posts, _requests(), 1.0)  # type: ignore[arg-type]
    assert [e.split()[0] for e in posts.log] == ["post"] * 4 + ["wait"] * 4
    assert len(figures) == 4 and all(f.nbytes == 64 for f in figures)
    assert all(h.released == 1 for h in posts.handles)


def test_a_failed_read_releases_every_handle_and_raises() -> None:
    posts = Posts(fail="r0/cross")
    with pytest.raises(TransferError, match="r0/cross failed"):
        post_reads(posts, _requests(), 1.0)  # type: ignore[arg-type]
    assert len(posts.handles) == 4 and all(h.released == 1 for h in posts.handles)


class Ops(Transport):
    """A transport that implements only the seam's abstract methods and records each op."""

    def __init__(self) -> None:
        self.ops: list[TransferOp] = []

    def transfer(self, op: TransferOp) -> Any:
        self.ops.append(op)
        return op

    register = unregister = metadata = connect = disconnect = None  # type: ignore[assignment]
    send_notification = poll_notifications = close = None  # type: ignore[assignment]


def test_the_transport_seam_is_one_transfer_op_plus_links_registration_and_notifications() -> None:
    assert Transport.__abstractmethods__ == {
        "register",
        "unregister",
        "metadata",
        "connect",
        "disconnect",
        "transfer",
        "send_notification",
        "poll_notifications",
        "close",
    }
    t = Ops()
    ids = [BlockId(3)]
    t.read_blocks("link", KVGroup.SELF, ids, ids, timeout_s=2.0)  # type: ignore[arg-type]
    t.write_blocks("link", KVGroup.CROSS, ids, [BlockId(4)], notify=b"n", timeout_s=1.0)  # type: ignore[arg-type]
    assert [(o.kind, o.group, o.remote_ids, o.notify, o.timeout_s) for o in t.ops] == [
        ("READ", "self", ids, None, 2.0),
        ("WRITE", "cross", [BlockId(4)], b"n", 1.0),
    ]
