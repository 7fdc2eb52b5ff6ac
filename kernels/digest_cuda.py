"""The device block digest (``ALGO_DEVICE`` of :mod:`kvbridge.kernels.digest`): computed where
CUDA KV lives, no host copy.

XXH3 (:mod:`kvbridge.kernels.digest`) is a sequential byte hash: fine on a CPU
core, a poor fit for thousands of GPU threads. CUDA memory is digested with a
keyed two-level multilinear hash instead, whose sums can be taken in any order
(addition mod 2**64), so a block's chunks are hashed in parallel on the device
and only 16 bytes per block come back. :func:`reference_digests` computes the
same digests on the CPU (numpy), so a CPU reader verifies a GPU writer and the
other way round.

The algorithm ``kvb-mlh32x4``, over one block's byte stream (its spans in
:meth:`KVLayout.block_spans` order, as for XXH3: every layout of a model gives
the same digest for the same KV):

- ``splitmix64`` is the usual 64-bit mixer; all arithmetic is mod 2**64.
- The stream is cut into chunks of ``chunk_bytes`` = the lowest set bit of the
  layout's span length, at most 1 KiB (so a chunk never straddles two spans in
  any layout); a chunk is ``w = chunk_bytes / 4`` little-endian 32-bit words.
- Four lanes ``l``. Level 1: ``K[l][t] = splitmix64(b1 + (256 l + t) G)`` with
  ``b1 = splitmix64(key ^ D1)``; chunk ``j``'s value in lane ``l`` is
  ``v = (sum_t K[l][t] * word_t) >> 32``.
- Level 2: ``C(l, j) = splitmix64(b2[l] + j G)`` with ``b2[l] = splitmix64(key ^
  (D2 + l))``; lane ``l``'s sum is ``S = sum_j C(l, j) v_j + splitmix64(key ^ (D3
  + l)) * nbytes``, and its output is ``S >> 32``.
- The digest is the four 32-bit outputs, little-endian, lane 0 first (16 bytes).

Each level is Lemire and Kaser's multiply-shift multilinear family (strongly
universal on 32-bit outputs for uniform 64-bit coefficients), so two different
blocks collide in one lane with probability about 2**-31 over the coefficients,
and in all four about 2**-124. The coefficients are derived from a 64-bit key
with splitmix64, which is not a PRF: like keyed XXH3 this stops a peer who does
not know the key from making other bytes match, and is no cryptographic MAC
(docs/DESIGN-NOTES.md, "Trust").

cupy is imported only by :func:`device_block_digests`; the reference needs numpy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvbridge.proto.errors import LayoutError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.specs import Region, Span

if TYPE_CHECKING:
    import torch

__all__ = [
    "LANES",
    "chunk_bytes_of",
    "device_block_digests",
    "device_digest_sums",
    "reference_digests",
    "reference_block_digests",
]

LANES = 4
_TABLE = 256
_MAX_CHUNK = 4 * _TABLE
_GOLDEN = 0x9E3779B97F4A7C15
_D1 = 0x6B76625F6C310000  # "kvb_l1"
_D2 = 0x6B76625F6C320000  # "kvb_l2"
_D3 = 0x6B76625F6C6E0000  # "kvb_ln"
_MASK = (1 << 64) - 1
#: device pieces are cut to at most this many bytes so that a few big blocks fill the GPU
PIECE_BYTES = 64 << 10
_THREADS = 256
_MAX_GRID = 65535


def _splitmix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 over a uint64 array (wraps mod 2**64)."""
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))  # type: ignore[no-any-return]


def _mix(x: int) -> int:
    return int(_splitmix(np.array([x & _MASK], dtype=np.uint64))[0])


@functools.lru_cache(maxsize=16)
def _keys(key: int) -> tuple[npt.NDArray[np.uint64], tuple[int, ...], tuple[int, ...]]:
    """Level-1 table ``(LANES, 256)``, level-2 bases and length coefficients of ``key``."""
    with np.errstate(over="ignore"):
        b1 = _mix(key ^ _D1)
        idx = np.arange(LANES * _TABLE, dtype=np.uint64) * np.uint64(_GOLDEN)
        table = _splitmix(idx + np.uint64(b1)).reshape(LANES, _TABLE)
        b2 = tuple(_mix(key ^ (_D2 + lane)) for lane in range(LANES))
        blen = tuple(_mix(key ^ (_D3 + lane)) for lane in range(LANES))
    table.setflags(write=False)
    return table, b2, blen


