"""The op table against ONNX's own backend test data: every case whose ops the lowering claims.

Suites: ``node`` (generated in memory by ``onnx.backend.test.case.node``: the wheel ships the
generators, not ``data/node``), and the on-disk ``pytorch-converted``, ``pytorch-operator`` and
``simple``. A case is claimed when every node's op is in ``supported_ops()``; claimed cases
either pass or match a listed exclusion with its reason — nothing is skipped silently.

Inputs that decide shapes (Reshape's shape, Slice's starts, Pad's pads, ... and what they are
computed from) are baked into the model as initializers: the node tests feed them at run time,
but an XLA program is compiled for static shapes, which is how real models carry them.

For speed the cases are traced one by one but compiled in chunks (one XLA program holding many
cases) with compile-time-saving XLA options; the lowering under test is the same.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the XLA backend needs jax")
onnx = pytest.importorskip("onnx")

from onnx import numpy_helper  # noqa: E402

from enginekit.backends.xla import lower  # noqa: E402
from enginekit.backends.xla.layout import ANCHORS  # noqa: E402
from enginekit.backends.xla.ops import STATIC_INPUTS, supported_ops  # noqa: E402

DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
SUITES = ("node", "pytorch-converted", "pytorch-operator", "simple")
#: XLA options that cut compile time ~4x; codegen quality is not what these tests check.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
CHUNK = 60

#: Claimed cases that need a variant the backend does not offer: pattern -> reason.
EXCLUDED = {
    r"FLOAT8|FLOAT4|E8M0|INT4|INT2|e4m3|e5m2|float4|int4|int2|STRING|string": (
        "string, float8, float4, int4 and int2 tensors are not supported"
    ),
    r"_bf16(_expanded)?$": (
        "bfloat16 attention graphs: XLA keeps bf16 intermediates in higher precision, the "
        "reference rounds after every op; they differ past the test's rtol 1e-3 (the backend "
        "builds fp32 engines only)"
    ),
    r"training_dropout(?!_zero_ratio)": (
        "training-mode Dropout (random masks): the backend builds inference engines"
    ),
    r"maxpool_with_argmax": "MaxPool's second output (Indices) is not supported",
    r"^test_identity_(opt|sequence)$|^test_if_(opt|seq)$|^test_loop13_seq$|^test_loop16_seq_none$": (
        "sequence and optional values are not supported (tensors only)"
    ),
}


@dataclasses.dataclass
class Case:
    suite: str
    name: str
    model: Any
    data: list[tuple[list[Any], list[Any]]]
    rtol: float = 1e-3
    atol: float = 1e-7


@dataclasses.dataclass
class Report:
    suite: str
    claimed: int = 0
    unclaimed: int = 0
    passed: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    excluded: dict[str, bool] = dataclasses.field(default_factory=dict)  # name -> still fails
    ops: set[str] = dataclasses.field(default_factory=set)  # ops of passing cases

    def line(self) -> str:
        failing = sum(self.excluded.values())
        rate = len(self.passed) / max(len(self.passed) + len(self.failed), 1)
        return (
            f"ONNX {self.suite}: {len(self.passed)}/{self.claimed - len(self.excluded)} claimed "
            f"cases pass ({rate:.1%}); {len(self.excluded)} known exclusions ({failing} fail "
            f"as expected); {self.unclaimed} cases use ops the backend does not claim"
        )


def _array(value: Any) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def _node_cases() -> list[Case]:
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = node.collect_testcases(None)
    return [Case("node", c.name, c.model, c.data_sets, c.rtol, c.atol) for c in found]


def _index(path: Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


def _disk_cases(suite: str) -> list[Case]:
    cases = []
    for folder in sorted((DATA / suite).iterdir()):
        model = onnx.load(str(folder / "model.onnx"))
        data = []
        for ds in sorted(folder.glob("test_data_set_*")):
            ins = [onnx.load_tensor(str(p)) for p in sorted(ds.glob("input_*.pb"), key=_index)]
            outs = [onnx.load_tensor(str(p)) for p in sorted(ds.glob("output_*.pb"), key=_index)]
            data.append((ins, outs))
        cases.append(Case(suite, folder.name, model, data))
    return cases


def _claimed(model: Any, ops: set[str]) -> bool:
    return all(n.domain in ("", "ai.onnx") and n.op_type in ops for n in model.graph.node)


def _exclusion(name: str) -> str | None:
    return next((reason for pattern, reason in EXCLUDED.items() if re.search(pattern, name)), None)


def _all_nodes(graph: Any) -> list[Any]:
    """A graph's nodes and, recursively, those of its nodes' subgraphs (If branches)."""
    found = []
    for node in graph.node:
        found.append(node)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                found.extend(_all_nodes(sub))
    return found


def _static_names(model: Any) -> set[str]:
    """Tensors that decide shapes, and everything they are computed from (not via Shape)."""
    nodes = _all_nodes(model.graph)
    static = {
        n.input[i]
        for n in nodes
        for i in STATIC_INPUTS.get(n.op_type, ())
        if i < len(n.input) and n.input[i]
    }
    producers = {o: n for n in nodes for o in n.output}
    todo = list(static)
    while todo:
        node = producers.get(todo.pop())
        if node is None or node.op_type in ("Shape", "Size"):
            continue
        branches = [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
        results = [o.name for g in branches for o in g.output]  # an If's outputs come from these
        for name in [*node.input, *results]:
            if name and name not in static:
                static.add(name)
                todo.append(name)
    return static


def _bake(model: Any, inputs: list[Any]) -> tuple[Any, list[np.ndarray]]:
    baked = onnx.ModelProto()
    baked.CopyFrom(model)
    static = _static_names(model)
    runtime = []
    for info, value in zip(model.graph.input, inputs):
        if info.name in static:
            baked.graph.initializer.append(numpy_helper.from_array(_array(value), info.name))
        else:
            runtime.append(_array(value))
    return baked, runtime


@dataclasses.dataclass
class Job:
    case: Case
    lowered: Any
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]


def _jobs(case: Case) -> list[Job]:
    layouts = (
        ["nhwc", "nchw"] if any(n.op_type in ANCHORS for n in case.model.graph.node) else ["nhwc"]
    )
    jobs = []
    for inputs, outputs in case.data:
        model, runtime = _bake(case.model, list(inputs))
        for layout in layouts:
            lowered = lower.lower(model, layout)
            jobs.append(Job(case, lowered, runtime, [_array(o) for o in outputs]))
    return jobs


def _run(jobs: list[Job]) -> list[Any]:
    fns = [j.lowered.fn for j in jobs]

    def many(weights: tuple[Any, ...], inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(f(w, x) for f, w, x in zip(fns, weights, inputs))

    args = (tuple(j.lowered.weights for j in jobs), tuple(tuple(j.inputs) for j in jobs))
    with jax.enable_x64(True):
        return list(jax.jit(many).lower(*args).compile(FAST_COMPILE)(*args))


def _check(job: Job, got: Any) -> None:
    assert len(got) == len(job.outputs), f"{len(got)} outputs, expected {len(job.outputs)}"
    for g, want in zip(got, job.outputs):
        g = np.asarray(g)
        assert g.dtype == want.dtype, f"dtype {g.dtype}, expected {want.dtype}"
        assert g.shape == want.shape, f"shape {g.shape}, expected {want.shape}"
        if jax.numpy.issubdtype(want.dtype, jax.numpy.inexact):
            np.testing.assert_allclose(
                g, want, rtol=job.case.rtol, atol=job.case.atol, equal_nan=True
            )
        else:
            np.testing.assert_array_equal(g, want)


def _outcome(run: Any, job: Job) -> str | None:
    try:
        _check(job, run)
    except AssertionError as exc:
        return str(exc).strip().replace("\n", " ")[:300]
    return None


def run_suite(cases: list[Case]) -> Report:
    """Lower, run and compare every claimed case; never raises for a failing case."""
    ops = set(supported_ops())
    report = Report(cases[0].suite if cases else "?")
    errors: dict[str, str] = {}
    batch: list[Job] = []
    single: list[Job] = []
    for case in cases:
        if not _claimed(case.model, ops):
            report.unclaimed += 1
            continue
        report.claimed += 1
        try:
            jobs = _jobs(case)
        except Exception as exc:  # a BuildError at lowering: the case fails (or is excluded)
            errors[case.name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        (single if _exclusion(case.name) else batch).extend(jobs)
    chunks = [batch[i : i + CHUNK] for i in range(0, len(batch), CHUNK)] + [[j] for j in single]
    for chunk in chunks:
        try:
            results = _run(chunk)
        except Exception:
            results = []
            for job in chunk:
                try:
                    results.append(_run([job])[0])
                except Exception as exc:
                    results.append(f"{type(exc).__name__}: {exc}"[:300])
        for job, result in zip(chunk, results):
            problem = result if isinstance(result, str) else _outcome(result, job)
            if problem and job.case.name not in errors:
                errors[job.case.name] = problem
    for case in cases:
        if not _claimed(case.model, ops):
            continue
        if _exclusion(case.name):
            report.excluded[case.name] = case.name in errors
        elif case.name in errors:
            report.failed[case.name] = errors[case.name]
        else:
            report.passed.append(case.name)
            report.ops.update(n.op_type for n in case.model.graph.node)
    return report


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    loaded = {s: _node_cases() if s == "node" else _disk_cases(s) for s in SUITES}
    return {suite: run_suite(cases) for suite, cases in loaded.items()}


@pytest.mark.slow
@pytest.mark.parametrize("suite", SUITES)
def test_every_claimed_onnx_case_passes(suite, reports, capsys):
    report = reports[suite]
    with capsys.disabled():
        print(f"\n[xla] {report.line()}")
    assert report.passed, f"no {suite} case ran"
    failures = "\n".join(f"  {n}: {e}" for n, e in sorted(report.failed.items()))
    assert not report.failed, f"{len(report.failed)} claimed {suite} cases fail:\n{failures}"


@pytest.mark.slow
def test_every_supported_op_passes_some_onnx_case(reports):
    exercised = set().union(*(r.ops for r in reports.values()))
    untested = sorted(set(supported_ops()) - exercised)
    assert not untested, f"ops claimed without a passing ONNX test case: {untested}"
