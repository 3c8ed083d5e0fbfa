"""TVM backend: layout, fusion, artifacts in a fresh process, tampering, cross-compiled targets,
tuning with a reused database, op errors, availability."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import reference
from models import CASES
from onnx import TensorProto, helper

import enginekit as ek
from enginekit import backends
from enginekit import target as host
from enginekit.artifact import open_artifact

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm (pip install 'enginekit[tvm]')")

from enginekit.backends import tvm as tvm_backend

CNN = CASES["cnn"]


@pytest.fixture(scope="module")
def cnn_path(onnx_model) -> Path:
    return onnx_model("cnn")


@pytest.fixture(scope="module")
def cnn_nhwc(cnn_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tvm") / "cnn-nhwc.ekit"
    ek.build(cnn_path, backend="tvm", shapes=CNN.shapes, layout="NHWC", output=out).close()
    return out


def test_available_reports_version_and_cpu():
    avail = backends.availability("tvm")
    assert avail.available, avail.reason
    assert avail.version and avail.version[0].isdigit()
    assert "cpu" in avail.devices


def test_available_says_why_when_tvm_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "tvm", None)  # `import tvm` now raises ImportError
    avail = tvm_backend.available()
    assert not avail.available
    assert "enginekit[tvm]" in avail.reason


def test_nhwc_build_leaves_no_nchw_conv_and_matches_nchw(cnn_path, cnn_nhwc, tmp_path):
    nhwc = open_artifact(cnn_nhwc).manifest["backend"]["metadata"]
    assert nhwc["layout"] == "NHWC"
    assert set(nhwc["conv_layouts"]) == {"NHWC/HWIO"}
    assert nhwc["transposes"] <= 2  # only at the model's edges: input in, pooled features out
    nchw_engine = ek.build(cnn_path, backend="tvm", shapes=CNN.shapes, layout="NCHW")
    nchw = nchw_engine.manifest["backend"]["metadata"]
    assert set(nchw["conv_layouts"]) == {"NCHW/OIHW"} and nchw["transposes"] == 0
    feeds = CNN.feeds(6, seed=3)
    with ek.load(cnn_nhwc) as engine:
        np.testing.assert_allclose(
            engine.infer(feeds)["output"], nchw_engine.infer(feeds)["output"], atol=1e-4, rtol=1e-3
        )
    nchw_engine.close()


def test_inspect_lists_fused_kernels_transposes_and_layout(cnn_nhwc):
    info = tvm_backend.inspect(open_artifact(cnn_nhwc))
    assert info["layout"] == "NHWC" and info["transposes"] <= 2
    convs = [k for k in info["fused"] if "conv2d" in k]
    assert convs and all("relu" in k for k in convs)  # conv + bias + activation, one kernel
    assert any("matmul" in k and "add" in k for k in info["fused"])  # matmul + bias
    detailed = tvm_backend.inspect(open_artifact(cnn_nhwc), ir=True)
    blocks = [b for kernel in detailed["kernel_blocks"].values() for b in kernel]
    assert any(b.startswith("conv2d_nhwc") for b in blocks)  # scheduled blocks get suffixes


def test_default_schedules_cover_the_kernels_and_none_leaves_them_naive(cnn_path, cnn_nhwc):
    kernels = json.loads(open_artifact(cnn_nhwc).read("kernels.json"))["kernels"]
    assert all(k["scheduled"] for k in kernels if "conv2d" in k["name"])
    naive = ek.build(cnn_path, backend="tvm", shapes=CNN.shapes, schedule="none", verify=True)
    assert naive.manifest["verify"]["passed"]
    naive.close()


def test_artifact_loads_and_runs_in_a_new_process(cnn_path, cnn_nhwc, tmp_path):
    feeds = CNN.feeds(3, seed=11)
    np.savez(tmp_path / "in.npz", **feeds)
    script = (
        "import sys, numpy as np, enginekit as ek\n"
        f"e = ek.load({str(cnn_nhwc)!r})\n"
        f"x = dict(np.load({str(tmp_path / 'in.npz')!r}))\n"
        f"np.save({str(tmp_path / 'out.npy')!r}, e.infer(x)['output'])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(ek.__file__).parents[1]))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    got = np.load(tmp_path / "out.npy")
    np.testing.assert_allclose(got, reference(cnn_path, feeds)["output"], atol=1e-4, rtol=1e-3)


def test_tampered_library_is_refused(cnn_path, tmp_path):
    out = tmp_path / "cnn-dir/"
    ek.build(cnn_path, backend="tvm", shapes=CNN.shapes, output=str(out) + "/").close()
    lib = out / "payload" / "model.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    with pytest.raises(ek.ArtifactError, match="checksum"):
        ek.load(out)


def test_non_contiguous_unaligned_and_readonly_inputs_give_the_same_results(cnn_nhwc):
    feeds = CNN.feeds(4, seed=5)["x"]
    with ek.load(cnn_nhwc) as engine:
        want = engine.infer(feeds)["output"]
        strided = np.asfortranarray(feeds)
        raw = np.empty(feeds.size + 1, np.float32)[1:].reshape(feeds.shape)  # 4-byte offset
        raw[...] = feeds
        assert raw.ctypes.data % 64 != 0
        readonly = np.frombuffer(feeds.tobytes(), np.float32).reshape(feeds.shape)
        assert not readonly.flags.writeable  # as onnx.numpy_helper.to_array gives them
        for variant in (strided, raw, readonly):
            np.testing.assert_array_equal(engine.infer(variant)["output"], want)
        first = engine.infer(feeds)["output"]
        engine.infer(CNN.feeds(4, seed=6))  # outputs are not reused buffers
        np.testing.assert_array_equal(first, want)


def test_cross_compiled_target_is_written_and_refused_on_a_host_without_its_features(
    cnn_path, tmp_path
):
    out = tmp_path / "spr.ekit"
    engine = ek.build(
        cnn_path,
        backend="tvm",
        shapes=CNN.shapes,
        target={"kind": "llvm", "mcpu": "sapphirerapids"},
        output=out,
    )
    requires = engine.manifest["target"]["requires"]
    assert {"avx512f", "amx_tile"} <= set(requires)
    if set(requires) <= host.cpu_flags():
        pytest.skip("this host has every feature of a Sapphire Rapids CPU")
    with pytest.raises(ek.EnginekitError, match="cross-compiled"):
        engine.infer(CNN.feeds(1))
    with pytest.raises(ek.ArtifactError, match="CPU features"):
        ek.load(out)
    with pytest.raises(ek.ArtifactError, match="CPU features"):  # the backend checks on its own
        tvm_backend.load(open_artifact(out), "cpu")


def test_unsupported_op_names_the_op_and_the_node(tmp_path):
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="first"),
            helper.make_node("Det", ["r"], ["y"], name="determinant"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])],
    )
    path = tmp_path / "det.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    # Det has neither a TVM converter nor an ONNX function body to expand.
    with pytest.raises(ek.BuildError, match=r"'Det'.*'determinant'"):
        ek.build(path, backend="tvm", shapes={"x": [(1, 3, 3), (2, 3, 3), (4, 3, 3)]})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layout": "NCWH"}, "layout"),
        ({"schedule": "fast"}, "schedule"),
        ({"target": {"kind": "llvm", "mcpu": "not-a-cpu"}}, "mcpu"),
        ({"target": "opencl"}, "target kind"),
        ({"tune": {"trials": 4, "rounds": 2}}, "unknown key"),
        ({"tune": {"trials": 4, "batch_sizes": [64]}}, "outside every profile"),
        ({"tune": {"trials": -1}}, "trials"),
        ({"fuse": True}, "no option"),
    ],
)
def test_bad_options_are_refused_before_compiling(mlp_path, options, message):
    with pytest.raises(ek.BuildError, match=message):
        ek.build(mlp_path, backend="tvm", shapes=CASES["mlp"].shapes, **options)


def test_precision_other_than_fp32_is_refused(mlp_path):
    with pytest.raises(ek.BuildError, match="fp32"):
        ek.build(mlp_path, backend="tvm", precision="fp16")


@pytest.mark.slow
def test_tuning_builds_a_static_module_and_a_reused_database_runs_no_trials(cnn_path, tmp_path):
    pytest.importorskip("xgboost", reason="tuning needs the tvm-tune extra")
    db = tmp_path / "tvm-db"
    # serve="always": this test is about the tuned module, not whether it wins on this host.
    tune = {"trials": 7, "batch_sizes": [4], "method": "metaschedule", "serve": "always"}
    first = ek.build(
        cnn_path, backend="tvm", shapes=CNN.shapes, tune=tune, tuning_db=str(db),
        specialize=False, output=tmp_path / "a.ekit",
    )  # fmt: skip
    meta = first.manifest["backend"]["metadata"]
    assert meta["tuning"]["trials_run"] > 0 and meta["tuning"]["seconds"] > 0
    # enginekit's default schedules compete as records: tuning never picks a slower kernel.
    assert meta["tuning"]["runs"]["4"]["default_schedules_measured"] > 0
    static = [m for m in meta["modules"] if m["shapes"]]
    assert static == [m for m in static if m["shapes"] == {"x": [4, 3, 16, 16]}] and static
    assert static[0]["tuned_kernels"]
    records = (db / "database_tuning_record.json").read_bytes()
    second = ek.build(
        cnn_path, backend="tvm", shapes=CNN.shapes, tune=tune, tuning_db=str(db),
        specialize=False, output=tmp_path / "b.ekit",
    )  # fmt: skip
    again = second.manifest["backend"]["metadata"]["tuning"]
    assert again["trials_run"] == 0 and again["runs"]["4"]["tuned_now"] == 0
    assert (db / "database_tuning_record.json").read_bytes() == records
    engine = ek.load(tmp_path / "b.ekit")
    assert engine.static_shapes == [{"x": (4, 3, 16, 16)}]
    for batch in (4, 3):  # the tuned static module, then the dynamic one
        feeds = CNN.feeds(batch, seed=batch)
        np.testing.assert_allclose(
            engine.infer(feeds)["output"],
            reference(cnn_path, feeds)["output"],
            atol=1e-4,
            rtol=1e-3,
        )
    for e in (first, second, engine):
        e.close()


def test_cli_build_maps_tvm_flags_to_options(cnn_path, tmp_path, capsys):
    from enginekit.cli import main

    out = tmp_path / "cli.ekit"
    shapes = "x:1x3x16x16,4x3x16x16,8x3x16x16"
    code = main(
        ["build", str(cnn_path), "--backend", "tvm", "--layout", "NCHW", "--target", "llvm"]
        + ["--shapes", shapes, "-o", str(out), "--json"]
    )
    assert code == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["config"]["options"] == {"layout": "NCHW", "target": "llvm"}
    assert manifest["backend"]["metadata"]["layout"] == "NCHW"
    assert manifest["target"]["requires"] == []  # generic llvm: portable code
    usage = ["build", str(cnn_path), "--backend", "tvm", "--tune-batch", "4", "-o", str(out)]
    assert main(usage) == 2
    assert "--tune-batch needs --tune-trials" in capsys.readouterr().err


@pytest.mark.slow
def test_cuda_target_cross_compiles_without_a_gpu(cnn_path, tmp_path):
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("TVM compiles CUDA kernels with nvcc, which is not installed")
    out = tmp_path / "cuda.ekit"
    engine = ek.build(
        cnn_path, backend="tvm", shapes=CNN.shapes, target="cuda -arch=sm_90", output=out
    )
    assert engine.manifest["target"]["kind"] == "cuda"
    assert engine.manifest["target"]["compute_capability"] == "9.0"
    if "cuda" not in backends.availability("tvm").devices:
        with pytest.raises(ek.ArtifactError, match="device='cuda'"):
            tvm_backend.load(open_artifact(out), "cpu")


def test_enginekit_schedule_applies_to_every_conv_and_matmul_kernel(cnn_path):
    # Called directly: ApplyDefaultSchedule would swallow an error and fall back to naive loops.
    from enginekit.backends.tvm import frontend, lower, schedule, simd

    target = lower.resolve_target(None, "cpu")
    _, fused, _ = lower.optimize(frontend.import_onnx(ek.load_model(cnn_path)), target, "NHWC")
    lanes = simd.vector_lanes(target)
    names = []
    for gv, func in fused.functions_items():
        if "conv2d" in gv.name_hint or "matmul" in gv.name_hint:
            sch = schedule.schedule_cpu(func, lanes)
            assert sch is not None, gv.name_hint
            assert "parallel" in sch.mod.script() and "vectorized" in sch.mod.script()
            names.append(gv.name_hint)
    assert len(names) == 3


def test_error_line_skips_the_printer_footer_of_a_printed_expression():
    # TVM's errors often end with a printed expression, whose last line is the printer's
    # "# Metadata omitted..." footer; enginekit's one-line messages show the failure instead.
    from tvm import relax

    from enginekit.backends.tvm.messages import error_line

    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    printed = str(relax.op.add(x, relax.const(np.ones((2, 3), "float32"))))
    assert printed.strip().splitlines()[-1].startswith("# Metadata omitted")
    exc = ValueError(f"Reshape expects a known shape, got: {printed}")
    assert (
        error_line(exc)
        == 'Reshape expects a known shape, got: R.add(x, metadata["ir.GenericConst"][0])'
    )


def test_axes_fed_as_a_graph_input_are_compiled_in_per_value(tmp_path):
    # TVM compiles reduction axes in as constants; fed at run time, the importer failed with
    # "Only constant axes currently supported" and no node named. Now `axes` is a value input
    # (tvm/values.py): one program per set of axes; the importer's own guard still names the
    # node for a model imported with the input unbound.
    from enginekit.backends.tvm import frontend

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum_rows", keepdims=1)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("axes", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    path = tmp_path / "axes.onnx"
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(proto, path)
    with pytest.raises(ek.BuildError, match=r"axes of op 'ReduceSum' at node 'sum_rows'.*'axes'"):
        frontend.check_nodes(proto)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with ek.build(path, backend="tvm", shapes={"x": [(2, 3)] * 3, "axes": [(1,)] * 3}) as e:
        for axis in (0, 1, -1):
            feeds = {"x": x, "axes": np.array([axis], np.int64)}
            np.testing.assert_array_equal(e.infer(feeds)["y"], reference(path, feeds)["y"])


def test_an_output_made_from_shapes_alone_comes_back_as_an_array(tmp_path):
    # Shape(x)[1:] compiles to TVM's Shape (a tuple of ints), not a tensor: the engine read
    # it as a list of outputs ("'int' object has no attribute '__dlpack__'").
    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["dims"], start=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 5])],
        [helper.make_tensor_value_info("dims", TensorProto.INT64, [2])],
    )
    path = tmp_path / "shape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    with ek.build(path, backend="tvm", shapes={"x": [(1, 3, 5), (2, 3, 5), (4, 3, 5)]}) as e:
        got = e.infer({"x": np.zeros((2, 3, 5), np.float32)})["dims"]
        assert got.dtype == np.int64 and got.tolist() == [3, 5]