def _check_key(key: int) -> int:
    if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key <= _MASK:
        raise ValueError(f"digest key must be an integer in [0, 2**64), got {key!r}")
    return key


def chunk_bytes_of(span_bytes: int) -> int:
    """Chunk length for spans of ``span_bytes``: its lowest set bit, at most 1 KiB."""
    if span_bytes <= 0 or span_bytes % 4:
        raise LayoutError(
            f"the device digest needs spans of a positive multiple of 4 bytes, got {span_bytes}"
        )
    return min(_MAX_CHUNK, span_bytes & -span_bytes)


def _finish(sums: Sequence[int], nbytes: int, blen: Sequence[int]) -> bytes:
    return b"".join(
        ((((s + c * nbytes) & _MASK) >> 32).to_bytes(4, "little"))
        for s, c in zip(sums, blen, strict=True)
    )


def reference_digests(
    streams: Sequence[Sequence[bytes]], chunk_bytes: int, key: int
) -> list[bytes]:
    """:data:`ALGO_DEVICE` digests on the CPU: one per block, each given as its spans' bytes
    in order (each span a whole number of ``chunk_bytes`` chunks)."""
    table, b2, blen = _keys(_check_key(key))
    if chunk_bytes <= 0 or chunk_bytes % 4 or chunk_bytes > _MAX_CHUNK:
        raise LayoutError(f"chunk_bytes {chunk_bytes} must be a multiple of 4 in 4..{_MAX_CHUNK}")
    w = chunk_bytes // 4
    out = []
    with np.errstate(over="ignore"):
        for spans in streams:
            if any(len(s) % chunk_bytes for s in spans):
                raise LayoutError(f"every span must be a whole number of {chunk_bytes}-byte chunks")
            data = b"".join(spans)
            words = np.frombuffer(data, dtype="<u4").astype(np.uint64).reshape(-1, w)
            seq = np.arange(words.shape[0], dtype=np.uint64) * np.uint64(_GOLDEN)
            sums = []
            for lane in range(LANES):
                v = (words * table[lane, :w]).sum(axis=1, dtype=np.uint64) >> np.uint64(32)
                c = _splitmix(seq + np.uint64(b2[lane]))
                sums.append(int((c * v).sum(dtype=np.uint64)))
            out.append(_finish(sums, len(data), blen))
    return out


def _cpu_bytes(region: Region, span: Span) -> bytes:
    import ctypes

    if span.offset < 0 or span.length < 0 or span.offset + span.length > region.length:
        raise LayoutError(
            f"span {span.offset}+{span.length} lies outside its region of {region.length} bytes"
        )
    if not region.device.startswith("cpu"):
        raise LayoutError(f"reference digest: region on {region.device!r}, expected CPU memory")
    return ctypes.string_at(region.addr + span.offset, span.length)


def reference_block_digests(
    layout: KVLayout, group: KVGroup, block_ids: Sequence[int], key: int
) -> list[bytes]:
    """:data:`ALGO_DEVICE` digests of blocks of a bound layout on CPU memory (a CPU reader
    checking a GPU writer's digests after a READ into host memory)."""
    if not layout.regions:
        raise LayoutError("block_digests needs a bound layout (registered regions)")
    chunk = chunk_bytes_of(layout.group_span_bytes(group))
    streams = [
        [_cpu_bytes(layout.regions[s.region], s) for s in layout.block_spans(group, b)]
        for b in block_ids
    ]
    return reference_digests(streams, chunk, key)


