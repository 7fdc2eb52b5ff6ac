"""Block digests: what a reader checks after a READ lands, before the engine uses a block.

Registered memory is writable by anyone holding its NIXL metadata, and a WRITE
posted before a pause can land long after its lease or store expired. So the
writer of a block records a digest of its bytes when it hands the block over,
the digest travels only where no NIXL peer can write it (transfer params,
control replies, the offload daemon's index), and the reader recomputes it over
the bytes that landed. A mismatch means the block is recomputed.

A block's digest is XXH3-128 over the block's bytes, taken span by span in
:meth:`KVLayout.block_spans` order (layers in layout order, K before V), seeded
with a 64-bit **key** the writer chose for this hand-over. Block-outermost and
layer-separate memories of one model therefore give the same digest for the
same KV: one block-outermost block is exactly its spans concatenated. The key
goes only to the legitimate reader, over the authenticated control plane or the
router's params; without it a peer that can write the memory cannot make other
bytes match (XXH3 is not a cryptographic MAC: see docs/DESIGN-NOTES.md, "Trust",
for what that means).

CPU memory is hashed in place (no copy) at about memcpy speed. CUDA memory
is digested on the device with another algorithm, ``ALGO_DEVICE``
(:mod:`kvbridge.kernels.digest_cuda`, which also holds its CPU reference): a
digest names its algorithm, and a reader passes that name as ``algo`` so it
computes the same one on whatever device the bytes landed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import secrets
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor

import xxhash

from kvbridge.proto.errors import LayoutError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.specs import Region, Span

__all__ = [
    "ALGO_DEVICE",
    "ALGO_XXH3",
    "digest_algo",
    "DIGEST_BYTES",
    "block_digests",
    "head_digest_parts",
    "keyed_block_digests",
    "new_key",
    "page_slice_digests",
    "span_digest",
]

ALGO_XXH3 = "xxh3-128"
"""The CPU digest: XXH3-128, seeded with the hand-over's key."""
ALGO_DEVICE = "kvb-mlh32x4"
"""The device digest, computed by :mod:`kvbridge.kernels.digest_cuda`."""
DIGEST_BYTES = 16
"""Length of one block digest."""
_KEY_MASK = (1 << 64) - 1


def new_key() -> int:
    """A fresh random 64-bit digest key for one hand-over (lease, store)."""
    return secrets.randbits(64)


def _check_key(key: int) -> int:
    if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key <= _KEY_MASK:
        raise ValueError(f"digest key must be an integer in [0, 2**64), got {key!r}")
    return key


def _cpu_view(region: Region, span: Span) -> memoryview:
    """The span's bytes in place (no copy); checks the span lies inside its region."""
    if span.offset < 0 or span.length < 0 or span.offset + span.length > region.length:
        raise LayoutError(
            f"span {span.offset}+{span.length} lies outside its region of {region.length} bytes"
        )
    if not region.device.startswith("cpu"):
        raise LayoutError(f"span_digest: region on {region.device!r}, expected CPU memory")
    buf = (ctypes.c_char * span.length).from_address(region.addr + span.offset)
    return memoryview(buf).cast("B")


def span_digest(regions: Sequence[Region], spans: Iterable[Span], key: int) -> bytes:
    """XXH3-128 (seeded with ``key``) over ``spans`` of CPU ``regions``, in order."""
    h = xxhash.xxh3_128(seed=_check_key(key))
    for span in _coalesced(spans):
        h.update(_cpu_view(regions[span.region], span))
    return h.digest()


def _coalesced(spans: Iterable[Span]) -> Iterable[Span]:
    """``spans`` with each run of spans adjacent in one region merged into one (the same
    bytes in the same order: the digest is unchanged, one hash call per run)."""
    run: Span | None = None
    for span in spans:
        if (
            run is not None
            and span.length > 0
            and span.region == run.region
            and span.offset == run.offset + run.length
        ):
            run = Span(run.region, run.offset, run.length + span.length)
            continue
        if run is not None:
            yield run
        run = span
    if run is not None:
        yield run


def digest_algo(layout: KVLayout, group: KVGroup) -> str:
    """The algorithm :func:`block_digests` uses by default for a bound layout's group:
    :data:`ALGO_XXH3` on CPU memory, ``ALGO_DEVICE`` on CUDA memory."""
    if not layout.regions:
        raise LayoutError("block_digests needs a bound layout (registered regions)")
    device = layout.regions[layout.regions_of(group).start].device
    return ALGO_DEVICE if device.startswith("cuda") else ALGO_XXH3


