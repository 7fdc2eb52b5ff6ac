"""An oracle for NIXL's strided descriptor tables (:mod:`kvbridge.connector.transport.nixl_descs`).

The product hands strided tables to NIXL and never expands them; the tests expand them
here and compare the rows with the dense table of the same blocks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvbridge.proto import LayoutError

__all__ = ["expand_strided"]


def expand_strided(table: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The Nx3 dense rows an Nx5 strided table stands for, in NIXL's index order."""
    if table.ndim != 2 or table.shape[1] != 5:
        raise LayoutError(f"a strided table has 5 columns, got shape {table.shape}")
    counts = table[:, 4].astype(np.int64)
    row = np.repeat(np.arange(table.shape[0]), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    step = (np.arange(row.shape[0], dtype=np.int64) - first[row]).astype(np.uint64)
    out = np.empty((row.shape[0], 3), dtype=np.uint64)
    out[:, 0] = table[row, 0] + step * table[row, 3]
    out[:, 1] = table[row, 1]
    out[:, 2] = table[row, 2]
    return out
