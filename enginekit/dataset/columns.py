"""Arrow columns to numpy rows and back, and the checks that a column fits an engine input."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from enginekit.engine import TensorSpec
from enginekit.errors import DatasetError

if TYPE_CHECKING:
    import pyarrow as pa


def closest(name: str, names: Sequence[str]) -> str:
    """`` (closest: 'x')`` or ``''``: the did-you-mean part of a message."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f" (closest: {close[0]!r})" if close else ""


def is_tensor_type(t: pa.DataType) -> bool:
    """Whether an Arrow type holds a tensor per row (lists, fixed-size lists, tensor extension)."""
    import pyarrow as pa

    return (
        pa.types.is_fixed_size_list(t)
        or pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or isinstance(t, pa.FixedShapeTensorType)
    )


def is_id_type(t: pa.DataType) -> bool:
    """Whether a column is carried through as an id by default (scalars, strings, dates)."""
    import pyarrow as pa

    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_temporal(t)
        or pa.types.is_decimal(t)
        or pa.types.is_dictionary(t)
    )


def to_numpy(col: pa.Array | pa.ChunkedArray, what: str) -> np.ndarray:
    """One Arrow column as an array of rows: ``(n, *row_shape)``; zero-copy where Arrow allows.

    Raises:
        DatasetError: nulls, or variable-length lists whose rows differ in length.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    n = len(col)
    if col.null_count:
        raise DatasetError(
            f"{what}: {col.null_count} null value(s); an engine input needs a value in every "
            "row — drop or fill those rows first"
        )
    if isinstance(col.type, pa.FixedShapeTensorType):
        return col.to_numpy_ndarray()
    dims: list[int] = []
    while is_tensor_type(col.type):
        if pa.types.is_fixed_size_list(col.type):
            dims.append(col.type.list_size)
        else:
            lengths = pc.list_value_length(col)
            lo, hi = pc.min(lengths).as_py(), pc.max(lengths).as_py()
            if lo != hi:
                raise DatasetError(
                    f"{what}: list rows of different lengths ({lo}..{hi}); an engine input "
                    "needs one shape per batch — pad them to one length first"
                )
            dims.append(lo or 0)
        col = col.flatten()
        if col.null_count:
            raise DatasetError(f"{what}: null values inside the lists; fill them first")
    values = col.to_numpy(zero_copy_only=False)
    return values.reshape(n, *dims)


def check_rows(
    spec: TensorSpec, a: np.ndarray, what: str, cast: bool, names: Mapping[str, str] | None = None
) -> np.ndarray:
    """Check (or, with ``cast``, convert) an input's rows against its spec beyond the batch dim.

    Raises:
        DatasetError: dtype or shape mismatch, saying what was expected, found and what to do.
    """
    want = np.dtype(spec.dtype)
    if a.dtype != want:
        if not cast or a.dtype.kind not in "biuf" or want.kind not in "biuf":
            raise DatasetError(
                f"{what} holds {a.dtype}, engine input {spec.name!r} takes {want}: cast it when "
                f"writing the data, or pass cast=True (--cast) to convert it as it is read"
            )
        a = a.astype(want)
    rank = len(spec.shape)
    if a.ndim != rank:
        raise DatasetError(
            f"{what} gives rows of shape {a.shape[1:]} (rank {a.ndim} with the batch), engine "
            f"input {spec.name!r} takes {spec.shape} (rank {rank}); store each row with the "
            "shape the input wants"
        )
    for axis, d in enumerate(spec.shape):
        if axis and isinstance(d, int) and a.shape[axis] != d:
            raise DatasetError(
                f"{what} gives rows of shape {a.shape[1:]}, engine input {spec.name!r} takes "
                f"{spec.shape}: dim {axis} must be {d}; reshape or preprocess the data to fit"
            )
    return a


def from_numpy(a: np.ndarray, tensor_format: str) -> pa.Array:
    """Rows as an Arrow column: scalars plain, tensors as (nested) fixed-size lists or, with
    ``tensor_format="tensor"``, Arrow's fixed-shape tensor extension type."""
    import pyarrow as pa

    if a.ndim == 1:
        return pa.array(a)
    a = np.ascontiguousarray(a)
    if tensor_format == "tensor":
        return pa.FixedShapeTensorArray.from_numpy_ndarray(a)
    arr: pa.Array = pa.array(a.reshape(-1))
    for d in reversed(a.shape[1:]):
        arr = pa.FixedSizeListArray.from_arrays(arr, d)
    return arr