def block_digests(
    layout: KVLayout,
    group: KVGroup,
    block_ids: Sequence[int],
    key: int,
    algo: str | None = None,
    helper: Executor | None = None,
) -> list[bytes]:
    """One :data:`DIGEST_BYTES`-byte digest per block of ``group``, for a *bound* layout
    (its regions are the registered addresses).

    ``algo`` defaults to :func:`digest_algo` (XXH3 on CPU memory, computed in place; the
    device digest on CUDA memory, computed on the device). A reader passes the writer's
    algorithm: ``ALGO_DEVICE`` over CPU memory runs its CPU reference; XXH3 over CUDA
    memory is refused (it would need a host copy).

    ``helper``: a thread pool that may take a share of the XXH3 blocks (python-xxhash
    releases the interpreter lock for an input over 64 KiB, so two threads hash two blocks
    of large spans at once on two cores; small spans hash holding it); see
    :func:`_shared`. Without it, or with a busy one, this thread hashes every block.
    """
    algo = digest_algo(layout, group) if algo is None else algo
    if algo == ALGO_DEVICE:
        from kvbridge.kernels import digest_cuda

        if digest_algo(layout, group) == ALGO_DEVICE:
            return digest_cuda.device_block_digests(layout, group, block_ids, key)
        return digest_cuda.reference_block_digests(layout, group, block_ids, key)
    if algo != ALGO_XXH3:
        raise ValueError(f"unknown digest algorithm {algo!r}: use {ALGO_XXH3!r} or {ALGO_DEVICE!r}")
    if not layout.regions:
        raise LayoutError("block_digests needs a bound layout (registered regions)")
    if helper is None or len(block_ids) < 2:
        return _xxh3_digests(layout, group, block_ids, itertools.repeat(_check_key(key)))
    spans = [layout.block_spans(group, b) for b in block_ids]
    jobs = [functools.partial(span_digest, layout.regions, s, key) for s in spans]
    return _shared(helper, jobs)


def keyed_block_digests(
    layout: KVLayout,
    group: KVGroup,
    block_ids: Sequence[int],
    keys: Sequence[int],
    algo: str,
) -> list[bytes]:
    """:func:`block_digests` with one key per block (``keys[i]`` for ``block_ids[i]``): what
    a reader computes for blocks of several hand-overs at once (an offload load spans
    stores), in one call instead of one per block."""
    if len(keys) != len(block_ids):
        raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks: they pair one to one")
    if algo != ALGO_XXH3:
        return [
            block_digests(layout, group, [b], k, algo)[0]
            for b, k in zip(block_ids, keys, strict=True)
        ]
    if not layout.regions:
        raise LayoutError("block_digests needs a bound layout (registered regions)")
    for k in keys:
        _check_key(k)
    return _xxh3_digests(layout, group, block_ids, keys)


def _xxh3_digests(
    layout: KVLayout, group: KVGroup, block_ids: Sequence[int], keys: Iterable[int]
) -> list[bytes]:
    """XXH3-128 of each block with its (checked) key. A block-outermost block is one span,
    so those are hashed straight from one view of the region: one C call per block and no
    span objects, which is most of the time for small blocks (2048 blocks of 128 KiB)."""
    if not layout.block_outermost:
        return [
            span_digest(layout.regions, layout.block_spans(group, b), k)
            for b, k in zip(block_ids, keys, strict=False)  # keys may repeat one key
        ]
    layout.check_block_ids(group, block_ids)
    region = layout.regions[layout.regions_of(group).start]
    stride = layout.strides(group)["B"]
    if not block_ids:
        return []
    view = _cpu_view(region, Span(0, 0, (max(block_ids) + 1) * stride))
    one = xxhash.xxh3_128_digest
    return [
        one(view[b * stride : (b + 1) * stride], seed=k)
        for b, k in zip(block_ids, keys, strict=False)
    ]


