"""The sandbox turns ONNX Runtime hangs, crashes and out-of-memory into results, never hangs."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from onnxmedic import sandbox
from tests import onnx_models as om

X = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
# the sandbox's own children, one per run as outside the suite (conftest's keep_warm off)
pytestmark = pytest.mark.own_sandbox_children


def test_runs_model_on_several_feeds(tmp_path):
    p = om.scaled_model(tmp_path / "m.onnx", 2.0)
    r = sandbox.run_model(p, [X, {"x": X["x"] + 1}])
    assert r.ok, r.error
    assert r.output_names == ["y"]
    np.testing.assert_array_equal(r.outputs[0][0], X["x"] * 2)
    np.testing.assert_array_equal(r.outputs[1][0], (X["x"] + 1) * 2)
    assert r.inputs[0]["name"] == "x" and r.inputs[0]["shape"] == [2, 3]
    assert len(r.run_seconds) == 2


def test_load_error_is_a_finding(tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(b"\x08\x07garbage that is not a model")
    r = sandbox.run_model(p, [X])
    assert r.status == "load_error"
    assert r.finding().code == "OM510"


def test_run_error_is_a_finding(tmp_path):
    p = om.identity_model(tmp_path / "m.onnx")
    r = sandbox.run_model(p, [{"x": np.zeros((5, 7), np.float32)}])
    assert r.status == "run_error"
    f = r.finding()
    assert f.code == "OM511" and "input set 0" in f.message
    assert r.summary().startswith("run_error: ") and r.error.strip()[:40] in r.summary()


def test_hang_is_killed_and_reported(tmp_path):
    p = om.endless_loop_model(tmp_path / "hang.onnx")
    t0 = time.perf_counter()
    with sandbox.Worker() as w:
        pid, folder = w.proc.pid, w.dir
        r = w.run(p, [X], timeout=8)
    elapsed = time.perf_counter() - t0
    assert r.status == "timeout"
    assert elapsed < 8 + 30  # killed at the timeout (slack for a loaded CI machine)
    f = r.finding(timeout=8)
    assert f.code == "OM512" and "8" in f.message and "Loop" in f.suggestion
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped: no orphan, no zombie
    assert not folder.exists()


@pytest.mark.parametrize(("fault", "code", "signal"), [
    ("abort:run", "OM513", "SIGABRT"),
    ("segv:load", "OM513", "SIGSEGV"),
])
def test_crash_is_reported_with_signal(tmp_path, monkeypatch, fault, code, signal):
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", fault)
    p = om.identity_model(tmp_path / "m.onnx")
    r = sandbox.run_model(p, [X])
    assert r.status == "crash" and r.signal == signal
    f = r.finding()
    assert f.code == code and signal in f.message
    expected_phase = "loading the model" if fault.endswith("load") else "running input set 0"
    assert expected_phase in f.message
    # one line for a rejected variant: the signal and phase, never the stderr's first lines
    # (Python's warnings, where the child died without a word)
    assert r.summary() == f"crash: {signal} while {expected_phase}"


def test_memory_cap_turns_allocation_failure_into_oom(tmp_path):
    p = om.huge_expand_model(tmp_path / "oom.onnx")
    r = sandbox.run_model(p, [X], memory_limit=3 * 1024**3, timeout=60)
    assert r.status == "oom"
    assert r.finding().code == "OM514"


def test_python_oom_in_child(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "oom:run")
    p = om.identity_model(tmp_path / "m.onnx")
    r = sandbox.run_model(p, [X], memory_limit=2 * 1024**3, timeout=60)
    assert r.status == "oom"


def test_bfloat16_feeds_round_trip(tmp_path):
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [3])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3])
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "bf.onnx")
    a = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    r = sandbox.run_model(tmp_path / "bf.onnx", [{"x": a}])
    assert r.ok, r.error
    assert r.outputs[0][0].dtype == a.dtype
    np.testing.assert_array_equal(r.outputs[0][0].astype(np.float32), a.astype(np.float32))


def test_zero_d_inputs_keep_their_shape(tmp_path):
    """A 0-d feed must reach ONNX Runtime as 0-d (np.ascontiguousarray would make it (1,))."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [1])
    g = helper.make_graph([helper.make_node("Shape", ["x"], ["s"]),
                           helper.make_node("Size", ["s"], ["y0"]),
                           helper.make_node("Unsqueeze", ["y0", "axes"], ["y"])], "g", [x], [y],
                          [onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "rank.onnx")
    r = sandbox.run_model(tmp_path / "rank.onnx", [{"x": np.array(2.0, np.float32)}])
    assert r.ok, r.error
    assert r.outputs[0][0].tolist() == [0]  # rank 0


@pytest.mark.parametrize("n_outputs", [3, 40])  # 40 > PACK_MIN: written as one packed file
def test_many_outputs_round_trip(tmp_path, n_outputs):
    """Every output comes back with its dtype, shape and values, 0-d and empty included,
    whether written as an .npz or packed (localisation exposes thousands)."""
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper

    kinds = [(TensorProto.FLOAT, np.float32, [2, 3]), (TensorProto.INT64, np.int64, []),
             (TensorProto.BOOL, np.bool_, [4]), (TensorProto.FLOAT16, np.float16, [0, 2]),
             (TensorProto.DOUBLE, np.float64, [3, 1]), (TensorProto.UINT8, np.uint8, [5]),
             (TensorProto.BFLOAT16, ml_dtypes.bfloat16, [2])]
    inputs, outputs, nodes, feeds, want = [], [], [], {}, []
    rng = np.random.default_rng(0)
    for i in range(n_outputs):
        code, dt, shape = kinds[i % len(kinds)]
        a = (rng.standard_normal(shape) * 4).astype(dt)
        inputs.append(helper.make_tensor_value_info(f"x{i}", code, shape))
        outputs.append(helper.make_tensor_value_info(f"y{i}", code, shape))
        nodes.append(helper.make_node("Identity", [f"x{i}"], [f"y{i}"]))
        feeds[f"x{i}"] = a
        want.append(a)
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                          opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "many.onnx")
    r = sandbox.run_model(tmp_path / "many.onnx", [feeds])
    assert r.ok, r.error
    assert len(r.outputs[0]) == n_outputs
    for got, a in zip(r.outputs[0], want):
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(got.astype(np.float64), a.astype(np.float64))
    root = r.outputs[0][0]
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if isinstance(root, memoryview):
        root = root.obj
    assert isinstance(root, bytearray) == (n_outputs > 16)  # views of the packed file
    r.outputs[0][0][...] = 0  # writable, like the arrays np.load gives


