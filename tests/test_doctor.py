"""`doctor` lints untrusted ONNX files; `run` checks feeds against the input contract."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxmedic import api
from tests import onnx_models as om
from tests.test_cli import cli


def _codes(r):
    return [f.code for f in r.findings]


def _model_with_external(tmp_path, location: str):
    return om.external_data_model(tmp_path / "ext.onnx", location)


def test_doctor_clean_model(tmp_path):
    p = om.identity_model(tmp_path / "id.onnx")
    r = api.doctor(p)
    assert r.ok and r.stages == {"load": "passed", "check": "passed", "lint": "passed",
                                 "runtime": "passed"}
    assert "OM534" in _codes(r)


def test_doctor_dynamic_dims_and_unused_initializers(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    inits = [numpy_helper.from_array(np.zeros(3, np.float32), "b"),
             numpy_helper.from_array(np.zeros(100, np.float32), "dead")]
    g = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"])], "g", [x], [y], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "m.onnx")
    r = api.doctor(tmp_path / "m.onnx")
    assert r.ok
    f530 = next(f for f in r.findings if f.code == "OM530")
    assert f530.details["unused"] == ["dead"] and f530.severity.value == "warning"
    f531 = next(f for f in r.findings if f.code == "OM531")
    assert "x[batch]" in f531.message


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "sub/../../x.bin",
                                      "link.bin"])
def test_doctor_refuses_escaping_external_data(tmp_path, location):
    if location == "link.bin":
        os.symlink("/etc/passwd", tmp_path / "link.bin")
    p = _model_with_external(tmp_path, location)
    r = api.doctor(p)
    assert not r.ok and r.stages["load"] == "failed" and r.stages["runtime"] == "not run"
    (f,) = r.errors
    assert f.code == "OM520" and location in f.message
    rr = api.run(p, [np.zeros((2, 3), np.float32)])
    assert not rr.ok and rr.errors[0].code == "OM520" and rr.stages["runtime"] == "not run"
    import torch

    from tests import models
    rv = api.verify(p, models.Identity(), (torch.randn(2, 3),))
    assert not rv.ok and rv.errors[0].code == "OM520" and rv.stages["runtime"] == "not run"


def test_doctor_missing_external_data(tmp_path):
    r = api.doctor(_model_with_external(tmp_path, "ext.onnx.data"))
    assert [f.code for f in r.errors] == ["OM521"]


def test_doctor_external_data_beside_model_is_fine(tmp_path):
    p = _model_with_external(tmp_path, "ext.onnx.data")
    (tmp_path / "ext.onnx.data").write_bytes(np.ones(6, np.float32).tobytes())
    r = api.doctor(p)
    assert r.ok, [f.one_paragraph() for f in r.findings]


def test_doctor_opset_newer_than_runtime(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 99)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "new.onnx")
    r = api.doctor(tmp_path / "new.onnx")
    codes = [f.code for f in r.errors]
    assert "OM533" in codes and "OM510" in codes
    f = next(f for f in r.errors if f.code == "OM533")
    assert "opset 99" in f.message and "--opset" in f.suggestion


def test_doctor_hang_and_bad_files(tmp_path):
    r = api.doctor(om.endless_loop_model(tmp_path / "h.onnx"), timeout=8)
    assert [f.code for f in r.errors] == ["OM512"]
    (tmp_path / "junk.onnx").write_bytes(os.urandom(100))
    r = api.doctor(tmp_path / "junk.onnx")
    assert [f.code for f in r.errors] == ["OM007"]
    r = api.doctor(tmp_path / "absent.onnx")
    assert [f.code for f in r.errors] == ["OM007"]


def test_run_checks_the_input_contract(tmp_path):
    p = om.identity_model(tmp_path / "id.onnx")
    good = np.ones((2, 3), np.float32)
    r = api.run(p, [good])
    assert r.ok and np.array_equal(r.outputs["y"], good)
    r = api.run(p, {"x": good.astype(np.float64)})
    (f,) = r.errors
    assert f.code == "OM008" and "float64" in f.message and "--cast-lossy" in f.suggestion
    r = api.run(p, {"x": good.astype(np.float64)}, cast="all")
    assert r.ok
    r = api.run(p, {"x": good.astype(np.float16)}, cast="safe")
    assert r.ok and any("cast from float16" in f.message for f in r.findings)
    r = api.run(p, {"x": good[None]})
    assert "rank 3" in r.errors[0].message
    r = api.run(p, {"x": np.ones((2, 4), np.float32)})
    assert "dim 1 is 4" in r.errors[0].message and "--dynamic" in r.errors[0].suggestion
    r = api.run(p, {"z": good})
    assert {f.code for f in r.errors} == {"OM008"} and len(r.errors) == 2
    r = api.run(p, [good, good])
    assert "1 input(s)" in r.errors[0].message


def test_cli_doctor_and_run(tmp_path):
    p = om.identity_model(tmp_path / "id.onnx")
    out = cli("doctor", str(p), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["ok"]
    np.savez(tmp_path / "in.npz", x=np.ones((2, 3), np.float32))
    out = cli("run", str(p), "--input", str(tmp_path / "in.npz"), "--save",
              str(tmp_path / "out.npz"))
    assert out.returncode == 0, out.stderr
    with np.load(tmp_path / "out.npz") as d:
        assert np.array_equal(d["y"], np.ones((2, 3), np.float32))
    out = cli("run", str(p), "--input", "2x3:int32")
    assert out.returncode == 1 and "OM008" in out.stderr and "--cast" in out.stderr
    out = cli("run", str(p), "--input", "2x3:int32", "--cast-lossy")
    assert out.returncode == 0 and "y: float32[2, 3]" in out.stdout
    out = cli("doctor", str(om.endless_loop_model(tmp_path / "h.onnx")), "--timeout", "8")
    assert out.returncode == 1 and "OM512" in out.stderr


def test_doctor_and_run_report_the_cpu_fallback_for_cuda(tmp_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA: nothing falls back")
    p = om.identity_model(tmp_path / "id.onnx")
    assert "OM535" in _codes(api.doctor(p, target="cuda"))
    r = api.run(p, [np.ones((2, 3), np.float32)], target="cuda")
    assert r.ok and "OM535" in _codes(r)


def test_doctor_huge_dims_skip_the_smoke_test(tmp_path):
    for i, dims in enumerate(([2**40, 3], [0, 2**62])):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        m.ir_version = 10
        onnx.save(m, tmp_path / f"h{i}.onnx")
        r = api.doctor(tmp_path / f"h{i}.onnx")
        assert r.ok and any(f.code == "OM603" and "too large" in f.message for f in r.findings)


def test_file_over_protobuf_limit_is_refused_unread(tmp_path):
    """A single .onnx over 2 GiB cannot be a valid protobuf: refuse it before reading it
    (a sparse file, so the test costs no disk)."""
    import time

    import torch

    from tests import models
    p = tmp_path / "huge.onnx"
    with open(p, "wb") as fh:
        fh.truncate(2**31 + 10)
    t0 = time.monotonic()
    for r in (api.doctor(p), api.run(p, [np.zeros((2, 3), np.float32)]),
              api.verify(p, models.Identity(), (torch.randn(2, 3),))):
        assert not r.ok and [f.code for f in r.errors] == ["OM007"]
        assert "2 GiB" in r.errors[0].message and "external data" in r.errors[0].suggestion
    assert time.monotonic() - t0 < 30


def test_verify_and_doctor_models_with_external_data(tmp_path, monkeypatch):
    """Models over 2 GiB are written with external data; verify, doctor and run read them by
    path (the weights never pass through protobuf). Threshold lowered so the test is small."""
    import torch

    import onnxmedic
    from onnxmedic import onnxfile
    from tests import models

    monkeypatch.setattr(onnxfile, "EXTERNAL_DATA_THRESHOLD", 100)
    x = torch.randn(1, 3, 8, 8)
    out = tmp_path / "big.onnx"
    assert onnxmedic.export(models.ConvLog1p(), (x,), out).ok
    assert (tmp_path / "big.onnx.data").stat().st_size > 100
    r = api.verify(out, models.ConvLog1p(), (x,))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert api.doctor(out).ok
    rr = api.run(out, [x.numpy()])
    assert rr.ok and np.allclose(next(iter(rr.outputs.values())), models.ConvLog1p()(x).detach().numpy(),
                                 rtol=1e-4, atol=1e-5)
    # the weights really come from the .data file: damage it and verification fails
    data = bytearray((tmp_path / "big.onnx.data").read_bytes())
    data[:64] = b"\x7f" * 64
    (tmp_path / "big.onnx.data").write_bytes(bytes(data))
    assert not api.verify(out, models.ConvLog1p(), (x,)).ok
