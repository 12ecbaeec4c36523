"""int8 across CPU instruction sets (issue 38): portable settings, --target cpu:<isa>, the
instruction set a file was verified on, and doctor/run's findings about it.

The AVX2 test runs ONNX Runtime under ``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512, no VNNI:
MLAS takes its AVX2 kernels, whose u8s8 products add in int16 pairs) and skips where QEMU is
absent; .ci/run installs Debian's qemu-user. Nothing here asserts what the running CPU's own
int8 kernels compute, except per instruction set (the QEMU runs).
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxmedic
from onnxmedic import isa
from onnxmedic.onnxfile import append_metadata
from onnxmedic.optimize import Pipeline, default_pipelines, optimize, passes, target_findings
from onnxmedic.optimize.passes import precision_error
from tests.optimize.fixture_models import mlp_model

QEMU = shutil.which("qemu-x86_64")
QEMU_CPU = "Haswell-noTSX,-pcid,-x2apic,-tsc-deadline,-invpcid"  # what QEMU's TCG emulates
needs_qemu = pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64",
    reason="needs qemu-x86_64 on an x86-64 machine to run ONNX Runtime as on an AVX2-only "
    "CPU (apt-get install qemu-user; .ci/run does)")
RUNNER = """
import sys, numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[1]))
outs = [ort.InferenceSession(p, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        for p in sys.argv[3:]]
np.savez(sys.argv[2], *outs)
"""


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _run(tmp: Path, feeds: dict[str, np.ndarray], paths: list[Path], emulate: bool
         ) -> list[np.ndarray]:
    """The first output of each file on ``feeds``, in a child ONNX Runtime (under QEMU's
    Haswell with ``emulate``)."""
    np.savez(tmp / "feeds.npz", **feeds)
    (tmp / "runner.py").write_text(RUNNER)
    out = tmp / ("haswell.npz" if emulate else "native.npz")
    cmd = ([QEMU, "-cpu", QEMU_CPU] if emulate else []) + [
        sys.executable, str(tmp / "runner.py"), str(tmp / "feeds.npz"), str(out),
        *map(str, paths)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    got = np.load(out)
    return [got[f"arr_{i}"] for i in range(len(paths))]


def _saturating_mlp(path: Path) -> dict[str, np.ndarray]:
    """Two MatMuls whose int8 operands reach 2 x 255 x 127 per pair of products: activations
    near the top of their range, adjacent weights of one sign. Returns the feed."""
    rng = np.random.default_rng(0)
    w1 = rng.uniform(-1, 1, (64, 32)).astype(np.float32)
    w1[::2] = np.abs(w1[::2]) * np.sign(w1[1::2])
    w2 = rng.uniform(-1, 1, (32, 16)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
         helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    x = rng.uniform(0.8, 1.0, (8, 64)).astype(np.float32)
    x[:, 0] = 0.0  # the activation range starts at 0: the large values map near 255
    return {"x": x}


@needs_qemu
def test_portable_int8_keeps_the_budget_where_full_range_u8s8_saturates_on_avx2(
        tmp_path: Path) -> None:
    """The model is built to saturate u8s8 on AVX2: with full 8-bit weights, ONNX Runtime on an
    emulated Haswell falls far outside the budget (what a file verified on an AVX-512 VNNI CPU
    does on an AVX2 one); the portable default (7-bit weights) keeps it there and natively,
    with the same integers on both."""
    src = tmp_path / "mlp.onnx"
    feed = _saturating_mlp(src)
    portable, full = tmp_path / "portable.onnx", tmp_path / "full.onnx"
    assert passes.quantize_int8(str(src), str(portable))["reduce_range"] is True
    passes.quantize_int8(str(src), str(full), reduce_range=False)
    paths = [src, portable, full]
    native = _run(tmp_path, feed, paths, emulate=False)
    haswell = _run(tmp_path, feed, paths, emulate=True)
    ref = native[0]
    assert _cosine(haswell[2], ref) < 0.99  # saturated: the model shows the fault
    assert _cosine(haswell[1], ref) >= 0.999 and _cosine(native[1], ref) >= 0.999
    assert np.array_equal(haswell[1], native[1])  # same kernels' integers, no saturation


@needs_qemu
def test_portable_static_int8_keeps_the_budget_on_avx2(tmp_path: Path) -> None:
    """Static int8 (QDQ, what optimize writes for a CNN): a Conv built to saturate (positive
    inputs, half its filters of one sign) - full 8-bit weights saturate QLinearConv on an emulated
    Haswell, the portable default does not."""
    rng = np.random.default_rng(1)
    w = rng.uniform(-1, 1, (8, 8, 3, 3)).astype(np.float32)
    w[::2] = np.abs(w[::2])  # filters of one sign: their pairs of products saturate
    b = -0.85 * w.sum(axis=(1, 2, 3))  # centre the outputs: a saturated sum shows
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])],
        "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b.astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    src = tmp_path / "cnn.onnx"
    onnx.save(model, str(src))
    x = rng.uniform(0.7, 1.0, (1, 8, 8, 8)).astype(np.float32)
    x[0, 0, 0, 0] = 0.0
    from onnxmedic.optimize.files import save_feeds

    save_feeds([{"x": x}], tmp_path / "cal.npz")
    portable, full = tmp_path / "portable.onnx", tmp_path / "full.onnx"
    passes.quantize_static_int8(str(src), str(portable), str(tmp_path / "cal.npz"))
    passes.quantize_static_int8(str(src), str(full), str(tmp_path / "cal.npz"),
                                reduce_range=False)
    ref = _run(tmp_path, {"x": x}, [src], emulate=False)[0]
    haswell = _run(tmp_path, {"x": x}, [portable, full], emulate=True)
    assert _cosine(haswell[1], ref) < 0.99
    assert _cosine(haswell[0], ref) >= 0.999


def test_targets_with_an_instruction_set_are_parsed_and_bad_ones_refused() -> None:
    assert isa.split_target("cpu") == ("cpu", None)
    assert isa.split_target("cuda") == ("cuda", None)
    assert isa.split_target("cpu:AVX512_VNNI") == ("cpu", "avx512-vnni")
    for bad in ("cpu:sse2", "cuda:amx", "cpu:"):
        with pytest.raises(ValueError, match="cpu:avx2"):
            isa.split_target(bad)
    assert precision_error("int8", "cpu:amx") is None
    assert precision_error("int8", "cuda") is not None
    with pytest.raises(ValueError, match=r"cpu:avx2, cpu:avx-vnni"):
        onnxmedic.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),), target="cpu:sse2")
    with pytest.raises(ValueError, match="target"):
        optimize("unused.onnx", torch.nn.Linear(2, 2), (torch.randn(1, 2),),
                 target="cpu:neon", precision="int8")


def test_the_cli_takes_cpu_isa_targets_and_refuses_unknown_ones(tmp_path: Path) -> None:
    from onnxmedic.cli import main

    with pytest.raises(SystemExit) as e:
        main(["optimize", "x.onnx", "m.py:M", "--target", "cpu:sse2"])
    assert e.value.code == 2
    from onnxmedic.isa import target_arg

    assert target_arg("cpu:avx2") == "cpu:avx2" and target_arg("tensorrt") == "tensorrt"


def test_int8_settings_follow_the_instruction_set() -> None:
    """Portable (cpu, cpu:avx2): the quantize steps' 7-bit default; an instruction set whose
    u8s8 kernels add in int32: full 8-bit weights. Weight-only MatMulNBits is the same for
    every one (signed int8 both sides: nothing saturates, bench/results/isa_kernels.md)."""
    def quantize_options(target_isa: str | None) -> dict[str, dict]:
        pipes = default_pipelines("cpu", "int8", convolutional=True, isa=target_isa)
        return {p.name: p.steps[-1][1] for p in pipes if p.precision == "int8"}

    for portable in (None, "avx2"):
        opts = quantize_options(portable)
        assert opts and all("reduce_range" not in o for o in opts.values())
    for full in ("avx512-vnni", "amx", "avx-vnni", "arm64"):
        opts = quantize_options(full)
        assert opts["int8-dynamic"]["reduce_range"] is False
        assert opts["int8-static"]["reduce_range"] is False
        assert "reduce_range" not in opts["int8-weight-only"]


def test_present_isa_is_an_instruction_set_and_can_be_overridden(
        monkeypatch: pytest.MonkeyPatch) -> None:
    here = isa.present_isa()
    if platform.machine() == "x86_64":
        assert here in isa.ISAS
        # the kernels decide, not the flags (where the sandbox runs them: the ISA lane's QEMU)
        assert (here == "avx2") == isa.u8s8_saturates(in_sandbox=True)
    monkeypatch.setenv(isa.ENV, "amx")
    assert isa.present_isa() == "amx"


def _int8_file(tmp_path: Path, verified: str, settings: str) -> Path:
    src = tmp_path / "mlp.onnx"
    _saturating_mlp(src)
    out = tmp_path / "int8.onnx"
    passes.quantize_int8(str(src), str(out))
    append_metadata(out, isa.VERIFIED_KEY, verified)
    append_metadata(out, isa.SETTINGS_KEY, settings)
    return out


def test_doctor_and_run_flag_an_int8_file_verified_for_another_instruction_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file verified with AVX-512 VNNI's full-range settings, met on an AVX2 CPU: OM544
    from doctor and run; a portable one verified on AMX met here: OM545; on the instruction
    set it was verified on: nothing."""
    monkeypatch.setenv(isa.ENV, "avx2")
    vnni = _int8_file(tmp_path, "avx512-vnni", "avx512-vnni")
    codes = [f.code for f in onnxmedic.doctor(vnni).findings]
    assert "OM544" in codes and "OM545" not in codes
    res = onnxmedic.run(vnni, {"x": np.ones((8, 64), np.float32)})
    assert res.ok and "OM544" in [f.code for f in res.findings]
    portable = tmp_path / "p"
    portable.mkdir()
    amx = _int8_file(portable, "amx", "portable")
    codes = [f.code for f in onnxmedic.doctor(amx).findings]
    assert "OM545" in codes and "OM544" not in codes
    monkeypatch.setenv(isa.ENV, "amx")
    assert not {"OM544", "OM545"} & {f.code for f in onnxmedic.doctor(amx).findings}
    # an instruction set that does not saturate meets full-range settings of another: OM545
    assert [f.code for f in onnxmedic.doctor(vnni).findings if f.code.startswith("OM54")] == [
        "OM545"]


def test_optimize_records_the_instruction_set_int8_was_verified_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """optimize --precision int8 --target cpu:avx512-vnni: OM729 names the settings and the
    instruction set verified on; where that is another one (here made avx2 by the override)
    OM728 says the named one was not checked; a written int8 file records both."""
    monkeypatch.setenv(isa.ENV, "avx2")
    model, x, src = mlp_model(tmp_path, 256, 256, rows=64)
    out = tmp_path / "out.onnx"
    dyn = Pipeline("int8", [("onnxmedic.optimize.passes:quantize_int8",
                             {"reduce_range": False})], precision="int8")
    res = optimize(src, model, (x,), out=out, precision="int8", target="cpu:avx512-vnni",
                   pipelines=[dyn], repeats=3, rounds=1)
    assert res.target == "cpu:avx512-vnni"
    found = {f.code: f for f in target_findings(res)}
    assert found["OM729"].details == {"settings": "avx512-vnni", "verified_on": "avx2"}
    assert "OM728" in found
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    if res.chosen == "int8":
        assert meta[isa.VERIFIED_KEY] == "avx2" and meta[isa.SETTINGS_KEY] == "avx512-vnni"
    else:  # the plain file: no int8 record
        assert isa.VERIFIED_KEY not in meta
    assert json.dumps(res.to_dict(), default=str)


def test_plain_cpu_targets_report_no_instruction_set_findings(tmp_path: Path) -> None:
    """fp32 optimize on cpu: no OM728/OM729 (its findings and JSON as before)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).eval()
    src = tmp_path / "l.onnx"
    torch.onnx.export(model, (torch.randn(2, 4),), str(src), dynamo=True, verbose=False)
    res = optimize(src, model, (torch.randn(2, 4),), pipelines=[], repeats=3, rounds=1)
    assert res.target == "cpu" and target_findings(res) == []
