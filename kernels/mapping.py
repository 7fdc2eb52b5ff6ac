"""Block-id mappings: the ``(src id, dst id)`` pairs a copy moves, checked before any copy.

Callers (the connector's load/save paths, the offload staging code, the
reference engine) hand :func:`kvbridge.kernels.copy_blocks` and
:func:`kvbridge.kernels.convert_blocks` a mapping in whichever form they hold:

- a sequence of ``(src, dst)`` integer pairs, e.g. ``[(3, 0), (7, 1)]``;
- an ``(n, 2)`` integer tensor or NumPy array (column 0 = src, column 1 = dst);
- two id sequences, as a :class:`BlockMapping` or as a tuple of two 1-D
  integer tensors/arrays ``(src_ids, dst_ids)``.

A tuple of two plain Python sequences is read as *pairs* (``((3, 0), (7, 1))``
is two pairs), never as two id lists: the two readings give different copies,
so two plain id lists must be wrapped in :class:`BlockMapping`.

Every id is checked against its side's block count, and destination ids must
be distinct (two sources for one destination has no defined result), before
the first byte moves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

import torch

from kvbridge.proto.errors import LayoutError
from kvbridge.proto.layout import KVGroup

if TYPE_CHECKING:
    import numpy as np

    from kvbridge.proto.layout import KVLayout

__all__ = ["BlockMapping", "MappingLike", "IdsLike", "as_mapping", "as_ids"]


@dataclass(frozen=True, slots=True)
class BlockMapping:
    """Two equally long id sequences: block ``src[i]`` is copied to block ``dst[i]``."""

    src: Sequence[int] | torch.Tensor
    dst: Sequence[int] | torch.Tensor


IdsLike: TypeAlias = "Sequence[int] | torch.Tensor | np.ndarray[Any, Any]"
MappingLike: TypeAlias = (
    "BlockMapping | Sequence[tuple[int, int]] | Sequence[Sequence[int]] | torch.Tensor"
    " | np.ndarray[Any, Any] | tuple[torch.Tensor, torch.Tensor]"
)


def _is_array(x: object) -> bool:
    return isinstance(x, torch.Tensor) or type(x).__module__ == "numpy"


def _to_index_tensor(x: object, what: str) -> torch.Tensor:
    """A CPU int64 tensor from a tensor, array or sequence of ints; LayoutError otherwise."""
    if isinstance(x, torch.Tensor) and x.dtype is torch.int64 and x.is_cpu:
        return x  # already one (no torch op: each costs tens of microseconds when cold)
    try:
        if isinstance(x, torch.Tensor):
            t = x.detach()
        elif _is_array(x):
            t = torch.from_numpy(x)  # type: ignore[arg-type]
        else:
            seq = list(x)  # type: ignore[call-overload]
            for v in seq:
                if not isinstance(v, int) or isinstance(v, bool):
                    raise LayoutError(f"{what}: block id {v!r} is not an integer")
            t = torch.tensor(seq, dtype=torch.int64) if seq else torch.zeros(0, dtype=torch.int64)
    except LayoutError:
        raise
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise LayoutError(f"{what}: not a list of block ids ({exc})") from None
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise LayoutError(f"{what}: block ids must be integers, got a {t.dtype} tensor")
    return t.to(device="cpu", dtype=torch.int64)


def as_mapping(mapping: MappingLike) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src_ids, dst_ids)`` as two 1-D CPU int64 tensors of equal length."""
    if isinstance(mapping, BlockMapping):
        src = _to_index_tensor(mapping.src, "mapping.src")
        dst = _to_index_tensor(mapping.dst, "mapping.dst")
    elif (
        isinstance(mapping, tuple)
        and len(mapping) == 2
        and _is_array(mapping[0])
        and _is_array(mapping[1])
        and getattr(mapping[0], "ndim", 0) == 1
        and getattr(mapping[1], "ndim", 0) == 1
    ):
        src = _to_index_tensor(mapping[0], "mapping[0]")
        dst = _to_index_tensor(mapping[1], "mapping[1]")
    else:
        if _is_array(mapping):
            pairs = _to_index_tensor(mapping, "mapping")
        else:
            rows = list(mapping)  # type: ignore[arg-type]
            for row in rows:
                if _is_array(row) or not isinstance(row, Sequence) or len(row) != 2:
                    raise LayoutError(
                        f"mapping entry {row!r} is not a (src, dst) pair; pass pairs, an (n, 2) "
                        "tensor, or BlockMapping(src_ids, dst_ids)"
                    )
            flat = [v for row in rows for v in row]
            pairs = _to_index_tensor(flat, "mapping").reshape(-1, 2)
        if pairs.dim() != 2 or pairs.shape[1] != 2:
            raise LayoutError(f"mapping tensor must have shape (n, 2), got {tuple(pairs.shape)}")
        src, dst = pairs[:, 0], pairs[:, 1]
    if src.dim() != 1 or dst.dim() != 1 or src.numel() != dst.numel():
        raise LayoutError(
            f"mapping needs two 1-D id lists of equal length, got shapes "
            f"{tuple(src.shape)} and {tuple(dst.shape)}"
        )
    return _contiguous(src), _contiguous(dst)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def as_ids(block_ids: IdsLike, what: str = "block_ids") -> torch.Tensor:
    """Block ids as a 1-D CPU int64 tensor."""
    ids = _to_index_tensor(block_ids, what)
    if ids.dim() != 1:
        raise LayoutError(f"{what} must be 1-D, got shape {tuple(ids.shape)}")
    return _contiguous(ids)


def check_ids(
    layout: KVLayout, group: KVGroup, ids: torch.Tensor, *, distinct: bool, side: str
) -> None:
    """Raise LayoutError for an id outside ``group``'s blocks (or a repeated one if ``distinct``).

    Up to :data:`_FEW_IDS` ids are tested in Python, more by vectorised torch ops; either
    way a repeated id is reported as the smallest one, and on an out-of-range id
    :meth:`KVLayout.check_block_ids` produces the message so that it reads the same as
    everywhere else.
    """
    n = layout.group(group).num_blocks
    if ids.numel() <= _FEW_IDS:  # one torch op: the vectorised checks cost more for few ids
        few = ids.tolist()
        if few and (min(few) < 0 or max(few) >= n):
            _raise_out_of_range(layout, group, [v for v in few if not 0 <= v < n][:1], side)
        if distinct and len(set(few)) != len(few):
            _raise_repeated(group, min(v for v, c in Counter(few).items() if c > 1), side)
        return
    if bool(((ids < 0) | (ids >= n)).any()):
        _raise_out_of_range(layout, group, ids[(ids < 0) | (ids >= n)][:1].tolist(), side)
    if distinct and ids.numel() > 1:
        uniq, counts = torch.unique(ids, return_counts=True)
        if bool((counts > 1).any()):
            _raise_repeated(group, int(uniq[counts > 1][0]), side)


#: id lists up to this long are checked in Python (one ``tolist``), longer ones by torch ops
_FEW_IDS = 1024


def _raise_out_of_range(layout: KVLayout, group: KVGroup, bad: list[int], side: str) -> NoReturn:
    try:
        layout.check_block_ids(group, bad)
    except LayoutError as exc:
        raise LayoutError(f"{side}: {exc}") from None
    raise AssertionError("check_block_ids accepted an out-of-range id")


def _raise_repeated(group: KVGroup, dup: int, side: str) -> NoReturn:
    raise LayoutError(
        f"{side}: block id {dup} of group {group!r} appears more than once; each "
        "destination block may be written only once per call"
    )
