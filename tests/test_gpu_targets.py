"""GPU targets verified on a machine without a GPU, and what the GPU run taught
(bench/gpu/gpu_check.py on an H100 with onnxruntime-gpu 1.31.1):

- onnxruntime-gpu's get_all_opkernel_def segfaults when TensorRT's libnvinfer is missing, so the
  kernel registrations are asked for in a child process (a crash there falls back to the shipped
  tables instead of killing onnxmedic);
- ONNX Runtime's CUDA provider computes float32 MatMul/Gemm/Conv in TF32 by default (4e-4 off on
  a small attention block, 1e-6 with use_tf32=0): the sandbox verifies with use_tf32=0 and says
  so (OM536);
- a bfloat16 model has CUDA kernels but none on the CPU: without a GPU, the CPU fallback cannot
  load it, so a CPU stand-in is verified (OM537) and the written model is left as it is."""

from __future__ import annotations

import onnx
import pytest
import torch

import onnxmedic
from onnxmedic import api, sandbox
from onnxmedic.fixes import dtypes as fx
from tests.fixes.test_dtypes import _bf16

ort = pytest.importorskip("onnxruntime")
NO_GPU = "CUDAExecutionProvider" not in ort.get_available_providers()


@pytest.mark.skipif(not NO_GPU, reason="needs an onnxruntime without CUDA")
def test_bf16_model_for_cuda_is_verified_through_a_cpu_stand_in(tmp_path):
    m, x = _bf16()
    out = tmp_path / "m.onnx"
    r = onnxmedic.export(m, x, out, target="cuda")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f,) = [f for f in r.findings if f.code == "OM537"]
    assert "Gemm" in f.message and "unchanged" in f.message
    written = onnx.load(out)
    gemms = [n for n in written.graph.node if n.op_type == "Gemm"]
    assert gemms and not any(n.op_type == "Cast" for n in written.graph.node
                             if n.output and n.output[0].startswith("upcast"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no stand-in published
    # on the CPU target the model itself is repaired instead (OM310), no stand-in
    r = onnxmedic.export(m, x, target="cpu")
    assert r.ok and "OM310" in [f.code for f in r.findings]
    assert "OM537" not in [f.code for f in r.findings]


def test_cuda_provider_asked_with_tf32_off_still_falls_back_without_a_gpu(tmp_path):
    """The worker passes ('CUDAExecutionProvider', {'use_tf32': '0'}); on a CPU-only build that
    must fall back like the bare name does, and the options are what the worker sends."""
    from onnxmedic import _sandbox_worker

    assert _sandbox_worker.TF32_OFF == {"use_tf32": "0"}
    m = torch.nn.Linear(4, 2).eval()
    x = torch.randn(3, 4)
    out = tmp_path / "l.onnx"
    assert onnxmedic.export(m, (x,), out).ok
    name = onnx.load(out).graph.input[0].name
    res = sandbox.run_model(out, [{name: x.numpy()}],
                            providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert res.status == "ok"
    if NO_GPU:
        assert res.providers == ["CPUExecutionProvider"]
        assert res.provider_finding(["CUDAExecutionProvider"]).code == "OM535"


def test_cuda_run_is_reported_as_verified_with_tf32_off():
    from onnxmedic.stages.verify import record_runtime

    r = api.ExportResult(command="export")
    ran = sandbox.SandboxResult(status="ok", providers=["CUDAExecutionProvider",
                                                        "CPUExecutionProvider"])
    assert record_runtime(r, ran, "cuda", 10.0)
    (f,) = [f for f in r.findings if f.code == "OM536"]
    assert "use_tf32=0" in f.message and "'use_tf32': '0'" in f.suggestion
    r = api.ExportResult(command="export")
    assert record_runtime(r, sandbox.SandboxResult(status="ok",
                                                   providers=["CPUExecutionProvider"]),
                          "cuda", 10.0)
    assert [f.code for f in r.findings] == ["OM535"]


def test_kernel_query_runs_in_a_child_and_survives_its_crash(monkeypatch):
    rows = fx.registered_kernels()
    # [] where the real query crashes (onnxruntime-gpu without libnvinfer: seen on an H100)
    assert not rows or any(p == "CPUExecutionProvider" and op == "Gemm"
                           for p, _, op, _, _ in rows)
    fx.registered_kernels.cache_clear()
    fx.kernel_table.cache_clear()
    monkeypatch.setattr(fx, "KERNEL_QUERY", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    try:
        assert fx.registered_kernels() == []
        # CUDA falls back to the shipped table; the CPU has none to fall back to
        assert fx.kernel_table("CUDAExecutionProvider") == fx.shipped_kernel_table(
            "CUDAExecutionProvider")
        assert fx.kernel_table("CPUExecutionProvider") is None
    finally:
        monkeypatch.undo()
        fx.registered_kernels.cache_clear()
        fx.kernel_table.cache_clear()
    assert fx.registered_kernels() == rows  # asked again, as before


def test_kernel_query_started_ahead_is_asked_once(monkeypatch):
    """prefetch_kernels asks in a background thread; registered_kernels takes that answer
    instead of asking again, and nothing is asked once the answer is known."""
    import threading

    calls, release = [], threading.Event()
    real = fx.query_kernels

    def slow():
        calls.append(threading.current_thread().name)
        release.wait(30)
        return real()

    fx.registered_kernels.cache_clear()
    fx.kernel_table.cache_clear()
    monkeypatch.setattr(fx, "query_kernels", slow)
    try:
        fx.prefetch_kernels()
        fx.prefetch_kernels()  # already being asked
        release.set()
        rows = fx.registered_kernels()
        assert calls == ["onnxmedic-kernel-query"]
        fx.prefetch_kernels()  # known: not asked again
        assert fx.registered_kernels() is rows and len(calls) == 1
        assert any(op == "Gemm" for _, _, op, _, _ in rows)
    finally:
        monkeypatch.undo()
        fx.registered_kernels.cache_clear()
        fx.kernel_table.cache_clear()


def test_plan_leaves_the_default_opset_to_translation(monkeypatch):
    """The plan stage starts the kernel query and returns at once; the default opset is
    chosen when translation starts - the same one choose_opset gives."""
    from onnxmedic.context import ExportContext, ExportOptions
    from onnxmedic.fixes import opset as opset_fix
    from onnxmedic.stages.plan import plan_opset

    fx.registered_kernels.cache_clear()
    fx.kernel_table.cache_clear()
    started = []
    monkeypatch.setattr(fx, "prefetch_kernels", lambda: started.append(1))
    ctx = ExportContext(api.ExportResult(command="export"), None, (), {}, ExportOptions())
    assert plan_opset(ctx) and ctx.opset is None and started == [1]
    assert opset_fix.resolve_opset(ctx) == ctx.opset == opset_fix.choose_opset("cpu")[0]
    assert ctx.opset_bound == opset_fix.choose_opset("cpu")[1]
    asked = ExportContext(api.ExportResult(command="export"), None, (), {},
                          ExportOptions(opset=18))
    assert plan_opset(asked) and (asked.opset, asked.opset_bound) == (18, "asked for")
    assert opset_fix.resolve_opset(asked) == 18
