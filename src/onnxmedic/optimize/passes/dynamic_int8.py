"""The dynamic int8 pass (the "int8-dynamic*" candidates): ONNX Runtime's quantize_dynamic on
MatMul and Gemm. Its step is named ``onnxmedic.optimize.passes:quantize_int8``; its test is
tests/optimize/passes/test_dynamic_int8.py."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from onnxmedic.optimize.files import op_count_diff, op_counts

logger = logging.getLogger(__name__)


def quantize_int8(src: str, dst: str, nodes_to_exclude: list[str] | None = None,
                  per_channel: bool = False, reduce_range: bool = True) -> dict[str, Any]:
    """onnxruntime.quantization.quantize_dynamic: int8 weights of MatMul/Gemm (one scale per
    tensor, or per output channel with ``per_channel``), activations quantized at run time, one
    scale per tensor (CPU). ``nodes_to_exclude`` stay float32. ``reduce_range`` (the portable
    default, isa.py): 7-bit weights, which ONNX Runtime's u8s8 kernels do not saturate on any
    x86-64 CPU; False (``--target cpu:avx512-vnni``, ...): full 8-bit weights."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    before = op_counts(src)
    with tempfile.TemporaryDirectory(prefix="onnxmedic-q-") as tmp:
        pre = str(Path(tmp) / "pre.onnx")
        try:  # shape inference helps the quantizer; not required
            from onnxruntime.quantization.shape_inference import quant_pre_process

            quant_pre_process(src, pre, skip_optimization=True, skip_symbolic_shape=True)
        except Exception as e:  # noqa: BLE001 - the raw model still quantizes
            logger.debug("quant_pre_process failed: %s", e)
            pre = src
        import onnx

        layers = [n.name for n in onnx.load(pre, load_external_data=False).graph.node
                  if n.op_type in ("MatMul", "Gemm") and n.name]
        quantize_dynamic(pre, dst, weight_type=QuantType.QInt8, per_channel=per_channel,
                         reduce_range=reduce_range, op_types_to_quantize=["MatMul", "Gemm"],
                         # the quantizer splits a Gemm into <name>_MatMul + <name>_Add first
                         nodes_to_exclude=[m for n in nodes_to_exclude or []
                                           for m in (n, f"{n}_MatMul")])
    info = op_count_diff(before, op_counts(dst))
    info["excluded"] = list(nodes_to_exclude or [])
    info["layers"] = layers  # the quantizable layers, named as nodes_to_exclude expects
    info["reduce_range"] = reduce_range
    return info
