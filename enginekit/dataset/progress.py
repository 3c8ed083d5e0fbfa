"""The progress bar of a dataset job: rows, rows/s and ETA with rich on a terminal; a log line
every few seconds otherwise."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger("enginekit.dataset")


class Progress:
    """Counts rows; draws a rich bar when ``show`` (default: stderr is a terminal)."""

    def __init__(self, total: int | None, done: int, show: bool | None = None) -> None:
        if show is None:
            show = sys.stderr.isatty() and os.environ.get("ENGINEKIT_QUIET") != "1"
        self.total = total
        self.done = done
        self._start = time.perf_counter()
        self._first = done
        self._last_log = self._start
        self._lock = threading.Lock()
        self._bar: Any = None
        self._task: Any = None
        if show:
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import Progress as RichProgress
            except ImportError:  # rich is optional: fall back to log lines
                return
            self._bar = RichProgress(
                TextColumn("infer"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows"),
                TextColumn("{task.fields[rate]} rows/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("infer", total=total, completed=done, rate="-")

    def rate(self) -> float:
        elapsed = time.perf_counter() - self._start
        return (self.done - self._first) / elapsed if elapsed > 0 else 0.0

    def advance(self, rows: int) -> None:
        with self._lock:
            self.done += rows
            rate = self.rate()
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done, rate=f"{rate:,.0f}")
            now = time.perf_counter()
            if now - self._last_log >= 5.0:
                self._last_log = now
                left = (
                    f", ETA {(self.total - self.done) / rate:.0f} s"
                    if self.total and rate > 0
                    else ""
                )
                log.info("%d/%s rows, %.0f rows/s%s", self.done, self.total or "?", rate, left)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
