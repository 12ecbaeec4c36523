"""The CUDA kernel table onnxmedic ships for a CPU-only onnxruntime: parsed by
tools/gen_cuda_kernels.py from the CUDAExecutionProvider section of ONNX Runtime's generated
docs/OperatorKernels.md (tools/data/OperatorKernels_cuda.md) into fixes/data/cuda_kernels.json,
and used by kernel_table / kernel_gaps for target "cuda". No GPU needed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from onnxmedic.fixes import dtypes as fx

ROOT = Path(__file__).resolve().parents[2]
MD = ROOT / "tools" / "data" / "OperatorKernels_cuda.md"
COMMIT = "001d12d2623fd411ce0f83d05abb5e82304a3389"
MAX = 2147483647


def _gen():
    spec = importlib.util.spec_from_file_location("gen_cuda_kernels",
                                                  ROOT / "tools" / "gen_cuda_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def shipped():
    return json.loads((ROOT / "src" / "onnxmedic" / "fixes" / "data" /
                       "cuda_kernels.json").read_text(encoding="utf-8"))


def _rows(doc, op, domain=""):
    return [(k["since"], k["types"]) for k in doc["kernels"]
            if k["op"] == op and k["domain"] == domain]


def test_json_is_generated_from_the_markdown(shipped):
    gen = _gen()
    assert gen.render() == (ROOT / "src" / "onnxmedic" / "fixes" / "data" /
                            "cuda_kernels.json").read_text(encoding="utf-8")
    assert shipped["provider"] == "CUDAExecutionProvider"
    assert shipped["source"] == f"microsoft/onnxruntime/docs/OperatorKernels.md@{COMMIT}"
    text = MD.read_text(encoding="utf-8")
    assert COMMIT in text.splitlines()[0]
    assert "## Operators implemented by CUDAExecutionProvider" in text
    assert "DmlExecutionProvider" not in text and "CPUExecutionProvider" not in text
    # every kernel row of the section became one entry (domain headers and | | spacers not)
    rows = [ln for ln in text.splitlines() if ln.startswith("|") and ln != "| |"
            and not ln.startswith(("| Op Name", "|---", "|**Operator Domain:**"))]
    assert len(shipped["kernels"]) == len(rows) == 432
    pairs = {(k["domain"], k["op"]) for k in shipped["kernels"]}
    assert len(pairs) == 225
    assert {d for d, _ in pairs} == {"", "com.microsoft", "com.ms.internal.nhwc"}


def test_parser_reads_every_version_form():
    gen = _gen()
    assert gen.parse_version("13+") == [13, MAX]
    assert gen.parse_version("[6, 12]") == [6, 12]
    assert gen.parse_version("9") == [9, 9]
    with pytest.raises(ValueError):
        gen.parse_version("13-")
    assert gen.parse_types("**T1** = tensor(int64)<br/> **T2** = tensor(bool), tensor(float)") \
        == {"T1": ["tensor(int64)"], "T2": ["tensor(bool)", "tensor(float)"]}


def test_rows_match_the_doc(shipped):
    # |Gemm|...|13+|**T** = tensor(bfloat16), tensor(double), tensor(float), tensor(float16)|
    # |||[11, 12]|**T** = tensor(double), tensor(float), tensor(float16)|
    # |||[9, 10]|**T** = tensor(double), tensor(float), tensor(float16)|
    # |||[7, 8]|**T** = tensor(double), tensor(float), tensor(float16)|
    assert _rows(shipped, "Gemm") == [
        ([13, MAX], {"T": ["tensor(bfloat16)", "tensor(double)", "tensor(float)",
                           "tensor(float16)"]}),
        ([11, 12], {"T": ["tensor(double)", "tensor(float)", "tensor(float16)"]}),
        ([9, 10], {"T": ["tensor(double)", "tensor(float)", "tensor(float16)"]}),
        ([7, 8], {"T": ["tensor(double)", "tensor(float)", "tensor(float16)"]}),
    ]
    # |Ceil|*in* X:**T**<br> *out* Y:**T**|13+|**T** = tensor(double), tensor(float), tensor(float16)|
    assert _rows(shipped, "Ceil")[0] == (
        [13, MAX], {"T": ["tensor(double)", "tensor(float)", "tensor(float16)"]})
    # |||11|**T** = tensor(float)|            (Clip, a single-version row)
    assert ([11, 11], {"T": ["tensor(float)"]}) in _rows(shipped, "Clip")
    # |Scatter|...|[9, 10]|**T** = tensor(bfloat16), ...<br/> **Tind** = tensor(int32), tensor(int64)|
    ((since, types),) = _rows(shipped, "Scatter")
    assert since == [9, 10] and types["Tind"] == ["tensor(int32)", "tensor(int64)"]
    # |Upsample|...|9|**T** = ...|  then  |||[7, 8]|**T** = ...|
    assert [s for s, _ in _rows(shipped, "Upsample")] == [[9, 9], [7, 8]]
    # |MatMulInteger|...|10+|**T1** = tensor(int8)<br/> **T2** = tensor(int8)<br/> **T3** = tensor(int32)|
    assert _rows(shipped, "MatMulInteger") == [
        ([10, MAX], {"T1": ["tensor(int8)"], "T2": ["tensor(int8)"], "T3": ["tensor(int32)"]})]
    # |Cast|...|23+|**T1** = tensor(bfloat16), ..., tensor(float4e2m1), ...
    assert "tensor(float4e2m1)" in _rows(shipped, "Cast")[0][1]["T1"]
    # com.microsoft: |MatMulNBits|...|1+|**T1** = tensor(bfloat16), tensor(float), tensor(float16)<br/>
    #   **T2** = tensor(uint8)<br/> **T3** = tensor(bfloat16), tensor(float), tensor(float16), tensor(uint8)|
    ((since, types),) = _rows(shipped, "MatMulNBits", "com.microsoft")
    assert since == [1, MAX] and types["T1"] == ["tensor(bfloat16)", "tensor(float)",
                                                 "tensor(float16)"]
    assert types["T2"] == ["tensor(uint8)"]
    # |GroupQueryAttention|...|1+|**M** = tensor(int32)<br/> **T** = tensor(bfloat16), tensor(float16)<br/>
    #   **T_CACHE** = tensor(bfloat16), tensor(float16), tensor(float8e4m3fn), tensor(int8)<br/> ...
    ((_, types),) = _rows(shipped, "GroupQueryAttention", "com.microsoft")
    assert types["T"] == ["tensor(bfloat16)", "tensor(float16)"] and "T_CACHE" in types


def test_kernel_table_for_cuda_is_not_none():
    t = fx.kernel_table("CUDAExecutionProvider")
    assert t is not None
    gemm13 = [c for lo, hi, c in t[("", "Gemm")] if lo <= 13 <= hi]
    assert gemm13 and all("tensor(float)" in c["T"] for c in gemm13)


def test_shipped_table_is_the_fallback_on_a_cpu_only_build():
    import onnxruntime as ort

    shipped = fx.shipped_kernel_table("CUDAExecutionProvider")
    assert shipped is not None and ("com.microsoft", "MatMulNBits") in shipped
    assert fx.shipped_kernel_table("CPUExecutionProvider") is None
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime registers its own CUDA kernels")
    assert fx.kernel_table("CUDAExecutionProvider") == shipped


def _unary(op, dtype, opset=18):
    x = helper.make_tensor_value_info("x", dtype, [2, 3])
    y = helper.make_tensor_value_info("y", dtype, [2, 3])
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="n")], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


def _binary(op, dtype, out_dtype=None):
    """One ``op(a[2, 3], b[3, 4]) -> y[2, 4]`` node (Gemm, MatMulInteger)."""
    a = helper.make_tensor_value_info("a", dtype, [2, 3])
    b = helper.make_tensor_value_info("b", dtype, [3, 4])
    y = helper.make_tensor_value_info("y", out_dtype or dtype, [2, 4])
    g = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"], name=op.lower())],
                          "g", [a, b], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


def _gemm(dtype):
    return _binary("Gemm", dtype)


def _matmul_integer(dtype):
    return _binary("MatMulInteger", dtype, TensorProto.INT32)


def test_bf16_ceil_is_a_cuda_gap():
    # CUDA Ceil 13+: double, float, float16 only (no bfloat16)
    (g,) = fx.kernel_gaps(_unary("Ceil", TensorProto.BFLOAT16), target="cuda")
    assert (g.op, g.node, g.kind, g.since_version) == ("Ceil", "n", "no-kernel", 13)
    assert g.types == {"T": "tensor(bfloat16)"}
    assert fx.kernel_gaps(_unary("Ceil", TensorProto.FLOAT16), target="cuda") == []


def test_uint8_matmul_integer_is_a_cuda_gap_not_a_cpu_one():
    # CUDA MatMulInteger 10+: T1 = T2 = int8 only
    (g,) = fx.kernel_gaps(_matmul_integer(TensorProto.UINT8), target="cuda")
    assert g.op == "MatMulInteger" and g.kind == "cpu-fallback"  # the CPU has one
    assert g.types["T1"] == "tensor(uint8)"
    assert fx.kernel_gaps(_matmul_integer(TensorProto.INT8), target="cuda") == []
    assert fx.kernel_gaps(_matmul_integer(TensorProto.UINT8), target="cpu") == []


def test_bf16_gemm_runs_on_cuda_but_not_on_cpu():
    # CUDA Gemm 13+ has bfloat16; ONNX Runtime's CPU Gemm does not
    m = _gemm(TensorProto.BFLOAT16)
    assert fx.kernel_gaps(m, target="cuda") == []
    (g,) = fx.kernel_gaps(m, target="cpu")
    assert g.op == "Gemm" and g.kind == "no-kernel"


def test_cuda_gap_with_a_cpu_kernel_is_a_cpu_fallback_warning(tmp_path):
    """uint8 MatMulInteger: no CUDA kernel, but a CPU one -> ONNX Runtime runs it on the CPU.
    On a GPU target that is a warning (OM304), never a failed export or doctor."""
    from onnxmedic import api

    m = _matmul_integer(TensorProto.UINT8)
    (g,) = fx.kernel_gaps(m, target="cuda")
    assert g.kind == "cpu-fallback"
    onnx.save(m, tmp_path / "mmi.onnx")
    r = api.doctor(tmp_path / "mmi.onnx", target="cuda", smoke_test=False)
    (w,) = [f for f in r.findings if f.code == "OM304"]
    assert w.severity.value == "warning" and "MatMulInteger" in w.message
    assert not [f for f in r.errors if f.code in ("OM301", "OM311")]
