"""The corpus harness: prepare an entry once (export, cached), then build, verify, run and compare
it on each backend.

An :class:`Entry` knows how to make its ONNX model and its reference samples (the framework's
own outputs at batch 1, 3 and the profile's max). :func:`prepare` makes them once per entry and
package versions, under the cache folder; :func:`run_entry` builds the prepared model on one
backend with the build's own verification, runs it at every sample and compares with the
framework's outputs at a tolerance relative to each output's scale. Results are frozen
dataclasses: pass, or the first line of the error, plus build seconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

#: Bumped when what an entry makes changes in a way versions do not capture.
CACHE_FORMAT = 1

#: An engine output passes when max |engine - framework| <= RTOL_SCALE * max |framework|.
RTOL_SCALE = 1e-3

#: The batch sizes every entry runs at; the profile's max is the last.
BATCHES = (1, 3, 8)

Feeds = dict[str, np.ndarray]


class CorpusError(Exception):
    """A corpus entry or option that does not exist, or a prepared entry that is malformed."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One run point: the inputs and the framework's own outputs (in the model's output order)."""

    label: str
    feeds: Feeds
    expected: tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An entry ready to build: the batch-dynamic ONNX file, the shapes to build, the samples.

    Attributes:
        onnx: the model every backend builds (for fixed-batch entries, after make_batch_dynamic).
        shapes: the build profile ``{input: [min, opt, max]}``.
        samples: run points, each with the framework's outputs.
        notes: what preparing did (e.g. the make_batch_dynamic rewrites).
        seconds: how long preparing took (0 when it came from the cache).
    """

    onnx: Path
    shapes: Mapping[str, Sequence[tuple[int, ...]]]
    samples: tuple[Sample, ...]
    notes: tuple[str, ...] = ()
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Made:
    """What an entry's ``make`` returns: written model, profile and samples (before caching)."""

    onnx: Path
    shapes: Mapping[str, Sequence[tuple[int, ...]]]
    samples: tuple[Sample, ...]
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One real architecture of the corpus.

    Attributes:
        name: unique, e.g. ``tv-resnet18``.
        family: ``torchvision``, ``timm``, ``transformers``, ``keras`` or ``zoo``.
        make: writes the ONNX model into the folder it is given and returns :class:`Made`.
        packages: distributions whose versions key the cache (besides torch/onnx/enginekit).
        about: one line: what the entry is and at which input size.
        fixed_batch: ``make`` writes a fixed-batch file (a model-zoo classic); each run makes
            it batch-dynamic with ``enginekit.make_batch_dynamic`` (not cached: the pass is
            what is under test) and lints it at every batch of :data:`BATCHES`.
    """

    name: str
    family: str
    make: Callable[[Path], Made]
    packages: tuple[str, ...] = ()
    about: str = ""
    fixed_batch: bool = False


@dataclasses.dataclass(frozen=True)
class Result:
    """One entry on one backend.

    Attributes:
        entry, family, backend: what ran.
        passed: built, verified, ran at every sample and matched the framework.
        error: the first line of what failed, prefixed with the stage (``export``, ``build``,
            ``run b3``, ``compare b8``...); empty when it passed.
        build_s: the build's seconds (None when it did not get that far).
        worst: the largest error relative to output scale over all samples (None: not compared).
    """

    entry: str
    family: str
    backend: str
    passed: bool
    error: str = ""
    build_s: float | None = None
    worst: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:200]


def closest(name: str, choices: Iterable[str]) -> str:
    """'; did you mean X?' for the closest choice, or an empty string."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


