"""The weight-only int8 pass (the "int8-weight-only" candidate): ONNX Runtime's MatMulNBits
quantizer. Its step is named ``onnxmedic.optimize.passes:quantize_weight_only``; its test is
tests/optimize/passes/test_weight_only_int8.py."""

from __future__ import annotations

from typing import Any

from onnxmedic.optimize.files import op_count_diff, op_counts, save_proto


def quantize_weight_only(src: str, dst: str, nodes_to_exclude: list[str] | None = None,
                         bits: int = 8, block_size: int = 32, accuracy_level: int = 4,
                         symmetric: bool = True) -> dict[str, Any]:
    """Weight-only block-wise quantization with ONNX Runtime's own tool
    (``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``): every MatMul
    with a constant 2-D weight becomes ``com.microsoft.MatMulNBits`` with ``bits``-bit weights,
    one scale per ``block_size`` consecutive weights of a column (along K). No activation is
    quantized ahead of time; ``accuracy_level`` 4 lets the CPU kernel quantize A to int8 per
    block of the same ``block_size`` at run time (int8 dot products), 0 dequantizes the weights
    and computes in float32. A Gemm (alpha = beta = 1, no transA) is first split into MatMul +
    Add by the quantizer's own ``ONNXModel.replace_gemm_with_matmul`` (named ``<name>_MatMul``,
    which ``nodes_to_exclude`` also covers). ONNX Runtime only (a contrib op)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from onnxruntime.quantization.onnx_model import ONNXModel

    before = op_counts(src)
    model = ONNXModel(onnx.load(src))
    model.replace_gemm_with_matmul()
    layers = [n.name for n in model.graph().node if n.op_type == "MatMul" and n.name]
    quantizer = MatMulNBitsQuantizer(
        model.model, bits=bits, block_size=block_size, is_symmetric=symmetric,
        accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",),
        nodes_to_exclude=[m for n in nodes_to_exclude or [] for m in (n, f"{n}_MatMul")])
    quantizer.process()
    save_proto(quantizer.model.model, dst)
    info = op_count_diff(before, op_counts(dst))
    info["excluded"] = list(nodes_to_exclude or [])
    info["layers"] = layers
    return info