def _shared(helper: Executor, jobs: Sequence[Callable[[], bytes]]) -> list[bytes]:
    """Run ``jobs`` in this thread and, once it starts, one thread of ``helper``: each takes
    the next job not taken yet, last first (the blocks that landed last are the likeliest
    still in the cache). This thread never waits for the helper: once nothing is left to
    take, it runs itself any job the helper took and has not finished (a helper that is
    preempted or busy elsewhere costs at most the work it would have saved). A job's
    exception is raised here (the helper's own copy of it is dropped)."""
    n = len(jobs)
    out: list[bytes | None] = [None] * n
    taken = itertools.count()

    def help_out() -> None:
        while (i := next(taken)) < n:
            with contextlib.suppress(BaseException):  # this thread redoes a failed job
                out[n - 1 - i] = jobs[n - 1 - i]()

    with contextlib.suppress(RuntimeError):  # shut down: this thread does it all
        helper.submit(help_out)
    while (i := next(taken)) < n:
        out[n - 1 - i] = jobs[n - 1 - i]()
    # the helper's unfinished jobs: done here (the same bytes give the same digest)
    return [d if d is not None else jobs[j]() for j, d in enumerate(out)]


def head_digest_parts(layout: KVLayout) -> int:
    """How many head digests a writer of ``layout`` records per block for readers of a
    bigger TP size (each reads a run of every page's heads): its heads per rank, when its
    pages can be read in head slices (vLLM's packed head-major pages, one span each) and
    hold more than one head; else 0 (no such reader can exist). Every group's pages are
    digested with the one count, so groups of other heads per rank (a hybrid model's
    groups of their own page shape) get none: such a reader recomputes."""
    from kvbridge.proto.negotiate import HEAD_MAJOR_SUFFIX

    sliceable = layout.model.name.endswith(HEAD_MAJOR_SUFFIX) and layout.order[2] == "KV"
    heads = {layout.sizes(g.name)["H"] for g in layout.groups}
    return heads.pop() if sliceable and len(heads) == 1 and layout.num_heads > 1 else 0


def page_slice_digests(
    layout: KVLayout,
    group: KVGroup,
    block_ids: Sequence[int],
    key: int,
    parts: int,
    algo: str = ALGO_XXH3,
) -> list[list[bytes]]:
    """Per block, ``parts`` digests: digest ``i`` is XXH3-128 (seeded with ``key``) over
    slice ``i`` of ``parts`` equal slices of each of the block's pages, owning layers in
    layout order, for a *bound* layout whose pages are each one span (vLLM's packed
    head-major pages, ``KV`` third in the order: what ``HEAD_SLICE`` moves).

    A slice is a run of heads (heads are contiguous in such a page), so this is how one
    TP size checks head slices another wrote: ``parts=1`` is :func:`block_digests`
    (a page is its K and V spans, adjacent); ``parts`` = the heads per rank gives one
    digest per head; a reader's slice ``j`` of ``k`` holds exactly the bytes of the
    ``j``-th writer's whole pages. Computed in place (no copy). CPU memory and XXH3 only:
    any other ``algo`` is a ValueError (the reader then recomputes).
    """
    if algo != ALGO_XXH3:
        raise ValueError(f"head-slice digests are computed with {ALGO_XXH3!r} only, not {algo!r}")
    if not layout.regions:
        raise LayoutError("page_slice_digests needs a bound layout (registered regions)")
    if parts < 1:
        raise LayoutError(f"a page is cut into at least 1 slice, not {parts}")
    page = 2 * layout.group_span_bytes(group)  # the group's own page shape
    if page % parts:
        raise LayoutError(f"a page of {page} bytes does not split into {parts} slices")
    step = page // parts
    seed = _check_key(key)
    out = []
    for b in block_ids:
        hashers = [xxhash.xxh3_128(seed=seed) for _ in range(parts)]
        for span in _pages(layout.block_spans(group, b), page):
            view = _cpu_view(layout.regions[span.region], span)
            for i, h in enumerate(hashers):
                h.update(view[i * step : (i + 1) * step])
        out.append([h.digest() for h in hashers])
    return out


def _pages(spans: Sequence[Span], page: int) -> Iterable[Span]:
    """``spans`` (one block's) cut into its ``page``-byte pages, each one span; LayoutError
    if a page is not one span (its K and V halves apart)."""
    for run in _coalesced(spans):
        if run.length % page:
            raise LayoutError(f"a page of {page} bytes is not one span in this layout")
        for off in range(0, run.length, page):
            yield Span(run.region, run.offset + off, page)
