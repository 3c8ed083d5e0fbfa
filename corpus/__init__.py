"""The corpus: real architectures (torchvision, timm, transformers, Keras, model-zoo ONNX files)
that enginekit must export, build, verify and run on every backend.

Test and benchmark data, not package code: it imports enginekit like a user does.
``benchmarks/run_corpus.py`` runs it; ``docs/corpus.md`` says how a backend joins.
"""

from __future__ import annotations

from collections.abc import Iterable

from corpus.harness import (
    Entry,
    Prepared,
    Result,
    available_backends,
    closest,
    prepare,
    run,
    run_entry,
)

FAMILIES = ("torchvision", "timm", "transformers", "keras", "zoo")


def entries() -> list[Entry]:
    """Every entry, family by family (importing no framework)."""
    from corpus import keras_apps, text, vision, zoo

    return [*vision.ENTRIES, *text.ENTRIES, *keras_apps.ENTRIES, *zoo.ENTRIES]


def select(names: Iterable[str] = ()) -> list[Entry]:
    """The entries named (entry names or family names, in the corpus's order); all when empty.

    Raises:
        CorpusError: a name that is neither an entry nor a family, with the closest one.
    """
    from corpus.harness import CorpusError

    every = entries()
    wanted = list(names)
    if not wanted:
        return every
    known = {e.name for e in every} | set(FAMILIES)
    for n in wanted:
        if n not in known:
            raise CorpusError(
                f"no corpus entry or family named {n!r}{closest(n, known)} (families: "
                f"{', '.join(FAMILIES)}; `python benchmarks/run_corpus.py --list` lists the entries)"
            )
    return [e for e in every if e.name in wanted or e.family in wanted]


__all__ = [
    "FAMILIES",
    "Entry",
    "Prepared",
    "Result",
    "available_backends",
    "entries",
    "prepare",
    "run",
    "run_entry",
    "select",
]
