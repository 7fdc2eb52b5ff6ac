"""``kvbridge bench offload --disk DIR``: the disk tier's demote/promote GB/s against a plain
sequential write/read of the same bytes to a file in the same directory, same run.

In process, on the daemon's own code (:class:`~kvbridge.worker.offload.DiskTier`): *demote* is
one ``put`` of every block (``pwritev`` per block into its slab slot, ``fdatasync``, the index
records, ``fsync``), as one PrepareStore's evictions; *promote* is ``reserve``, a ``preadv``
per block into host memory and the daemon's digest check (keyed XXH3-128) of each, then
``settle``. The baseline writes the same bytes to one file with ``write`` and ``fsync``, and
reads them back with ``readinto``. Before every read the page cache of the file read is
dropped (``posix_fadvise(DONTNEED)`` after the data was synced), so reads come from the disk
(the JSON says whether the kernel honoured it: ``cache_dropped``). The gRPC and NIXL legs of a
real demotion or promotion are measured by the other rows of ``bench offload``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from typing import Any

__all__ = ["disk_case"]

MiB = 2**20


def _drop_cache(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (AttributeError, OSError):
        return False
    finally:
        os.close(fd)


def _plain(path: str, data: memoryview, out: memoryview) -> tuple[float, float, bool]:
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.write(data)
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    dropped = _drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(out)
    read_s = time.perf_counter() - t0
    assert got == len(data)
    os.unlink(path)
    return write_s, read_s, dropped


def _tier(
    directory: str, data: memoryview, out: memoryview, block: int, tag: str
) -> tuple[float, float, bool]:
    import xxhash

    from kvbridge.proto.types import BlockHash
    from kvbridge.worker.offload import DiskTier

    n = len(data) // block
    path = os.path.join(directory, "tier")
    shutil.rmtree(path, ignore_errors=True)
    tier = DiskTier.open(path, n * block, block, b"bench")
    try:
        keys = [BlockHash(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]
        digests = [
            xxhash.xxh3_128(data[i * block : (i + 1) * block], seed=7).digest() for i in range(n)
        ]
        blocks = [
            (k, (7, d), [data[i * block : (i + 1) * block]])
            for i, (k, d) in enumerate(zip(keys, digests, strict=True))
        ]
        t0 = time.perf_counter()
        tier.put(blocks)
        demote_s = time.perf_counter() - t0
        dropped = _drop_cache(os.path.join(path, "slab"))
        t0 = time.perf_counter()
        entries = tier.reserve(keys)
        views = [out[i * block : (i + 1) * block] for i in range(len(entries))]
        tier.read([(slot, [v]) for (_, slot, _), v in zip(entries, views, strict=True)])
        for (_, _, (dkey, digest)), view in zip(entries, views, strict=True):
            if xxhash.xxh3_128(view, seed=dkey).digest() != digest:
                raise AssertionError("bench: a block read back from the disk tier differs")
        tier.settle(keys, [])
        promote_s = time.perf_counter() - t0
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    return demote_s, promote_s, dropped


def disk_case(
    directory: str, block_bytes: int, mib: int, repeats: int, label: str
) -> dict[str, Any]:
    """One row: best of ``repeats`` of each, alternating which of tier/plain goes first."""
    n = max(1, mib * MiB // block_bytes)
    nbytes = n * block_bytes
    src = bytearray(os.urandom(nbytes))
    dst = bytearray(nbytes)
    data, out = memoryview(src), memoryview(dst)
    work = tempfile.mkdtemp(prefix="kvbridge-bench-disk-", dir=directory)
    best = {
        "demote": float("inf"),
        "promote": float("inf"),
        "write": float("inf"),
        "read": float("inf"),
    }
    dropped = True
    try:
        for r in range(repeats):
            order = ("tier", "plain") if r % 2 == 0 else ("plain", "tier")
            for which in order:
                if which == "tier":
                    w, rd, ok = _tier(work, data, out, block_bytes, f"{label}-{r}")
                    best["demote"], best["promote"] = (
                        min(best["demote"], w),
                        min(best["promote"], rd),
                    )
                else:
                    w, rd, ok = _plain(os.path.join(work, "plain"), data, out)
                    best["write"], best["read"] = min(best["write"], w), min(best["read"], rd)
                dropped = dropped and ok
                if src != dst:
                    raise AssertionError("bench: the bytes read back differ from those written")
                out[:] = bytes(nbytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gbps = {k: nbytes / v / 1e9 for k, v in best.items()}
    return {
        "case": label,
        "block_kib": block_bytes / 1024,
        "blocks": n,
        "mib": nbytes / MiB,
        "demote_gbps": gbps["demote"],
        "plain_write_gbps": gbps["write"],
        "promote_gbps": gbps["promote"],
        "plain_read_gbps": gbps["read"],
        "demote_over_write": gbps["demote"] / gbps["write"],
        "promote_over_read": gbps["promote"] / gbps["read"],
        "cache_dropped": dropped,
    }