def _pieces(
    layout: KVLayout, group: KVGroup, block_ids: Sequence[int], chunk: int, device: str = "cuda"
) -> npt.NDArray[np.int64]:
    """``(n, 4)`` rows ``(addr, nbytes, out_index, chunk_seq)``, each at most PIECE_BYTES,
    over regions on ``device`` (``cpu`` only to check the table against the reference).

    Block ``b``'s spans are block 0's moved by ``b`` block strides (every order), so the
    table is numpy broadcasting over (block, span, piece): no Python loop per span.
    """
    spans = layout.block_spans(group, 0)
    stride = layout.strides(group)["B"]
    length = spans[0].length
    assert all(s.length == length for s in spans)
    step = max(chunk, PIECE_BYTES - PIECE_BYTES % chunk)
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    last = int(ids.max()) if ids.size else 0
    for span in spans:
        region = layout.regions[span.region]
        if not region.device.startswith(device):
            raise LayoutError(f"device digest: region on {region.device!r}, expected {device}")
        if span.offset < 0 or span.offset + last * stride + length > region.length:
            raise LayoutError(
                f"span {span.offset + last * stride}+{length} lies outside its region of "
                f"{region.length} bytes"
            )
        if (region.addr + span.offset) % 4 or stride % 4:
            raise LayoutError("device digest: spans must be 4-byte aligned")
    base = np.array([layout.regions[s.region].addr + s.offset for s in spans], dtype=np.int64)
    offs = np.arange(0, length, step, dtype=np.int64)
    nb, ns, npc = ids.size, len(spans), offs.size
    rows = np.empty((nb, ns, npc, 4), dtype=np.int64)
    rows[..., 0] = ids[:, None, None] * stride + base[None, :, None] + offs[None, None, :]
    rows[..., 1] = np.minimum(step, length - offs)[None, None, :]
    rows[..., 2] = np.arange(nb, dtype=np.int64)[:, None, None]
    seq = np.arange(ns, dtype=np.int64)[:, None] * (length // chunk) + (offs // chunk)[None, :]
    rows[..., 3] = seq[None, :, :]
    return rows.reshape(-1, 4)


@functools.cache
def _kernel(device_index: int) -> Any:
    import cupy

    source = resources.files("kvbridge.kernels").joinpath("block_digest.cu").read_text()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source, options=("--std=c++14",))
        return module.get_function("kvb_block_digest")


def device_digest_sums(
    layout: KVLayout, group: KVGroup, block_ids: Sequence[int], key: int
) -> torch.Tensor:
    """Launch the digest kernel on torch's current stream (asynchronous): the ``(blocks,
    LANES)`` int64 lane sums on the device, before the length term and the shift."""
    import torch

    table, b2, _ = _keys(_check_key(key))
    devices = {layout.regions[i].device for i in layout.regions_of(group)}
    if len(devices) != 1:
        raise LayoutError(f"device digest: group {group!r} spans devices {sorted(devices)}")
    chunk = chunk_bytes_of(layout.group_span_bytes(group))
    rows = _pieces(layout, group, block_ids, chunk)
    import cupy

    device = torch.device(devices.pop())
    index = device.index if device.index is not None else torch.cuda.current_device()
    pieces = torch.from_numpy(rows).to(device, non_blocking=True)
    coef = torch.from_numpy(table.view(np.int64).copy()).to(device, non_blocking=True)
    out = torch.zeros((len(block_ids), LANES), dtype=torch.int64, device=device)
    stream = torch.cuda.current_stream(device)
    kernel = _kernel(index)
    n = pieces.shape[0]
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        kernel(
            (min(n, _MAX_GRID),),
            (_THREADS,),
            (
                cupy.from_dlpack(pieces),
                cupy.int64(n),
                cupy.from_dlpack(coef),
                *(cupy.uint64(b) for b in b2),
                cupy.int32(chunk // 4),
                cupy.from_dlpack(out),
            ),
        )
    # pieces, coef and out came from torch's caching allocator on this stream: their memory
    # is not handed out again before the kernel has run
    return out


def device_block_digests(
    layout: KVLayout, group: KVGroup, block_ids: Sequence[int], key: int
) -> list[bytes]:
    """:data:`ALGO_DEVICE` digests of blocks of a bound layout on one CUDA device, computed
    there (one kernel launch on torch's current stream; 16 bytes per block come back)."""
    if not layout.regions:
        raise LayoutError("block_digests needs a bound layout (registered regions)")
    _, _, blen = _keys(_check_key(key))
    layout.check_block_ids(group, block_ids)
    if not block_ids:
        return []
    sums = device_digest_sums(layout, group, block_ids, key).cpu().numpy().view(np.uint64)
    nbytes = sum(s.length for s in layout.block_spans(group, block_ids[0]))
    return [_finish([int(s) for s in row], nbytes, blen) for row in sums]
