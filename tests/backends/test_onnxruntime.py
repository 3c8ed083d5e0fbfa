"""ONNX Runtime backend: build-time optimization, load-time settings, IO binding, providers."""

from __future__ import annotations

import onnx
import pytest
from conftest import reference
from models import CASES

import enginekit as ek
from enginekit.artifact import open_artifact
from enginekit.backends import onnxruntime as ort_backend


def test_available_reports_version_and_cpu():
    avail = ort_backend.available()
    assert avail.available and avail.version and "cpu" in avail.devices


@pytest.mark.parametrize("level", ["disable", "basic", "extended", "all"])
def test_payload_is_the_graph_optimized_at_the_chosen_level(onnx_model, tmp_path, level):
    out = tmp_path / f"{level}.ekit"
    ek.build(onnx_model("cnn"), output=out, optimization_level=level).close()
    artifact = open_artifact(out)
    payload = onnx.load_from_string(artifact.read("model.onnx"))
    ops = {n.op_type for n in payload.graph.node}
    assert artifact.manifest["backend"]["metadata"]["optimization_level"] == level
    # Conv+Relu fusion is an "extended" optimization; it happens at build time, not at load.
    assert ("Relu" in ops) == (level in ("disable", "basic"))
    requires = artifact.manifest["target"]["requires"]
    assert (requires != []) == (level == "all")


def test_io_binding_path_matches_plain_run(onnx_model):
    path = onnx_model("two_input")
    plain = ek.build(path, shapes=CASES["two_input"].shapes)
    bound = ek.build(path, shapes=CASES["two_input"].shapes, io_binding=True)
    assert not plain.io_binding and bound.io_binding
    for batch in (1, 3, 8, 11):
        feeds = CASES["two_input"].feeds(batch, seed=batch)
        want = reference(path, feeds)
        for engine in (plain, bound):
            got = engine.infer(feeds)
            for name in want:
                assert got[name].shape == want[name].shape
                assert abs(got[name] - want[name]).max() < 1e-5


def test_session_options_are_applied_on_load(mlp_path, tmp_path):
    out = tmp_path / "m.ekit"
    ek.build(mlp_path, output=out, intra_op_threads=1, execution_mode="parallel").close()
    engine = ek.load(out)
    assert engine.manifest["config"]["options"] == {
        "intra_op_threads": 1,
        "execution_mode": "parallel",
    }
    assert engine.session.get_session_options().intra_op_num_threads == 1


def test_allow_spinning_false_reaches_the_session(mlp_path, tmp_path):
    key = "session.intra_op.allow_spinning"
    ek.build(mlp_path, output=tmp_path / "m.ekit", allow_spinning=False).close()
    with ek.load(tmp_path / "m.ekit") as engine:
        assert engine.session.get_session_options().get_session_config_entry(key) == "0"
    ek.build(mlp_path, output=tmp_path / "d.ekit").close()
    with ek.load(tmp_path / "d.ekit") as engine:  # ORT's default (spinning) left alone
        with pytest.raises(RuntimeError, match="does not have configuration"):
            engine.session.get_session_options().get_session_config_entry(key)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"allow_spinning": "no"}, "allow_spinning 'no'"),
        ({"optimization_level": "max"}, "optimization_level 'max'"),
        ({"execution_mode": "async"}, "execution_mode 'async'"),
        ({"providers": ["gpu"]}, "provider 'gpu' is not one of"),
    ],
)
def test_bad_options_raise_build_error(mlp_path, options, message):
    with pytest.raises(ek.BuildError, match=message):
        ek.build(mlp_path, **options)


def test_requested_provider_that_falls_back_is_reported(mlp_path):
    if "cuda" in ort_backend.available().devices:
        pytest.skip("a CUDA device is present: nothing falls back")
    with pytest.warns(RuntimeWarning, match="fell back from CUDAExecutionProvider"):
        engine = ek.build(mlp_path, providers=["cuda", "cpu"])
    assert engine.providers == ["CPUExecutionProvider"]


def test_unsupported_op_is_a_build_error(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"], domain="com.example")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    with pytest.raises(ek.EnginekitError, match="NoSuchOp"):
        ek.build(model, output=tmp_path / "x.ekit")
    assert not any(tmp_path.iterdir())


def test_load_sets_threads_and_spinning_over_the_build_options(mlp_path, tmp_path):
    key = "session.intra_op.allow_spinning"
    ek.build(mlp_path, output=tmp_path / "m.ekit", intra_op_threads=2).close()
    with ek.load(tmp_path / "m.ekit", threads=1, spinning=False) as engine:
        options = engine.session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert options.get_session_config_entry(key) == "0"
        assert engine.load_options == {"threads": 1, "spinning": False}
        # The artifact is unchanged: its manifest still records the build's threads.
        assert engine.manifest["config"]["options"] == {"intra_op_threads": 2}
    with ek.load(tmp_path / "m.ekit") as engine:  # nothing set: the build's options
        assert engine.session.get_session_options().intra_op_num_threads == 2
        assert engine.load_options == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [({"threads": -1}, "threads must be an integer >= 0"), ({"spinning": "no"}, "spinning must")],
)
def test_bad_load_options_are_refused(mlp_path, tmp_path, options, message):
    ek.build(mlp_path, output=tmp_path / "m.ekit").close()
    with pytest.raises(ek.UsageError, match=message):
        ek.load(tmp_path / "m.ekit", **options)
