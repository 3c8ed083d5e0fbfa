"""The ledger of a dataset job: which shards are committed, and for which model, source and
settings. A shard is committed when its file is in place *and* the ledger lists it; a crash at
any point loses at most the shard being written, which a rerun writes again."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from enginekit.errors import DatasetError
from enginekit.files import atomic_write

NAME = "_enginekit_ledger.json"
FORMAT = "enginekit-dataset-ledger/1"


def model_checksum(manifest: Mapping[str, Any]) -> str | None:
    """What identifies an engine: its payload checksums and build key (None: no manifest)."""
    ident = {k: manifest[k] for k in ("payload", "build_key") if manifest.get(k)}
    if not ident:
        return None
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass
class Ledger:
    """The committed state of an output folder (rewritten atomically on each commit)."""

    path: Path
    model: str | None
    source: str | None
    source_description: str
    batch_size: int
    shard_rows: int
    settings: dict[str, Any]
    shards: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    complete: bool = False
    #: How the engine ran: ``streams`` and ``threads`` per call (a resume reuses them, as it
    #: reuses the batch size: a runtime's results may depend on its threading in the last bit).
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(cls, output: Path) -> Ledger | None:
        path = output / NAME
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            return cls(
                path,
                data["model"],
                data["source"],
                data["source_description"],
                int(data["batch_size"]),
                int(data["shard_rows"]),
                dict(data["settings"]),
                list(data["shards"]),
                bool(data["complete"]),
                dict(data.get("engine", {})),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(
                f"ledger {path}: unreadable ({exc}); start again with --overwrite"
            ) from None

    def check(self, model: str | None, source: str | None, settings: Mapping[str, Any]) -> None:
        """Refuse to resume with another model, source or settings, saying which changed."""
        fix = "rerun with --overwrite (overwrite=True) to start again, or write to a new output"
        if model != self.model:
            raise DatasetError(
                f"cannot resume into {self.path.parent}: the model changed (ledger {_short(self.model)}, "
                f"now {_short(model)}); its committed shards came from the other engine — {fix}"
            )
        if source != self.source:
            raise DatasetError(
                f"cannot resume into {self.path.parent}: the source changed ({self.source_description} "
                f"had fingerprint {_short(self.source)}, now {_short(source)}: files added, removed or "
                f"modified, or another column mapping or image preprocessing) — {fix}"
            )
        for key, value in settings.items():
            if self.settings.get(key) != value:
                raise DatasetError(
                    f"cannot resume into {self.path.parent}: setting {key!r} was "
                    f"{self.settings.get(key)!r}, now {value!r} — rerun with the same settings, or {fix}"
                )

    def committed_rows(self) -> int:
        """Rows covered by the committed shards (they always form a prefix)."""
        return sum(int(s["rows"]) for s in self.shards)

    def commit(self, index: int, file: str, rows: int, last: bool = False) -> None:
        """Record a shard whose file is already in place (``last``: the source's last rows,
        so the output is complete: one save for both)."""
        if index != len(self.shards):
            raise DatasetError(f"ledger: shard {index} committed out of order")
        self.shards.append({"index": index, "file": file, "rows": rows})
        self.complete = self.complete or last
        self.save()

    def finish(self) -> None:
        self.complete = True
        self.save()

    def save(self) -> None:
        data = {
            "format": FORMAT,
            "model": self.model,
            "source": self.source,
            "source_description": self.source_description,
            "batch_size": self.batch_size,
            "shard_rows": self.shard_rows,
            "settings": self.settings,
            "shards": self.shards,
            "complete": self.complete,
            "engine": self.engine,
        }
        with atomic_write(self.path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")


def _short(digest: str | None) -> str:
    return "none (not checksummable)" if digest is None else digest[:12]
