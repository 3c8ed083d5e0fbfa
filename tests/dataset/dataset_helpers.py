"""Helpers of the dataset tests: datasets in each format and the naive reference loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tensor_column(a: np.ndarray):
    """Rows of ``a`` as a (nested) fixed-size list column, as Parquet stores tensors."""
    from enginekit.dataset.columns import from_numpy

    return from_numpy(a, "list")


def cnn_rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)


def write_parquet(path: Path, columns: dict, row_group_size: int | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def naive(engine, feeds: dict[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    """The reference: a plain loop over batches of the same size, outputs concatenated."""
    n = len(next(iter(feeds.values())))
    parts = [
        engine.infer({k: v[i : i + batch] for k, v in feeds.items()}) for i in range(0, n, batch)
    ]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def read_output(path: Path) -> dict[str, np.ndarray]:
    """Every column of a Parquet output folder as numpy rows."""
    import pyarrow.parquet as pq

    from enginekit.dataset.columns import to_numpy

    table = pq.read_table(path)
    return {name: to_numpy(table.column(name), name) for name in table.column_names}
