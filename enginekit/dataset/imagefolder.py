"""A folder of images as a source: files decoded with a declared preprocessing, ahead of the
engine, in a thread pool or worker processes."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from enginekit.dataset.columns import check_rows
from enginekit.dataset.images import IMAGE_SUFFIXES, ImagePreprocess, decode_many
from enginekit.dataset.sources import Piece, Source, file_fingerprint, list_files
from enginekit.engine import TensorSpec
from enginekit.errors import DatasetError, UsageError


class ImageSource(Source):
    """A folder of image files (sorted by path), decoded with a declared preprocessing, a few
    batches ahead of the engine: in threads (Pillow releases the GIL while it decodes and
    resizes), or in worker processes when asked (each takes a second or more to start, which
    only a large job on many cores with a heavy decoder repays: measured in
    benchmarks/dataset.py, threads won on 2 cores at 1000–2000 images)."""

    def __init__(
        self,
        path: Path,
        inputs: Sequence[TensorSpec],
        preprocess: ImagePreprocess | None,
        columns: Mapping[str, str] | None,
        workers: int | None,
        cast: bool,
        processes: bool = False,
    ) -> None:
        if len(inputs) != 1:
            raise DatasetError(
                f"an image folder feeds one input; this engine takes {len(inputs)} "
                f"({', '.join(s.name for s in inputs)})"
            )
        if columns:
            raise UsageError("an image folder feeds the engine's one input: no column mapping")
        self.root = path
        self.files = tuple(list_files(path, IMAGE_SUFFIXES, "image"))
        self.spec = inputs[0]
        self.preprocess = preprocess or _default_preprocess(self.spec)
        self.cast = cast
        self.rows = len(self.files)
        self.workers = min(os.cpu_count() or 1, 4) if workers is None else workers
        self.processes = processes
        self._pool: concurrent.futures.Executor | None = None
        self.fingerprint = file_fingerprint(self.files, path, self.preprocess.to_json())
        self.description = f"images:{path}"

    def _decode(self, paths: list[str]) -> Any:
        if self.workers <= 0:
            done: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
            done.set_result(decode_many(self.preprocess, paths))
            return done
        if self._pool is None and self.processes:
            import multiprocessing

            # spawn: the parent runs threads (and an engine); fork would copy them mid-work.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn")
            )
        elif self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.workers, thread_name_prefix="enginekit-decode"
            )
        return self._pool.submit(decode_many, self.preprocess, paths)

    def pieces(self, start: int, size: int) -> Iterator[Piece]:
        import pyarrow as pa

        # Small tasks keep every worker busy; several in flight hide the decode time.
        step = max(1, min(size, 32))
        starts = iter(range(start, len(self.files), step))
        ahead: deque[tuple[list[Path], Any]] = deque()

        def submit(i: int) -> None:
            fs = list(self.files[i : i + step])
            ahead.append((fs, self._decode([str(f) for f in fs])))

        for i in itertools.islice(starts, max(2, 2 * self.workers)):
            submit(i)
        while ahead:
            fs, fut = ahead.popleft()
            nxt = next(starts, None)
            if nxt is not None:
                submit(nxt)
            rows = fut.result()
            what = f"images {fs[0]}..{fs[-1]}"
            rows = check_rows(self.spec, rows, what, self.cast)
            ids = {"path": pa.array([f.relative_to(self.root).as_posix() for f in fs])}
            yield Piece(ids, {self.spec.name: rows}, len(fs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _default_preprocess(spec: TensorSpec) -> ImagePreprocess:
    """Fit the input's fixed H and W by resizing exactly; NCHW or NHWC read off the shape."""
    shape = spec.shape
    if len(shape) == 4 and all(isinstance(d, int) for d in shape[1:]):
        c1, _, c3 = shape[1], shape[2], shape[3]
        if c1 in (1, 3, 4):
            hw = (int(shape[2]), int(shape[3]))
            layout = "NCHW"
            channels = c1
        elif c3 in (1, 3, 4):
            hw = (int(shape[1]), int(shape[2]))
            layout = "NHWC"
            channels = c3
        else:
            channels = 0
        if channels:
            mode = {1: "L", 3: "RGB", 4: "RGBA"}[int(channels)]
            return ImagePreprocess(resize=hw, layout=layout, dtype=spec.dtype, mode=mode)
    raise UsageError(
        f"engine input {spec}: cannot tell the image size and layout from its shape; declare "
        "the preprocessing (preprocess=ImagePreprocess(...), or --resize/--crop/--layout)"
    )
