"""The cells of the dock as Arrow arrays: the columns of a put, checked and converted to the
schema's types (``arrow_columns``), and the cells of a read, sliced out of the chunks that
were put (``slice_cells``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.errors import DockError
from dockrl.dock.schema import Schema


def arrow_columns(
    schema: Schema, columns: Mapping[str, Sequence | pa.Array] | pa.RecordBatch, num_rows: int, what: str = "put"
) -> dict[str, pa.Array]:
    """Check and convert the columns of a put to Arrow arrays of the schema's types.

    Raises:
        DockError: unknown column, wrong Arrow type, values that do not convert, or a column
            whose length is not ``num_rows``.
    """
    if isinstance(columns, pa.RecordBatch):
        columns = {name: columns.column(name) for name in columns.schema.names}
    arrays: dict[str, pa.Array] = {}
    for name, values in columns.items():
        try:
            col = schema.column(name)
        except KeyError as e:
            raise DockError(f"{what}: {e.args[0]}") from None
        if isinstance(values, pa.ChunkedArray):
            values = values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()
        if isinstance(values, pa.Array):
            if values.type != col.type:
                raise DockError(f"{what}: column {name!r} has Arrow type {values.type}; schema says {col.type}")
            array = values
        else:
            try:
                array = pa.array(list(values), type=col.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
                raise DockError(f"{what}: column {name!r} values do not convert to {col.type}: {e}") from None
        if len(array) != num_rows:
            raise DockError(f"{what}: column {name!r} has {len(array)} values for {num_rows} rows")
        arrays[name] = array
    return arrays


def slice_cells(chunks: list[pa.Array], loc: np.ndarray, type_: pa.DataType) -> pa.Array:
    """The cells at ``loc`` (``(k, 2)`` rows of chunk id, offset), in order, as one array.

    Runs of consecutive cells of one chunk are sliced (zero-copy) and the pieces concatenated
    once, so a read costs what it returns, not the size of every chunk put so far.
    """
    if not len(loc):
        return pa.array([], type=type_)
    chunk, offset = loc[:, 0], loc[:, 1]
    breaks = np.flatnonzero((chunk[1:] != chunk[:-1]) | (offset[1:] != offset[:-1] + 1)) + 1
    if not len(breaks):  # one run (a contiguous claim): a zero-copy slice
        return chunks[chunk[0]].slice(offset[0], len(loc))
    starts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(loc)]])
    return pa.concat_arrays([chunks[chunk[a]].slice(offset[a], b - a) for a, b in zip(starts, stops)])
