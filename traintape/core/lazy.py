"""Lazy (dask) views of a run's stat vectors, for stores bigger than memory.

Partitions are blocks of whole row chunks of the store (``block_rows`` rows, default
the number of rows whose stat vectors take about 64 MiB), read through
:meth:`traintape.core.reader.Run.stats_array` / :meth:`~traintape.core.reader.Run.stats`
only when a computation needs them. Needs ``dask`` (``pip install "dask[dataframe]"``,
part of traintape's ``dev`` extra); everything else in traintape streams without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from traintape.schema import Kind

if TYPE_CHECKING:
    from traintape.core.reader import Run

_BLOCK_BYTES = 64 << 20


def _dask(what: str) -> Any:
    try:
        if what == "array":
            import dask.array as da

            return da
        import dask.dataframe as dd

        return dd
    except ImportError as e:
        raise ImportError(
            f"lazy reads need dask ({e}); install it with: pip install 'dask[dataframe]'"
        ) from e


def block_rows(run: Run, kind: Kind, requested: int | None) -> int:
    """Rows per partition: ``requested`` rounded up to whole row chunks, or whole chunks
    worth about 64 MiB of stat vectors of ``kind``."""
    chunk = run.manifest.layout.row_chunk
    if requested is not None:
        if requested < 1:
            raise ValueError(f"block_rows must be >= 1, got {requested}")
        return chunk * -(-requested // chunk)
    row_bytes = 8 * max(1, len(run.tensor_names(kind))) * len(run.manifest.stat_names)
    return chunk * max(1, _BLOCK_BYTES // (row_bytes * chunk))


def _blocks(run: Run, kind: Kind, rows: slice | None, requested: int | None) -> list[slice]:
    start, stop, _ = (rows or slice(0, run.rows)).indices(run.rows)
    step = block_rows(run, kind, requested)
    return [slice(a, min(a + step, stop)) for a in range(start, stop, step)]


def lazy_stats(
    run: Run,
    kind: Kind | str,
    tensors: list[str] | None,
    rows: slice | None,
    requested: int | None,
) -> Any:
    """:meth:`Run.stats` as a dask DataFrame, one partition per row block."""
    dd = _dask("dataframe")
    kind = Kind(kind)
    run.stats_array(kind, rows=slice(0, 0))  # an unknown kind fails here, not on compute
    blocks = _blocks(run, kind, rows, requested)
    meta = run.stats(kind, tensors, rows=slice(0, 0))
    if not blocks:
        return dd.from_pandas(meta, npartitions=1)
    return dd.from_map(_StatsBlock(run, kind, tensors, blocks), blocks, meta=meta)


def lazy_stats_array(run: Run, kind: Kind | str, requested: int | None) -> Any:
    """:meth:`Run.stats_array` ``[row, tensor, stat]`` as a dask array chunked by row
    blocks."""
    da = _dask("array")
    kind = Kind(kind)
    n_t, n_s = len(run.tensor_names(kind)), len(run.manifest.stat_names)
    parts = [
        da.from_delayed(
            _delayed_block(run, kind, b), shape=(b.stop - b.start, n_t, n_s), dtype=np.float64
        )
        for b in _blocks(run, kind, None, requested)
    ]
    if not parts:
        return da.zeros((0, n_t, n_s), dtype=np.float64)
    return da.concatenate(parts, axis=0)


class _StatsBlock:
    """The long table of one row block (a named callable: dask partitions call it)."""

    def __init__(
        self, run: Run, kind: Kind, tensors: list[str] | None, blocks: list[slice]
    ) -> None:
        self.run, self.kind, self.tensors = run, kind, tensors
        self.token = _token(run, kind, tensors, blocks)

    def __call__(self, rows: slice) -> Any:
        return self.run.stats(self.kind, self.tensors, rows=rows)

    def __dask_tokenize__(self) -> str:
        return self.token


def _token(run: Run, kind: Kind, tensors: list[str] | None, blocks: list[slice]) -> str:
    """A name for the dask graph: the store, its commit, the selection (data are
    immutable once committed, so this identifies them)."""
    from dask.base import tokenize

    m = run.manifest
    sel = [(b.start, b.stop) for b in blocks]
    return tokenize(run.url, m.run_id, m.commit.sequence, kind.value, tensors, sel)


def _delayed_block(run: Run, kind: Kind, rows: slice) -> Any:
    import dask

    key = f"traintape-stats-{_token(run, kind, None, [rows])}"
    return dask.delayed(run.stats_array, pure=False)(kind, rows=rows, dask_key_name=key)
