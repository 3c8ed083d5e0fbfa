"""A dynamic batcher: many small requests from threads or asyncio, one engine, full batches.

It calls only ``Engine.infer``, so it works with every backend. See docs/batcher.md.
"""

from __future__ import annotations

from enginekit.batcher.core import Batcher

__all__ = ["Batcher"]
