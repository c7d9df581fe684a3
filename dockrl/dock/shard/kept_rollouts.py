"""Kept rollouts (``run.keep_rollouts``): a dock shard writes its rows of each closed iteration as Parquet.

The driver closes an iteration with a ``keep`` spec (``close_iteration(it, keep=...)``: metadata only, the
destination and the lineage); each shard then writes the rows it holds, written by the rollout, of that
iteration to ``<uri>/iteration=<N>/shard-<S>.parquet`` (hive partitioning; docs/rollouts.md holds the
schema) from a background thread of its own (``RolloutWriter``), so the close does not wait for the
write. The queue of closed iterations is bounded (``QUEUE``): a close waits only when the writer is that
many iterations behind, so memory stays bounded and nothing is lost. A write that fails is logged and
counted (``rollouts/errors``), never raised into the run. Files appear whole: each is written under a
hidden temporary name (``.shard-<S>.parquet.tmp``, which ``pyarrow.dataset`` skips) and renamed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dockrl.dock.schema import Schema
from dockrl.dock.shard.iteration import IterationTable

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Version of the kept rollouts' layout and columns (docs/rollouts.md); stored in every file and in ``_meta.json``."""
QUEUE = 2
"""Closed iterations a shard's writer holds at most: a close waits while it is this many behind."""
META_KEY = b"dockrl.rollouts.keep"
"""The Parquet key-value metadata of every file: its lineage as JSON (``KeepSpec.meta`` and the file's own)."""
LEADING = ("iteration", "row", "shard", "weight_version", "prompt_length", "response_length")
"""The columns of a kept row before the dock's own (the schema's columns but its rewritable carry-over ones)."""


@dataclass(frozen=True)
class KeepSpec:
    """What a ``close_iteration`` request's ``keep`` says: where and what to keep, and the lineage."""

    uri: str
    """The dataset's root: a local path or a ``pyarrow.fs`` URI (``s3://bucket/prefix``)."""
    fraction: float = 1.0
    """Of the rows, a deterministic sample (``kept``); 1.0 keeps every row."""
    seed: int = 0
    """The sample's seed (``trainer.seed``)."""
    weight_version: int | None = None
    """Updates in the weights that sampled the iteration; None: the iteration's index (on-policy)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Lineage stored in every file (the run's config hash, the checkpoint it resumed from)."""

    @classmethod
    def of(cls, body: dict[str, Any]) -> KeepSpec:
        return cls(uri=str(body["uri"]), fraction=float(body.get("fraction", 1.0)), seed=int(body.get("seed", 0)),
                   weight_version=body.get("weight_version"), meta=dict(body.get("meta") or {}))

    def body(self) -> dict[str, Any]:
        """The JSON body of this spec in a ``close_iteration`` request."""
        return {"uri": self.uri, "fraction": self.fraction, "seed": self.seed, "weight_version": self.weight_version,
                "meta": self.meta}


def kept(iteration: int, rows: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Which of ``rows`` (global indexes) of ``iteration`` a ``fraction`` keeps: row ``r`` when the first 8 bytes of
    ``blake2b(f"{seed}:{iteration}:{r}")`` (little-endian, over 2**64) are below ``fraction``. The same rows on every
    shard count and in every run of the same seed."""
    if fraction >= 1.0:
        return np.ones(len(rows), dtype=bool)
    draw = [int.from_bytes(hashlib.blake2b(f"{seed}:{iteration}:{r}".encode(), digest_size=8).digest(), "little")
            for r in rows.tolist()]
    return np.asarray(draw, dtype=np.float64) / 2.0**64 < fraction


def kept_columns(schema: Schema) -> list[pa.Field]:
    """The kept dataset's columns (the hive partition ``iteration`` aside, which a dataset reads from the path too)."""
    # int32: the type pyarrow.dataset infers for the hive partition iteration=N, so that the two merge
    lead = [pa.field("iteration", pa.int32(), nullable=False), pa.field("row", pa.int64(), nullable=False),
            pa.field("shard", pa.int32(), nullable=False), pa.field("weight_version", pa.int64(), nullable=False),
            pa.field("prompt_length", pa.int32()), pa.field("response_length", pa.int32())]
    # a schema column named as a leading one (the rollout's per-token weight_version) is not kept: the row's stands for it
    return lead + [pa.field(c.name, c.type) for c in schema.columns if not c.rewritable and c.name not in LEADING]


def rollout_table(schema: Schema, it: IterationTable, shard: int, spec: KeepSpec) -> pa.Table:
    """The kept rows of the closed iteration table ``it`` (rows the rollout wrote ``response_ids`` for, sampled by
    ``spec``), one column per ``kept_columns``; a cell not written is null. ``it`` is no longer changed (closed)."""
    sampled = np.flatnonzero(it.ready[:, it.col_index["response_ids"]])
    local = sampled[kept(it.iteration, sampled + it.first_row, spec.fraction, spec.seed)]
    version = it.iteration if spec.weight_version is None else int(spec.weight_version)
    n = len(local)
    arrays: dict[str, pa.Array] = {
        "iteration": pa.array(np.full(n, it.iteration, dtype=np.int32)), "row": pa.array(local + it.first_row),
        "shard": pa.array(np.full(n, shard, dtype=np.int32)), "weight_version": pa.array(np.full(n, version, dtype=np.int64)),
    }
    for c in schema.columns:
        if c.rewritable or c.name in LEADING:
            continue
        ready = it.ready[local, it.col_index[c.name]]
        if ready.all():
            arrays[c.name] = it.cells(c.name, local)
        elif not ready.any():
            arrays[c.name] = pa.nulls(n, c.type)
        else:
            at = np.full(n, -1, dtype=np.int64)
            at[ready] = np.arange(int(ready.sum()))
            arrays[c.name] = it.cells(c.name, local[ready]).take(pa.array(at, mask=at < 0))
    for name in ("prompt", "response"):
        arrays[f"{name}_length"] = pc.list_value_length(arrays[f"{name}_ids"]).cast(pa.int32())
    fields = kept_columns(schema)
    return pa.Table.from_arrays([arrays[f.name] for f in fields], schema=pa.schema(fields))


def write_rollouts(table: pa.Table, uri: str, iteration: int, shard: int, meta: dict[str, Any]) -> int:
    """Write ``table`` to ``<uri>/iteration=<iteration>/shard-<shard>.parquet`` whole (temporary file, then a rename),
    with ``meta`` as its key-value metadata (``META_KEY``); returns the file's bytes."""
    fs, root = pafs.FileSystem.from_uri(uri)
    folder = f"{root.rstrip('/')}/iteration={iteration}"
    fs.create_dir(folder, recursive=True)
    final, tmp = f"{folder}/shard-{shard}.parquet", f"{folder}/.shard-{shard}.parquet.tmp"
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})
    pq.write_table(table, tmp, filesystem=fs)
    fs.move(tmp, final)
    return int(fs.get_file_info(final).size)


