"""ONNX's own backend test data through raw ONNX Runtime and through enginekit, per backend.

    python benchmarks/onnx_testdata.py [--backends onnxruntime,tvm,xla] [--dirs simple,node]
                                       [--limit N] [--budget SECONDS] [--only PATTERN]
                                       [--sample N] [--reasons] [--json]

Every case of ``onnx/backend/test/data`` (node, pytorch-converted, pytorch-operator, simple; from
the installed onnx package; ``node``, which onnx 1.23's wheel does not ship, is made from
``onnx.backend.test.case.node``'s definitions, as onnx's own generator does) runs through
raw ONNX Runtime (an InferenceSession on the model) and, for each case raw ONNX Runtime passes,
through ``ek.build`` (default settings: verification on) + ``ek.load`` on each backend, compared
with the case's expected outputs (rtol 1e-3, atol 1e-7, as onnx's backend test runner). Prints
per-backend pass counts against raw ONNX Runtime's and the cases a backend fails that raw ONNX
Runtime passes, with the first line of the error. One process; cases raw ONNX Runtime cannot
load are skipped for the backends.

``--only PATTERN`` keeps the cases whose ``dir/name`` matches a regular expression, ``--sample N``
every N-th case (a quick estimate: counts are printed as measured and scaled by N), and
``--reasons`` groups each backend's failures by the error with case names and numbers replaced
(most cases first), the list to work down when adding ops. A full run (no ``--only``/``--sample``)
is the number to report.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import enginekit as ek  # noqa: E402
from enginekit.errors import BuildError  # noqa: E402

DIRS = ("node", "pytorch-converted", "pytorch-operator", "simple")
#: Goal: every other backend passes this fraction of enginekit onnxruntime's passes.
GOAL = 0.95
RTOL, ATOL = 1e-3, 1e-7


@dataclasses.dataclass
class Case:
    name: str
    dir: str
    model: Path
    sets: list[tuple[dict[str, np.ndarray], list[np.ndarray]]]


def data_root() -> Path:
    return Path(onnx.__file__).parent / "backend" / "test" / "data"


def _read(pb: str, proto: Any) -> Any:
    p = proto()
    with open(pb, "rb") as f:
        p.ParseFromString(f.read())
    return p


def _tensor(pb: str) -> np.ndarray | None:
    t = _read(pb, onnx.TensorProto)
    if not t.name and not t.dims and not t.raw_data and t.data_type == 0:
        return None  # a sequence or optional, not a tensor
    return numpy_helper.to_array(t)


def load_case(folder: Path, dir_name: str) -> Case | None:
    model_path = folder / "model.onnx"
    if not model_path.is_file():
        return None
    proto = onnx.load(str(model_path), load_external_data=False)
    init = {i.name for i in proto.graph.initializer}
    in_names = [i.name for i in proto.graph.input if i.name not in init]
    sets = []
    for ds in sorted(glob.glob(str(folder / "test_data_set_*"))):
        ins = [_tensor(p) for p in sorted(glob.glob(os.path.join(ds, "input_*.pb")))]
        outs = [_tensor(p) for p in sorted(glob.glob(os.path.join(ds, "output_*.pb")))]
        if any(a is None for a in [*ins, *outs]):
            continue
        sets.append((dict(zip(in_names, ins)), outs))  # type: ignore[arg-type]
    return Case(folder.name, dir_name, model_path, sets)


def node_cases() -> list[Case]:
    """ONNX's node test cases made from their definitions (``onnx.backend.test.case.node``),
    for onnx wheels (1.23) that ship no ``data/node`` folder; models go to a temporary folder."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = node.collect_testcases(None)
    tmp = Path(tempfile.mkdtemp(prefix="ek-node-cases-"))
    atexit.register(shutil.rmtree, tmp, True)
    out = []
    for c in sorted(found, key=lambda c: c.name):
        if c.model is None:
            continue
        init = {i.name for i in c.model.graph.initializer}
        in_names = [i.name for i in c.model.graph.input if i.name not in init]
        sets = []
        for ins, outs in c.data_sets or []:
            # A 0-d value comes as a numpy scalar (Range's limits, OneHot's depth): an array of
            # its own; sequences and optionals (lists, None) are not tensors and are left out.
            ins, outs = (
                [np.asarray(a) if isinstance(a, np.generic) else a for a in x] for x in (ins, outs)
            )
            if all(isinstance(a, np.ndarray) for a in [*ins, *outs]):
                sets.append((dict(zip(in_names, ins)), outs))
        if not sets:
            continue
        path = tmp / f"{c.name}.onnx"
        onnx.save(c.model, str(path))
        out.append(Case(c.name, "node", path, sets))
    return out