def test_oom_finding_names_the_cap_and_the_model_size(tmp_path):
    p = om.huge_expand_model(tmp_path / "oom.onnx")
    r = sandbox.run_model(p, [X], memory_limit=3 * 1024**3, timeout=60)
    f = r.finding("runtime")
    assert f.code == "OM514" and "cap of 3.00 GiB" in f.message and "GiB)" in f.message
    assert f.details["memory_limit"] == 3 * 1024**3 and f.details["model_bytes"] > 0


def test_export_under_a_low_memory_cap_fails_with_oom_and_writes_nothing(tmp_path,
                                                                         monkeypatch):
    """The sandbox's cap (normally 70% of available memory) set artificially low: ONNX
    Runtime's allocation fails in the child, the export says so (OM514, stage runtime), no
    traceback, and nothing is written."""
    import torch

    import onnxmedic

    class Blowup(torch.nn.Module):
        def forward(self, x):  # a 2**29-element (2 GiB) intermediate
            return (x.unsqueeze(-1) * torch.ones(4096)).sum(-1)

    monkeypatch.setattr(sandbox, "default_memory_limit", lambda: 2 * 1024**3)
    r = onnxmedic.export(Blowup(), (torch.randn(2**17),), tmp_path / "m.onnx")
    assert not r.ok and r.failed_stage == "runtime", [f.code for f in r.findings]
    (f,) = [f for f in r.errors if f.code == "OM514"]
    assert "cap of 2.00 GiB" in f.message and r.traceback is None
    assert list(tmp_path.iterdir()) == []