class RolloutWriter:
    """A shard's background writer of kept iterations: ``submit`` hands it a closed iteration table.

    Started on the first ``submit`` (a run that keeps nothing has no thread and no counters). Thread-safe.
    """

    def __init__(self, schema: Schema, name: str) -> None:
        self.schema, self.name = schema, name
        self._cond = threading.Condition()
        self._jobs: deque[tuple[IterationTable, int, KeepSpec]] = deque()
        self._busy = 0  # jobs submitted and not yet written (or failed)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.rows = self.bytes = self.files = self.errors = 0
        self.wait_s = 0.0

    def submit(self, it: IterationTable, shard: int, spec: KeepSpec) -> None:
        """Queue the closed iteration table ``it`` of this shard (index ``shard``) for writing; waits while the writer
        holds ``QUEUE`` of them."""
        start = time.monotonic()
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"rollouts {self.name}", daemon=True)
                self._thread.start()
            while len(self._jobs) >= QUEUE and not self._stopping:
                self._cond.wait()
            self.wait_s += time.monotonic() - start
            self._jobs.append((it, shard, spec))
            self._busy += 1
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted iteration is written (or failed); False at the timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float | None = 60.0) -> None:
        """Write what is queued (up to ``timeout_s``), then stop the thread."""
        if not self.flush(timeout_s):
            logger.warning("dock shard %s: kept rollouts of %d iteration(s) not written at shutdown", self.name, self._busy)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def stats(self) -> dict[str, float]:
        """``rollouts/rows``, ``rollouts/bytes``, ``rollouts/files`` written so far, ``rollouts/errors`` (failed
        writes), ``rollouts/wait_s`` (closes waiting for the writer), ``rollouts/pending`` (iterations not yet
        written); empty before the first ``submit``."""
        with self._cond:
            if self._thread is None:
                return {}
            return {"rollouts/rows": self.rows, "rollouts/bytes": self.bytes, "rollouts/files": self.files,
                    "rollouts/errors": self.errors, "rollouts/wait_s": self.wait_s, "rollouts/pending": self._busy}

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                it, shard, spec = self._jobs.popleft()
                self._cond.notify_all()  # a close waiting for room
            rows = size = 0
            try:
                table = rollout_table(self.schema, it, shard, spec)
                meta = spec.meta | {"schema_version": SCHEMA_VERSION, "dock_schema_version": self.schema.version,
                                    "iteration": it.iteration, "shard": shard, "fraction": spec.fraction}
                size, rows = write_rollouts(table, spec.uri, it.iteration, shard, meta), table.num_rows
            except Exception:  # noqa: BLE001 - a kept-rollouts write never ends the run: logged and counted
                logger.exception("dock shard %s: could not keep the rollouts of iteration %d under %s", self.name, it.iteration,
                                 spec.uri)
                with self._cond:
                    self.errors += 1
            with self._cond:
                self.rows, self.bytes, self.files = self.rows + rows, self.bytes + size, self.files + (1 if size else 0)
                self._busy -= 1
                self._cond.notify_all()
