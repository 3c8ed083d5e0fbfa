"""Artifacts: the .ekit file and directory forms, the manifest, and every way one can be broken."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
from models import CASES

import enginekit as ek
from enginekit.artifact import FORMAT_VERSION, MANIFEST, PAYLOAD


@pytest.fixture(scope="module")
def built(onnx_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifact") / "mlp.ekit"
    ek.build(onnx_model("mlp"), shapes=CASES["mlp"].shapes, output=out).close()
    return out


def rewrite(src, dst, change_manifest=None, drop=None, payload_bytes=None):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == drop:
                continue
            if item.filename == MANIFEST and change_manifest:
                manifest = json.loads(data)
                change_manifest(manifest)
                data = json.dumps(manifest).encode()
            if item.filename.startswith(PAYLOAD) and payload_bytes is not None:
                data = payload_bytes(data)
            zout.writestr(item.filename, data)
    return dst


def test_manifest_records_what_the_build_did(built, onnx_model):
    manifest = ek.load(built).manifest
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["enginekit_version"] == ek.__version__
    assert manifest["backend"]["name"] == "onnxruntime" and manifest["backend"]["version"]
    assert manifest["source"]["sha256"] == ek.load_model(onnx_model("mlp")).sha256
    assert manifest["config"]["profiles"] == [{"x": [[1, 16], [8, 16], [16, 16]]}]
    assert manifest["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}]
    assert manifest["precision"] == "fp32"
    assert manifest["verify"]["passed"] is True
    assert {c["shapes"]["x"][0] for c in manifest["verify"]["cases"]} == {1, 16}
    assert set(manifest["payload"]) == {"model.onnx"}
    assert len(manifest["payload"]["model.onnx"]["sha256"]) == 64
    assert manifest["target"]["kind"] == "cpu" and "machine" in manifest["target"]
    assert manifest["build"]["build_s"] >= 0 and len(manifest["build_key"]) == 64


def test_artifact_is_a_stored_zip_without_pickle(built):
    with zipfile.ZipFile(built) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
        assert sorted(z.namelist()) == [MANIFEST, PAYLOAD + "model.onnx"]
        for name in z.namelist():
            assert not z.read(name).startswith(b"\x80")  # pickle protocol marker


def test_truncated_file_is_refused(built, tmp_path):
    bad = tmp_path / "truncated.ekit"
    data = built.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ek.ArtifactError, match="truncated or corrupt"):
        ek.load(bad)


def test_bit_flip_in_payload_is_refused(built, tmp_path):
    bad = tmp_path / "flipped.ekit"
    data = bytearray(built.read_bytes())
    offset = data.index(b"\x08", data.index(b"model.onnx") + 40)  # a byte inside the payload
    data[offset] ^= 0x01
    bad.write_bytes(bytes(data))
    with pytest.raises(ek.ArtifactError, match="corrupt|checksum"):
        ek.load(bad)


def test_payload_rewritten_with_valid_crc_fails_checksum(built, tmp_path):
    bad = rewrite(
        built, tmp_path / "tampered.ekit", payload_bytes=lambda b: b[:-1] + bytes([b[-1] ^ 1])
    )
    with pytest.raises(ek.ArtifactError, match="changed since it was built"):
        ek.load(bad)


def test_future_format_version_is_refused(built, tmp_path):
    def bump(m):
        m["format_version"] = FORMAT_VERSION + 1
        m["enginekit_version"] = "9.0.0"

    with pytest.raises(ek.ArtifactError, match="format 2 was written by enginekit 9.0.0.*Upgrade"):
        ek.load(rewrite(built, tmp_path / "future.ekit", change_manifest=bump))


def test_missing_payload_is_refused(built, tmp_path):
    bad = rewrite(built, tmp_path / "nopayload.ekit", drop=PAYLOAD + "model.onnx")
    with pytest.raises(ek.ArtifactError, match="cannot read payload 'model.onnx'"):
        ek.load(bad)


def test_host_lacking_target_features_is_refused(built, tmp_path):
    def exotic(m):
        m["target"]["requires"] = ["avx512f", "amx_fp64_from_the_future"]

    with pytest.raises(ek.ArtifactError, match="amx_fp64_from_the_future.*Rebuild it on this host"):
        ek.load(rewrite(built, tmp_path / "exotic.ekit", change_manifest=exotic))


def test_unknown_backend_is_refused(built, tmp_path):
    def other(m):
        m["backend"]["name"] = "nosuchbackend"

    with pytest.raises(ek.ArtifactError, match="no backend named 'nosuchbackend'"):
        ek.load(rewrite(built, tmp_path / "other.ekit", change_manifest=other))


def test_not_an_artifact(tmp_path):
    with pytest.raises(ek.ArtifactError, match="no such engine artifact"):
        ek.load(tmp_path / "missing.ekit")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ek.ArtifactError, match="without manifest.json"):
        ek.load(tmp_path / "empty")
    junk = tmp_path / "junk.ekit"
    junk.write_text("hello")
    with pytest.raises(ek.ArtifactError, match="not a valid .ekit"):
        ek.load(junk)


def test_directory_artifact_round_trip_and_tamper(onnx_model, tmp_path):
    out = tmp_path / "engine-dir"
    ek.build(onnx_model("mlp"), output=str(out) + "/").close()
    assert (out / MANIFEST).is_file() and (out / PAYLOAD / "model.onnx").is_file()
    x = np.ones((2, 16), np.float32)
    assert ek.load(out).infer(x)["output"].shape == (2, 4)
    with open(out / PAYLOAD / "model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ek.ArtifactError, match="changed since it was built"):
        ek.load(out)


def test_rebuild_replaces_artifact_atomically(onnx_model, tmp_path):
    out = tmp_path / "m.ekit"
    ek.build(onnx_model("mlp"), output=out).close()
    first = ek.load(out).manifest["build"]["created"]
    ek.build(onnx_model("mlp"), shapes=CASES["mlp"].shapes, output=out).close()
    assert ek.load(out).manifest["profiles"] and first
    assert [p.name for p in tmp_path.iterdir()] == ["m.ekit"]


def test_the_rebuild_hint_is_the_full_command_that_makes_the_same_engine(built, tmp_path):
    def exotic(m):
        m["target"]["requires"] = ["amx_fp64_from_the_future"]
        m["config"]["options"] = {"intra_op_threads": 1}

    with pytest.raises(ek.ArtifactError) as info:
        ek.load(rewrite(built, tmp_path / "exotic.ekit", change_manifest=exotic))
    hint = str(info.value).split("Rebuild it on this host: ")[1]
    config = ek.load(built).manifest["config"]
    shapes = ",".join("x".join(map(str, s)) for s in config["profiles"][0]["x"])
    assert f"--backend onnxruntime --shapes x:{shapes} --precision fp32" in hint
    assert "-O intra_op_threads=1" in hint and hint.endswith(f"-o {tmp_path / 'exotic.ekit'}")