def _weights_model(path, width: int):
    """x -> MatMul(Cast(bf16 weight)) -> MatMul(float32 weight) -> + Gather(embedding) - the
    dtype fixer's pattern for a bf16 model - with every weight in external data, written the
    way onnxmedic writes big models (onnx_ir, densely packed)."""
    import ml_dtypes
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((width, width), dtype=np.float32).astype(ml_dtypes.bfloat16)
    w2 = rng.standard_normal((width, width), dtype=np.float32)
    emb = rng.standard_normal((16, width), dtype=np.float32)
    inits = [helper.make_tensor("w1", TensorProto.BFLOAT16, [width, width],
                                w1.view(np.uint16).tobytes(), raw=True),
             numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(emb, "emb")]
    nodes = [helper.make_node("Cast", ["w1"], ["w1f"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "w1f"], ["h"]),
             helper.make_node("MatMul", ["h", "w2"], ["h2"]),
             helper.make_node("Gather", ["emb", "ids"], ["e"]),
             helper.make_node("Add", ["h2", "e"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, width]),
                     helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    ir.save(ir.serde.deserialize_model(model), path, external_data=f"{path.name}.data")
    feeds = {"x": rng.standard_normal((4, width), dtype=np.float32),
             "ids": np.array([0, 3, 7, 15], np.int64)}
    return path, feeds


def test_lean_session_is_bit_equal_to_the_normal_one(tmp_path):
    """A memory-lean session (forced here; chosen by size otherwise) computes the same bits as
    a normal one where MLAS's packed and unpacked MatMuls agree (64 wide)."""
    path, feeds = _weights_model(tmp_path / "m.onnx", 64)
    assert (tmp_path / "m.onnx.data").stat().st_size > 64 * 64 * 6
    normal = sandbox.run_model(path, [feeds], lean=False)
    lean = sandbox.run_model(path, [feeds], lean=True)
    assert normal.ok and lean.ok, (normal.error, lean.error)
    assert lean.lean and not normal.lean
    np.testing.assert_array_equal(lean.outputs[0][0], normal.outputs[0][0])


def test_lean_session_differs_only_by_weight_packing(tmp_path):
    """From 256 wide on, a MatMul with a packed weight (a normal session) rounds differently
    from an unpacked one (lean: session.disable_prepacking); everything else lean changes -
    memory-mapped weights, no folding of the big Cast, no arena, priority order - is
    bit-equal to a normal session that does not pack weights either."""
    import onnxruntime as ort

    path, feeds = _weights_model(tmp_path / "m.onnx", 256)
    lean = sandbox.run_model(path, [feeds], lean=True)
    assert lean.ok and lean.lean, lean.error
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", "1")
    unpacked = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(lean.outputs[0][0], unpacked.run(None, feeds)[0])


def test_lean_session_is_chosen_by_model_size(tmp_path, monkeypatch):
    path, feeds = _weights_model(tmp_path / "m.onnx", 64)
    size = sandbox.model_file_bytes(path)
    assert sandbox.lean_session(size, int(size / sandbox.LEAN_SHARE) + 1) is False
    assert sandbox.lean_session(size, int(size / sandbox.LEAN_SHARE) - 1) is True
    assert sandbox.lean_session(None, 1 << 30) is False
    assert sandbox.lean_session(sandbox.LEAN_MIN_BYTES, 1 << 50) is True  # big, whatever the room
    assert sandbox.lean_session(sandbox.LEAN_MIN_BYTES - 1, 1 << 50) is False
    monkeypatch.delenv("ONNXMEDIC_SANDBOX_LEAN", raising=False)
    assert not sandbox.run_model(path, [feeds], lean=None).lean  # a small model: normal
    monkeypatch.setattr(sandbox, "LEAN_SHARE", 1e-9)
    assert sandbox.run_model(path, [feeds], lean=None).lean
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_LEAN", "0")
    assert not sandbox.run_model(path, [feeds], lean=None).lean
    monkeypatch.delenv("ONNXMEDIC_SANDBOX_LEAN")
    assert not sandbox.run_model(path, [feeds]).lean  # run_model: a default session unless asked


@pytest.mark.parametrize("lean", [True, False])
def test_lean_session_cap_grows_by_the_mapped_weights(lean):
    """A lean session memory-maps its weights (file pages, not allocations): the child's
    address-space cap grows by the external data's bytes, so that the cap still bounds what
    ONNX Runtime allocates; a normal session's cap stays as set."""
    import subprocess
    import sys

    code = ("import resource, sys; sys.path.insert(0, sys.argv[1]); import _sandbox_worker as w;"
            "resource.setrlimit(resource.RLIMIT_AS, (2**40, resource.RLIM_INFINITY));"
            f"w._map_allowance({{'lean': {lean}, 'mapped_bytes': 2**30}});"
            "print(resource.getrlimit(resource.RLIMIT_AS)[0])")
    out = subprocess.run([sys.executable, "-c", code, str(sandbox.WORKER.parent)],
                         capture_output=True, text=True, check=True).stdout
    assert int(out) == 2**40 + (2**30 if lean else 0)


def test_export_of_a_model_big_against_memory_is_verified_lean(tmp_path, monkeypatch):
    """A model over LEAN_SHARE of the memory available is verified in a lean session and the
    result says so (OM516, info); under it, a default session and no OM516."""
    import torch

    import onnxmedic

    monkeypatch.delenv("ONNXMEDIC_SANDBOX_LEAN", raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8)).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    r = onnxmedic.export(model, (x,), tmp_path / "a.onnx")
    assert r.ok and "OM516" not in [f.code for f in r.findings]
    monkeypatch.setattr(sandbox, "LEAN_SHARE", 1e-9)
    r = onnxmedic.export(model, (x,), tmp_path / "b.onnx")
    assert r.ok, [(f.code, f.message) for f in r.errors]
    (f,) = [f for f in r.findings if f.code == "OM516"]
    assert f.stage == "runtime" and "memory-lean" in f.message and "GiB" in f.message
