"""The seal's content tag: what an owner that keeps its blocks' digests writes into the last
16 bytes of a lease's seal slot, and what a reader that read every leased block recomputes
(the NIXL round trip itself is in ``test_tp_ranks.py`` and ``test_attack_nixl_write.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvbridge.connector.control.seal import (
    SEAL_BYTES,
    TAG_BYTES,
    SealTable,
    content_tag,
    expected_seal,
    probe_slots,
    seal_digest,
)
from kvbridge.connector.control.seal_reader import RELEASE_DEFER_S, SealReader
from kvbridge.kernels import ALGO_DEVICE, ALGO_XXH3, new_key
from kvbridge.proto import BlockHash, BlockId, KVGroup

LEASE = "ab" * 16
SEAL = seal_digest(
    {KVGroup.SELF: [BlockId(3), BlockId(1)]}, {KVGroup.SELF: [BlockHash(b"a" * 16)] * 2}
)
DIGESTS = {KVGroup.SELF: [b"\x01" * 16, b"\x02" * 16], KVGroup.G0: [b"\x03" * 16]}


def test_the_tag_depends_on_the_key_lease_seal_algorithm_and_every_digest() -> None:
    key = new_key()
    tag = content_tag(LEASE, SEAL, key, ALGO_XXH3, DIGESTS)
    assert len(tag) == TAG_BYTES and tag == content_tag(LEASE, SEAL, key, ALGO_XXH3, DIGESTS)
    changed = [
        content_tag(LEASE, SEAL, key ^ 1, ALGO_XXH3, DIGESTS),
        content_tag("cd" * 16, SEAL, key, ALGO_XXH3, DIGESTS),
        content_tag(LEASE, bytes(32), key, ALGO_XXH3, DIGESTS),
        content_tag(LEASE, SEAL, key, ALGO_DEVICE, DIGESTS),
        content_tag(LEASE, SEAL, key, ALGO_XXH3, {**DIGESTS, KVGroup.G0: [b"\x04" * 16]}),
        # the same digests in another order, or one group's moved to another group
        content_tag(LEASE, SEAL, key, ALGO_XXH3, {**DIGESTS, KVGroup.SELF: DIGESTS["self"][::-1]}),
        content_tag(LEASE, SEAL, key, ALGO_XXH3, {KVGroup.SELF: DIGESTS["self"] + DIGESTS["g0"]}),
    ]
    assert tag not in changed and len(set(changed)) == len(changed)


def test_groups_without_blocks_and_the_groups_order_do_not_change_the_tag() -> None:
    key = new_key()
    tag = content_tag(LEASE, SEAL, key, ALGO_XXH3, DIGESTS)
    reordered = {KVGroup.G0: DIGESTS["g0"], KVGroup.SELF: DIGESTS["self"], KVGroup.CROSS: []}
    assert content_tag(LEASE, SEAL, key, ALGO_XXH3, reordered) == tag


def test_a_tagged_seal_fills_the_slot_and_an_untagged_one_leaves_zeros() -> None:
    key = new_key()
    tag = content_tag(LEASE, SEAL, key, ALGO_XXH3, DIGESTS)
    table = SealTable(64)
    assert table.publish(LEASE, SEAL, tag)
    (slot,) = [s for s in probe_slots(LEASE, 64) if table._slots[s].any()]
    written = table._slots[slot].numpy().tobytes()
    assert written == expected_seal(LEASE, SEAL, tag) and len(written) == SEAL_BYTES
    assert written[:16] == bytes.fromhex(LEASE) and written[16:48] == SEAL and written[48:] == tag
    table.retract(LEASE)
    assert not table._slots.any()
    assert expected_seal(LEASE, SEAL).endswith(bytes(TAG_BYTES))


@pytest.mark.parametrize("tag", [b"\x00" * 15, b"\x00" * 17, b"x"])
def test_a_tag_of_the_wrong_length_is_refused(tag: bytes) -> None:
    with pytest.raises(ValueError):
        expected_seal(LEASE, SEAL, tag)
    assert not SealTable(8).publish(LEASE, SEAL, tag)


class _FakeOwnerLink:
    """A transport whose READs copy an owner's seal table into the reader's scratch slots
    (the seal protocol's comparisons, without NIXL)."""

    def __init__(self, table: SealTable) -> None:
        self.table, self.reads = table, 0
        self.reader: SealReader | None = None
        self.reads_by: dict[str, int] = {}
        """READs per owner (``connect``'s name)."""

    def register(self, layout: Any, caches: Any) -> Any:
        return SimpleNamespace(layout=layout)

    def connect(self, name: str, metadata: bytes, seal: Any, memory: Any) -> Any:
        """A link to ``self.table``, or to ``metadata``'s table if it is one (another owner)."""
        table = metadata if isinstance(metadata, SealTable) else self.table
        return SimpleNamespace(remote_layout=seal, name=name, table=table)

    def read_blocks(self, link: Any, group: Any, local: Any, remote: Any, **_: Any) -> Any:
        assert self.reader is not None
        self.reads += 1
        self.reads_by[link.name] = self.reads_by.get(link.name, 0) + 1
        for mine, theirs in zip(local, remote, strict=True):
            self.reader._slots[mine] = link.table._slots[theirs]
        return SimpleNamespace(  # copied at once: done when posted
            wait=lambda timeout_s: None, release=lambda: None, poll=lambda: "done"
        )


def _reader(table: SealTable) -> tuple[SealReader, _FakeOwnerLink, Any]:
    fake = _FakeOwnerLink(table)
    reader = SealReader(fake, 1)  # type: ignore[arg-type]
    fake.reader = reader
    return reader, fake, reader.connect("owner", b"", table.layout)


def test_a_seal_written_after_the_first_read_is_waited_for_then_holds() -> None:
    """vLLM's worker makes the lease an engine step after its scheduler handed out the id: a
    reader that finds no slot with the lease's nonce READs again until ``wait_s``."""
    key, table = new_key(), SealTable(64)
    tag = content_tag(LEASE, SEAL, key, ALGO_XXH3, DIGESTS)
    reader, fake, link = _reader(table)
    late = threading.Timer(0.05, table.publish, (LEASE, SEAL, tag))
    late.start()
    try:
        assert reader.holds(link, LEASE, SEAL, 1.0, tag=lambda: tag, wait_s=5.0)
    finally:
        late.join()
    assert fake.reads > 1
    # without waiting, the same race is the slow path
    table.retract(LEASE)
    assert not reader.holds(link, LEASE, SEAL, 1.0, tag=lambda: tag)


def test_a_slot_with_the_nonce_but_another_tag_is_an_answer_at_once() -> None:
    key, table = new_key(), SealTable(64)
    tag = content_tag(LEASE, SEAL, key, ALGO_XXH3, DIGESTS)
    table.publish(LEASE, SEAL, tag)
    reader, fake, link = _reader(table)
    assert reader.holds(link, LEASE, SEAL, 1.0, tag=lambda: tag, wait_s=5.0)
    other = content_tag(LEASE, SEAL, key ^ 1, ALGO_XXH3, DIGESTS)  # junk landed, or no key
    t0 = time.monotonic()
    assert not reader.holds(link, LEASE, SEAL, 1.0, tag=lambda: other, wait_s=5.0)
    assert not reader.holds(link, LEASE, SEAL, 1.0, tag=lambda: None, wait_s=5.0)
    assert not reader.holds(link, LEASE, bytes(32), 1.0, wait_s=5.0)  # another seal
    assert time.monotonic() - t0 < 2.0 and fake.reads == 4
    # a reader that checks no tag compares the nonce and the seal digest only
    assert reader.holds(link, LEASE, SEAL, 1.0)


def test_no_seal_at_all_is_the_slow_path_after_the_wait() -> None:
    reader, fake, link = _reader(SealTable(64))
    t0 = time.monotonic()
    assert not reader.holds(link, LEASE, SEAL, 1.0, wait_s=0.1)
    assert 0.09 <= time.monotonic() - t0 < 2.0 and fake.reads > 1


def test_only_an_owner_that_has_not_sealed_yet_is_read_again() -> None:
    """Several owners (TP ranks): each one whose slots hold no nonce yet is READ again, the
    others keep their first answer, and every answer comes from one SealReader mechanism."""
    early, late, other = SealTable(64), SealTable(64), SealTable(64)
    early.publish(LEASE, SEAL)
    other.publish(LEASE, bytes(32))  # the nonce with another seal: an answer at once
    reader, fake, _ = _reader(early)
    links = [
        reader.connect(name, table, table.layout)  # type: ignore[arg-type]
        for name, table in (("early", early), ("late", late), ("other", other))
    ]
    sealing = threading.Timer(0.05, late.publish, (LEASE, SEAL))
    sealing.start()
    try:
        assert reader.holds_all(links[:2], LEASE, SEAL, 1.0, wait_s=5.0) == [True, True]
    finally:
        sealing.join()
    assert fake.reads_by["early"] == 1 and fake.reads_by["late"] > 1
    t0 = time.monotonic()
    assert reader.holds_all(links, LEASE, SEAL, 1.0, wait_s=5.0) == [True, True, False]
    assert time.monotonic() - t0 < 2.0 and fake.reads_by["other"] == 1
    # an owner that never seals: read again until the wait is over, then not held
    late.retract(LEASE)
    t0 = time.monotonic()
    assert reader.holds_all(links[:2], LEASE, SEAL, 1.0, wait_s=0.1) == [True, False]
    assert 0.09 <= time.monotonic() - t0 < 2.0 and fake.reads_by["early"] == 3


class _Flushable(_FakeOwnerLink):
    """:class:`_FakeOwnerLink` whose READs stay in flight until ``land()``, and that records
    notifications."""

    def __init__(self, table: SealTable) -> None:
        super().__init__(table)
        self.sent: list[bytes] = []
        self.handles: list[Any] = []

    def send_notification(self, link: Any, message: bytes) -> None:
        self.sent.append(message)

    def read_blocks(self, link: Any, group: Any, local: Any, remote: Any, **_: Any) -> Any:
        self.reads += 1
        handle = SimpleNamespace(state="pending", released=0)
        handle.poll = lambda: handle.state
        handle.release = lambda: setattr(handle, "released", handle.released + 1)
        self.handles.append(handle)
        return handle


def test_a_release_leaves_one_flush_read_per_link_in_flight_and_reaps_it_once_over() -> None:
    """After a release notification the reader posts a one-slot READ on the link (it takes
    UCX's flush wait after a notification off the next load's READ), never two at once on
    one link, and gives its scratch slot back only once it is over (never releasing one in
    flight, which would take the link down)."""
    table = SealTable(64)
    fake = _Flushable(table)
    reader = SealReader(fake, 1)  # type: ignore[arg-type]
    fake.reader = reader
    link = SimpleNamespace(remote_layout=table.layout, link_id=7)
    free = len(reader._free)
    reader.release(link, LEASE)  # type: ignore[arg-type]
    reader.release(link, LEASE)  # type: ignore[arg-type]
    assert len(fake.sent) == 2 and fake.reads == 1 and len(reader._free) == free - 1
    reader._reap()
    assert fake.handles[0].released == 0 and len(reader._free) == free - 1  # in flight
    fake.handles[0].state = "done"
    reader._reap()
    assert fake.handles[0].released == 1 and len(reader._free) == free
    reader.release(link, LEASE)  # type: ignore[arg-type]
    assert fake.reads == 2  # the next release flushes again


def test_a_deferred_release_waits_for_the_loads_in_flight_but_not_forever() -> None:
    """A proven inline load's release goes out after the load was reported (off its timed
    path); while other loads are in flight it is held back (its notification would make
    their seal READs wait for the owner), but at most RELEASE_DEFER_S; none is lost."""
    table = SealTable(64)
    fake = _Flushable(table)
    reader = SealReader(fake, 1)  # type: ignore[arg-type]
    fake.reader = reader
    link = SimpleNamespace(remote_layout=table.layout, link_id=7)
    reader.defer_release(link, LEASE)  # type: ignore[arg-type]
    assert fake.sent == []  # nothing on the load's own path
    reader.send_deferred(loads_in_flight=True)
    assert fake.sent == []  # others in flight: held back
    reader.send_deferred(loads_in_flight=False)
    assert len(fake.sent) == 1 and fake.reads == 1  # the notification and its flush READ
    reader.send_deferred()
    assert len(fake.sent) == 1  # sent once
    other = "d" * 32
    reader.defer_release(link, other)  # type: ignore[arg-type]
    reader.defer_release(link, LEASE)  # type: ignore[arg-type]
    time.sleep(RELEASE_DEFER_S * 1.5)
    reader.send_deferred(loads_in_flight=True)  # held back long enough: sent anyway
    assert len(fake.sent) == 3 and other.encode() in fake.sent[1]