def cases(dirs: list[str]) -> tuple[list[Case], list[str]]:
    out, absent = [], []
    for d in dirs:
        folder = data_root() / d
        if not folder.is_dir() and d == "node":
            out += node_cases()
            continue
        if not folder.is_dir():
            absent.append(d)
            continue
        for sub in sorted(folder.iterdir()):
            c = load_case(sub, d)
            if c is not None and c.sets:
                out.append(c)
    return out, absent


def _close(got: list[np.ndarray], want: list[np.ndarray]) -> str | None:
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape}, expected {w.shape}"
        if w.dtype.kind in "fc":
            if not np.allclose(g, w, rtol=RTOL, atol=ATOL, equal_nan=True):
                return f"output {i}: max abs error {np.nanmax(np.abs(g - w)):.3g}"
        elif not np.array_equal(g, w):
            return f"output {i}: values differ"
    return None


def run_raw(case: Case) -> str | None:
    """None when raw ONNX Runtime passes, else the first line of why not."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        sess = ort.InferenceSession(str(case.model), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        for feeds, want in case.sets:
            err = _close(sess.run(names, feeds), want)
            if err:
                return err
    except Exception as exc:
        return _first(exc)
    return None


def _first(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _shapes(case: Case) -> dict[str, Any]:
    """A profile spanning the data sets' shapes (for inputs with symbolic dims)."""
    prof: dict[str, Any] = {}
    for name in case.sets[0][0]:
        shapes = [s[0][name].shape for s in case.sets]
        lo = tuple(min(d) for d in zip(*shapes))
        hi = tuple(max(d) for d in zip(*shapes))
        prof[name] = [lo, shapes[0], hi]
    return prof


def run_enginekit(case: Case, backend: str, tmp: Path) -> tuple[str | None, str]:
    """(None or the first line of the error, how it was verified) through build + load."""
    out = tmp / f"{case.dir}-{case.name}-{backend}.ekit"
    how = "generated inputs"
    try:
        try:
            ek.build(case.model, backend=backend, shapes=_shapes(case), output=out).close()
        except BuildError as exc:
            if "verify_data" not in str(exc):
                raise
            # What a user does when asked: give the real inputs to verify on.
            how = "verify_data (asked for)"
            ek.build(
                case.model,
                backend=backend,
                shapes=_shapes(case),
                output=out,
                verify_data=case.sets[0][0],
            ).close()
        engine = ek.load(out)
        try:
            names = [o.name for o in engine.outputs]
            for feeds, want in case.sets:
                got = engine.infer(feeds)
                err = _close([got[n] for n in names], want)
                if err:
                    return err, how
        finally:
            engine.close()
    except Exception as exc:
        return _first(exc), how
    finally:
        if out.exists():
            out.unlink()
    return None, how