# --- the cache -------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$ENGINEKIT_CORPUS_CACHE``, else ``~/.cache/enginekit-corpus``."""
    env = os.environ.get("ENGINEKIT_CORPUS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "enginekit-corpus"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def versions(packages: Iterable[str] = ()) -> dict[str, str]:
    """Versions of the packages an entry's export depends on."""
    base = ("enginekit", "torch", "onnx", "onnxruntime", "onnxscript")
    return {d: _version(d) for d in dict.fromkeys((*base, *packages))}


def cache_key(entry: Entry) -> str:
    text = json.dumps([CACHE_FORMAT, entry.name, versions(entry.packages)], sort_keys=True)
    return f"{entry.name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _save_samples(path: Path, samples: Sequence[Sample]) -> None:
    arrays: dict[str, np.ndarray] = {}
    index = []
    for i, s in enumerate(samples):
        names = list(s.feeds)
        for j, n in enumerate(names):
            arrays[f"s{i}_in{j}"] = s.feeds[n]
        for k, e in enumerate(s.expected):
            arrays[f"s{i}_out{k}"] = e
        index.append({"label": s.label, "inputs": names, "outputs": len(s.expected)})
    np.savez(path / "samples.npz", **arrays)  # type: ignore[arg-type]
    (path / "samples.json").write_text(json.dumps(index))


def _load_samples(path: Path) -> tuple[Sample, ...]:
    index = json.loads((path / "samples.json").read_text())
    with np.load(path / "samples.npz", allow_pickle=False) as npz:
        return tuple(
            Sample(
                s["label"],
                {n: npz[f"s{i}_in{j}"] for j, n in enumerate(s["inputs"])},
                tuple(npz[f"s{i}_out{k}"] for k in range(s["outputs"])),
            )
            for i, s in enumerate(index)
        )


def prepare(entry: Entry, cache: Path | None = None) -> Prepared:
    """The entry's model and samples, from the cache or made now (and cached).

    Args:
        cache: the cache folder (default :func:`cache_root`); each entry and version set gets a
            folder of its own, written to a temporary name and renamed whole.
    """
    root = cache or cache_root()
    folder = root / cache_key(entry)
    meta = folder / "prepared.json"
    if meta.is_file():
        info = json.loads(meta.read_text())
        prepared = Prepared(
            folder / info["onnx"],
            {k: [tuple(p) for p in v] for k, v in info["shapes"].items()},
            _load_samples(folder),
            tuple(info["notes"]),
        )
        return _batch_dynamic(prepared, folder) if entry.fixed_batch else prepared
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=root))
    try:
        start = time.perf_counter()
        made = entry.make(tmp)
        seconds = time.perf_counter() - start
        _save_samples(tmp, made.samples)
        info = {
            "entry": entry.name,
            "onnx": made.onnx.relative_to(tmp).as_posix(),
            "shapes": {k: [list(p) for p in v] for k, v in made.shapes.items()},
            "notes": list(made.notes),
            "versions": versions(entry.packages),
            "seconds": round(seconds, 2),
        }
        (tmp / "prepared.json").write_text(json.dumps(info, indent=1))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prepared = prepare(entry, root)
    return dataclasses.replace(prepared, seconds=seconds)


def _batch_dynamic(prepared: Prepared, folder: Path) -> Prepared:
    """The fixed-batch file made batch-dynamic and linted at every batch the corpus runs.

    Raises:
        CorpusError: an output that does not follow the batch (the rewrite's unproven nodes
            are named).
    """
    import enginekit as ek
    from enginekit.passes import rewrite_batch

    rewrite = rewrite_batch(str(prepared.onnx))
    dynamic = folder / "dynamic.onnx"
    tmp = folder / f".dynamic.{os.getpid()}.onnx"
    onnx.save_model(rewrite.model, str(tmp))
    os.replace(tmp, dynamic)
    issues = ek.lint_batch(str(dynamic), sizes=BATCHES)
    if issues:
        why = "; ".join(rewrite.unproven) or "no constant was reported unproven"
        raise CorpusError(f"make_batch_dynamic: {issues[0]} ({why})")
    notes = (*prepared.notes, *rewrite.rewritten)
    return dataclasses.replace(prepared, onnx=dynamic, notes=notes)


# --- the run ---------------------------------------------------------------------------------


