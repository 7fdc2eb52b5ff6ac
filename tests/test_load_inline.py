"""A load driven from the engine's thread (InlineLoad): every poll returns at once, the seal
READ is posted only once every block READ landed (the proof's order), the blocks are checked
only once their digests arrived, and a failure or a passed deadline leaves nothing in flight."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvbridge.connector import BlockLoad
from kvbridge.connector.control.seal import SEAL_WAIT_S
from kvbridge.connector.load import Attempt, InlineLoad
from kvbridge.connector.load.verify import Checked
from kvbridge.proto import BlockId, KVGroup, RequestId, TransferError, TransferTimeoutError


class Handle:
    """A READ that is pending for ``polls`` polls, then done (or failed)."""

    def __init__(self, log: list[str], name: str, polls: int, fail: bool = False) -> None:
        self.log, self.name, self.left, self.fail = log, name, polls, fail
        self.released = 0

    def poll(self) -> str:
        if self.left > 0:
            self.left -= 1
            return "pending"
        return "failed" if self.fail else "done"

    def wait(self, timeout_s: float | None = None) -> None:
        if self.poll() == "failed":
            raise TransferError(f"{self.name} failed (test)")

    def release(self) -> None:
        self.released += 1
        self.log.append(f"release {self.name}")

    nbytes, num_descriptors, wire_descriptors, backend_seconds = 64, 1, 1, 1e-4
    backend_post_seconds = 1e-4


class Transport:
    def __init__(self, polls: int, fail: str = "") -> None:
        self.log: list[str] = []
        self.handles: list[Handle] = []
        self.polls, self.fail = polls, fail

    def read_blocks(self, link: Any, group: str, local: Any, remote: Any, **kw: Any) -> Handle:
        name = f"{link}/{group}"
        self.log.append(f"post {name}")
        self.handles.append(Handle(self.log, name, self.polls, name == self.fail))
        return self.handles[-1]


class SealCheck:
    """Seal READs in rounds, each over after ``polls`` polls: round ``k`` (from 1) finds every
    seal ``held`` once ``k > sealed_after`` (an owner that seals the lease a step after
    naming it), before that none; one not held counts as not sealed yet (absent), read
    again (``again``) until ``until``."""

    def __init__(
        self, log: list[str], held: list[bool], polls: int, sealed_after: int, until: float
    ) -> None:
        self.log, self.held, self.polls, self.left = log, held, polls, polls
        self.sealed_after, self.until = sealed_after, until
        self.rounds, self.closed = 1, 0

    def poll(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return False
        return True

    def settle(self, tag: bytes | None = None, *, tagged: bool = False) -> list[bool] | None:
        assert self.left == 0, "judged before the seal READ was over"
        self.log.append(f"verdict {tag!r} {tagged}")
        early = self.rounds <= self.sealed_after
        held = [False] * len(self.held) if early else self.held
        return held if all(held) or time.monotonic() >= self.until else None

    def again(self) -> None:
        assert self.left == 0 and not self.closed, "read again while in flight or closed"
        self.log.append("seal again")
        self.rounds, self.left = self.rounds + 1, self.polls

    def close(self) -> None:
        self.closed += 1


class Seals:
    """Seal READs: each round says ``held`` after ``polls`` polls (``sealed_after``: not
    before that many rounds, as an owner that seals the lease a step after naming it)."""

    def __init__(
        self, log: list[str], held: list[bool], polls: int = 2, sealed_after: int = 0
    ) -> None:
        self.log, self.held, self.polls, self.sealed_after = log, held, polls, sealed_after
        self.checks: list[SealCheck] = []
        self.waits: list[float] = []

    def post(
        self, links: list[Any], lease: str, seal: bytes, timeout_s: float, wait_s: float = 0.0
    ) -> SealCheck:
        self.log.append(f"seal {links}")
        self.waits.append(wait_s)
        until = time.monotonic() + wait_s
        self.checks.append(SealCheck(self.log, self.held, self.polls, self.sealed_after, until))
        return self.checks[-1]


class Digests:
    """Stands in for Expected: ready after ``polls`` asks; records each check."""

    by_seal = False

    def __init__(self, log: list[str], polls: int) -> None:
        self.log, self.left = log, polls

    def ready(self) -> bool:
        self.left -= 1
        return self.left < 0

    def check(self, layout: Any, group: KVGroup, ids: list[BlockId]) -> Checked:
        assert self.left < 0, "checked before the digests arrived"
        self.log.append(f"check {group}")
        return Checked(len(ids), 0)


class Peer:
    def __init__(self, name: str) -> None:
        self.link, self.seal_link = name, f"{name}-seal"


def _inline(
    transport: Transport, seals: Seals, ranks: int = 1, digests: int | None = None, t: float = 5.0
) -> InlineLoad:
    ids = {KVGroup.SELF: [BlockId(1), BlockId(2)], KVGroup.CROSS: [BlockId(3)]}
    load = BlockLoad(RequestId("r"), "p", "a:1", ids, ids, "c" * 32, seal=b"s" * 32)
    job = Attempt(load)
    if digests is not None:
        job.expected = Digests(transport.log, digests)  # type: ignore[assignment]
    peers: list[Any] = [Peer(f"r{i}") for i in range(ranks)]
    inline = InlineLoad(job, peers, seals, None, t)  # type: ignore[arg-type]
    inline.post(transport)  # type: ignore[arg-type]
    return inline


def _run(inline: InlineLoad) -> int:
    """Poll until done; the number of polls that said "not yet"."""
    pending, t0 = 0, time.monotonic()
    while not inline.poll():
        pending += 1
        assert time.monotonic() - t0 < 2.0
    return pending


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_seal_is_read_only_after_every_block_read_landed(ranks: int) -> None:
    transport = Transport(polls=3)
    seals = Seals(transport.log, [True] * ranks)
    inline = _inline(transport, seals, ranks=ranks, digests=4)
    posts = [e for e in transport.log if e.startswith("post")]
    assert len(posts) == 2 * ranks and transport.log == posts  # all posted, none waited for
    assert _run(inline) >= 3
    seal_at = transport.log.index(f"seal {[f'r{i}-seal' for i in range(ranks)]}")
    releases = [i for i, e in enumerate(transport.log) if e.startswith("release")]
    assert len(releases) == 2 * ranks and max(releases) < seal_at
    assert all(h.left == 0 for h in transport.handles)  # every READ was seen done first
    assert inline.held == [True] * ranks and inline.reads is not None
    assert inline.checked == {KVGroup.SELF: Checked(2, 0), KVGroup.CROSS: Checked(1, 0)}
    assert seals.checks[0].closed == 1
    steps = [s for s, _ in inline.job.steps]
    assert steps[:3] == ["start", "post", "reads"] and "seal" in steps and "check" in steps


def test_blocks_are_checked_only_once_their_digests_arrived() -> None:
    transport = Transport(polls=0)
    seals = Seals(transport.log, [True], polls=0)
    inline = _inline(transport, seals, digests=6)
    assert _run(inline) >= 1  # READs and seal done, the digests not yet
    assert [e for e in transport.log if e.startswith("check")] == ["check self", "check cross"]


def test_a_seal_that_does_not_hold_leaves_the_blocks_unchecked() -> None:
    transport = Transport(polls=1)
    seals = Seals(transport.log, [False], polls=1)
    inline = _inline(transport, seals, digests=10**9)
    t0 = time.monotonic()
    _run(inline)
    assert inline.held == [False] and inline.checked is None
    # read again first, for SEAL_WAIT_S, in the same check (its scratch slots)
    assert seals.waits == [SEAL_WAIT_S] and time.monotonic() - t0 >= SEAL_WAIT_S
    assert len(seals.checks) == 1 and seals.checks[0].rounds > 1
    assert all(c.closed == 1 for c in seals.checks)


def test_a_seal_made_a_step_after_the_answer_is_read_again_and_holds() -> None:
    transport = Transport(polls=1)
    seals = Seals(transport.log, [True], polls=0, sealed_after=3)
    inline = _inline(transport, seals, digests=2)
    _run(inline)
    assert inline.held == [True] and len(seals.checks) == 1 and seals.checks[0].rounds == 4
    assert inline.checked == {KVGroup.SELF: Checked(2, 0), KVGroup.CROSS: Checked(1, 0)}
    # the seal is only ever read after every block READ landed
    first_seal = next(i for i, e in enumerate(transport.log) if e.startswith("seal"))
    assert all(h.left == 0 for h in transport.handles) and first_seal > 2


def test_a_failed_read_raises_and_leaves_nothing_in_flight() -> None:
    transport = Transport(polls=1, fail="r0/cross")
    seals = Seals(transport.log, [True])
    inline = _inline(transport, seals)
    with pytest.raises(TransferError, match="r0/cross failed"):
        _run(inline)
    inline.close()
    assert all(h.released >= 1 for h in transport.handles) and not seals.checks


def test_a_load_past_its_deadline_fails_without_blocking() -> None:
    transport = Transport(polls=10**9)
    seals = Seals(transport.log, [True])
    inline = _inline(transport, seals, t=0.05)
    t0 = time.perf_counter()
    assert inline.poll() is False
    assert time.perf_counter() - t0 < 0.04  # a poll returns at once
    time.sleep(0.06)
    with pytest.raises(TransferTimeoutError, match="did not finish"):
        inline.poll()
    inline.close()
    assert all(h.released == 1 for h in transport.handles)


def test_a_poll_spins_only_until_its_deadline() -> None:
    transport = Transport(polls=10**9)
    inline = _inline(transport, Seals(transport.log, [True]))
    t0 = time.perf_counter()
    assert inline.poll(spin_until=t0 + 0.01) is False
    assert 0.01 <= time.perf_counter() - t0 < 0.5
    inline.close()


class Tagged(Digests):
    """Stands in for an Expected proved by the seal's content tag (no digests to fetch)."""

    by_seal = True

    def landed(self, layout: Any, group: KVGroup, ids: list[BlockId]) -> list[bytes]:
        self.log.append(f"landed {group}")
        return [b"d%d" % i for i in ids]

    def tag(self, load: Any, layout: Any, landed: dict[KVGroup, list[bytes]]) -> bytes:
        return b"tag:" + b"".join(d for g in sorted(landed) for d in landed[g])


def test_a_load_proved_by_the_seal_tag_judges_the_seal_with_the_tag_of_what_landed() -> None:
    transport = Transport(polls=1)
    seals = Seals(transport.log, [True], polls=1)
    inline = _inline(transport, seals)
    inline.job.expected = Tagged(transport.log, 0)  # type: ignore[assignment]
    inline._by_seal = True
    _run(inline)
    log = transport.log
    verdict = next(e for e in log if e.startswith("verdict"))
    assert verdict == "verdict b'tag:d3d1d2' True"  # cross then self, as the owner sorts
    assert log.index("landed self") < log.index(verdict)
    assert not [e for e in log if e.startswith("check")]  # nothing compared with digests
    assert inline.checked == {KVGroup.SELF: Checked(2, 0), KVGroup.CROSS: Checked(1, 0)}