def reason(error: str) -> str:
    """An error with what varies between cases (names, numbers, shapes) replaced, so that one
    cause groups its cases together."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", error)
    text = re.sub(r"node \S+ \((\w+)\)", r"node … (\1)", text)
    text = re.sub(r"\(\d[\d, ]*\)|\[\d[\d, ]*\]", "(…)", text)
    text = re.sub(r"(?<![\w.])-?\d+(\.\d+)?(e[-+]?\d+)?(?![\w])", "N", text)
    return text[:160]


def reasons(failed: dict[str, str]) -> list[tuple[str, list[str]]]:
    """Failures grouped by :func:`reason`, the largest group first."""
    groups: dict[str, list[str]] = {}
    for key, error in sorted(failed.items()):
        groups.setdefault(reason(error), []).append(key)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))


def select(all_cases: list[Case], only: str | None = None, sample: int | None = None) -> list[Case]:
    """The cases matching ``only`` (a regular expression on ``dir/name``), then every
    ``sample``-th of them."""
    if only:
        pattern = re.compile(only)
        all_cases = [c for c in all_cases if pattern.search(f"{c.dir}/{c.name}")]
    if sample and sample > 1:
        all_cases = all_cases[::sample]
    return all_cases


def run(
    backends: list[str],
    dirs: list[str],
    limit: int | None = None,
    budget: float | None = None,
    only: str | None = None,
    sample: int | None = None,
) -> dict[str, Any]:
    """Run the cases; the JSON report (also what the test reads)."""
    all_cases, absent = cases(dirs)
    all_cases = select(all_cases, only, sample)
    if limit is not None:
        all_cases = all_cases[:limit]
    start = time.perf_counter()
    raw: dict[str, str | None] = {}
    results: dict[str, dict[str, Any]] = {b: {} for b in backends}
    with tempfile.TemporaryDirectory() as tmp:
        for case in all_cases:
            if budget is not None and time.perf_counter() - start > budget:
                break
            key = f"{case.dir}/{case.name}"
            raw[key] = run_raw(case)
            if raw[key] is not None:
                continue  # raw ONNX Runtime cannot run it: nothing to hold enginekit to
            for b in backends:
                err, how = run_enginekit(case, b, Path(tmp))
                results[b][key] = {"error": err, "verified_on": how}
    ran = list(raw)
    raw_pass = [k for k in ran if raw[k] is None]
    report: dict[str, Any] = {
        "onnx": onnx.__version__,
        "dirs": dirs,
        "absent": absent,
        "cases": len(ran),
        "of": len(all_cases),
        "only": only,
        "sample": sample or 1,
        "raw_onnxruntime": {"passed": len(raw_pass)},
        "backends": {},
        "seconds": round(time.perf_counter() - start, 1),
    }
    for b in backends:
        res = results[b]
        failed = {k: v["error"] for k, v in res.items() if v["error"] is not None}
        report["backends"][b] = {
            "passed": sum(v["error"] is None for v in res.values()),
            "failed_where_raw_passes": failed,
            "verified_on_data": sorted(
                k for k, v in res.items() if v["verified_on"] != "generated inputs"
            ),
        }
    report["goals"] = goals(report)
    return report


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each backend's passes against GOAL x enginekit onnxruntime's (when both ran)."""
    ran = report["backends"]
    if "onnxruntime" not in ran:
        return []
    base = ran["onnxruntime"]["passed"]
    return [
        {
            "backend": b,
            "passed": r["passed"],
            "onnxruntime": base,
            "ratio": round(r["passed"] / base, 4) if base else None,
            "goal": GOAL,
            "met": base > 0 and r["passed"] >= GOAL * base,
        }
        for b, r in ran.items()
        if b != "onnxruntime"
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", default="onnxruntime", help="comma-separated registered backends")
    p.add_argument("--dirs", default=",".join(DIRS), help="comma-separated folders of the data")
    p.add_argument("--limit", type=int, help="the first N cases only")
    p.add_argument("--budget", type=float, help="stop starting cases after this many seconds")
    p.add_argument("--only", metavar="PATTERN", help="cases whose dir/name matches this regex")
    p.add_argument("--sample", type=int, metavar="N", help="every N-th case (a quick estimate)")
    p.add_argument(
        "--reasons", action="store_true", help="group failures by error, largest group first"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.sample is not None and args.sample < 1:
        p.error(f"--sample {args.sample}: expected a positive integer")
    if args.only:
        try:
            re.compile(args.only)
        except re.error as exc:
            p.error(f"--only {args.only!r} is not a regular expression: {exc}")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in ek.backends.names():
            p.error(f"backend {b!r} is not registered ({', '.join(ek.backends.names())})")
        avail = ek.backends.availability(b)
        if not avail.available:
            p.error(f"backend {b!r} is not available here: {avail.reason}")
    dirs = [d for d in args.dirs.split(",") if d]
    report = run(backends, dirs, args.limit, args.budget, args.only, args.sample)
    for r in report["backends"].values():
        r["reasons"] = [
            {"reason": text, "count": len(keys), "cases": keys}
            for text, keys in reasons(r["failed_where_raw_passes"])
        ]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    absent = f" (not in this onnx wheel: {', '.join(report['absent'])})" if report["absent"] else ""
    print(
        f"onnx {report['onnx']} backend test data: {report['cases']} cases{absent}, {report['seconds']} s"
    )
    print(f"raw onnxruntime: {report['raw_onnxruntime']['passed']} of {report['cases']} pass")
    for b, r in report["backends"].items():
        print(
            f"enginekit {b}: {r['passed']} of the {report['raw_onnxruntime']['passed']} raw ONNX Runtime passes"
            + (
                f" ({len(r['verified_on_data'])} verified on the case's inputs when asked)"
                if r["verified_on_data"]
                else ""
            )
        )
        if report["sample"] > 1:
            raw = report["raw_onnxruntime"]["passed"]
            print(
                f"  (every {report['sample']}th case: ~{r['passed'] * report['sample']} of "
                f"~{raw * report['sample']} estimated for all)"
            )
        if args.reasons:
            for group in r["reasons"]:
                shown = ", ".join(group["cases"][:6]) + (", …" if group["count"] > 6 else "")
                print(f"  {group['count']:4d}  {group['reason']}\n        {shown}")
            continue
        for k, e in sorted(r["failed_where_raw_passes"].items()):
            print(f"  FAIL {k}: {e}")
    if report["goals"]:
        print(f"goal: >= {GOAL} x enginekit onnxruntime's passes")
        for g in report["goals"]:
            ratio = f"{g['ratio']:.3f}" if g["ratio"] is not None else "-"
            met = "met" if g["met"] else "NOT met"
            print(f"  {g['backend']:<12} {g['passed']:5d} / {g['onnxruntime']:5d} = {ratio}  {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