def scaled_error(got: np.ndarray, expected: np.ndarray) -> float:
    """max |got - expected| / max |expected| (integer outputs: 0 when equal, else inf)."""
    if got.shape != expected.shape:
        return float("inf")
    if expected.dtype.kind not in "fc":
        return 0.0 if np.array_equal(got, expected) else float("inf")
    e = expected.astype(np.float64)
    g = got.astype(np.float64)
    if not np.isfinite(g).all() and not np.array_equal(np.isnan(g), np.isnan(e)):
        return float("inf")
    scale = float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0))
    diff = np.abs(g - e)
    diff = diff[np.isfinite(diff)]
    worst = float(diff.max(initial=0.0))
    return worst / scale if scale > 0 else worst


def compare_sample(outputs: Mapping[str, np.ndarray], sample: Sample) -> tuple[float, str]:
    """The worst scaled error of one sample, and the reason when it exceeds the tolerance."""
    got = list(outputs.values())
    if len(got) != len(sample.expected):
        return float("inf"), f"{len(got)} outputs, the framework gives {len(sample.expected)}"
    worst = 0.0
    for name, g, e in zip(outputs, got, sample.expected):
        g = np.asarray(g)
        if g.shape != e.shape:
            return float("inf"), f"output {name!r} has shape {g.shape}, the framework {e.shape}"
        err = scaled_error(g, e)
        worst = max(worst, err)
        if err > RTOL_SCALE:
            return worst, (
                f"output {name!r} differs from the framework by {err:.3g} of its scale "
                f"(max |ref| {float(np.max(np.abs(e), initial=0)):.3g}; allowed {RTOL_SCALE:g})"
            )
    return worst, ""


def run_entry(entry: Entry, prepared: Prepared, backend: str, **build_options: Any) -> Result:
    """Build ``prepared`` on ``backend`` (verification on), run every sample, compare."""
    import enginekit as ek

    def fail(stage: str, exc: BaseException, build_s: float | None = None) -> Result:
        return Result(
            entry.name, entry.family, backend, False, f"{stage}: {first_line(exc)}", build_s
        )

    start = time.perf_counter()
    try:
        engine = ek.build(str(prepared.onnx), backend=backend, shapes=dict(prepared.shapes),
                          **build_options)  # fmt: skip
    except Exception as exc:
        if os.environ.get("ENGINEKIT_CORPUS_TRACE"):
            traceback.print_exc()
        return fail("build", exc, round(time.perf_counter() - start, 2))
    build_s = round(time.perf_counter() - start, 2)
    worst = 0.0
    try:
        for sample in prepared.samples:
            try:
                outputs = engine.infer(sample.feeds)
            except Exception as exc:
                return fail(f"run {sample.label}", exc, build_s)
            err, why = compare_sample(outputs, sample)
            worst = max(worst, err)
            if why:
                return Result(entry.name, entry.family, backend, False,
                              f"compare {sample.label}: {why}", build_s, worst)  # fmt: skip
    finally:
        engine.close()
    return Result(entry.name, entry.family, backend, True, "", build_s, worst)


def available_backends() -> list[str]:
    """Every registered backend that can build and run here (new backends join by registering)."""
    from enginekit import backends

    found = []
    for name in backends.names():
        try:
            if backends.availability(name).available:
                found.append(name)
        except Exception:  # a broken third-party backend must not stop the corpus
            continue
    return found


def run(
    entries: Sequence[Entry],
    backends: Sequence[str],
    cache: Path | None = None,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Prepare each entry and run it on each backend; a failed export fails every backend."""
    results = []
    for entry in entries:
        try:
            prepared = prepare(entry, cache)
            onnx.checker.check_model(str(prepared.onnx))
        except Exception as exc:
            if os.environ.get("ENGINEKIT_CORPUS_TRACE"):
                traceback.print_exc()
            line = f"export: {first_line(exc)}"
            batch = [Result(entry.name, entry.family, b, False, line) for b in backends]
        else:
            batch = [run_entry(entry, prepared, b) for b in backends]
        for r in batch:
            if on_result is not None:
                on_result(r)
        results += batch
    return results
