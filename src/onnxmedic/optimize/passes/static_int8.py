"""The static int8 pass (the "int8-static" candidate): ONNX Runtime's quantize_static in the QDQ
format, calibrated, and what decides where it is a candidate (a convolutional graph). Its step
is named ``onnxmedic.optimize.passes:quantize_static_int8``; its test is
tests/optimize/passes/test_static_int8.py."""

from __future__ import annotations

import logging
import os
from typing import Any

from onnxmedic.optimize.files import has_external_data, load_feeds, op_count_diff, op_counts

logger = logging.getLogger(__name__)


def feed_reader(feeds: list[dict[str, Any]]) -> Any:
    """ONNX Runtime's ``CalibrationDataReader`` over ``feeds`` (its quantizer and debugging
    tools read inputs so)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(feeds)

        def get_next(self) -> Any:  # a feed, None when done
            return next(self.left, None)

    return Reader()


STATIC_OPS = ("Conv", "MatMul", "Gemm")  # the layers static int8 quantizes and ranks


def with_producers(graph: Any, names: list[str]) -> list[str]:
    """``names`` and the layers (STATIC_OPS) whose outputs they read, through a Relu or Clip:
    ONNX Runtime's QDQ quantizer quantizes a value where either side of it is quantized (a
    Conv's output, with the Relu after it folded in), so a layer reads its input in float32
    only when the layer producing it is left float32 too."""
    producer = {o: n for n in graph.node for o in n.output}
    by_name = {n.name: n for n in graph.node if n.name}
    out = list(names)
    for name in names:
        for value in by_name[name].input if name in by_name else []:
            p = producer.get(value)
            while p is not None and p.op_type in ("Relu", "Clip"):
                p = producer.get(p.input[0])
            if p is not None and p.op_type in STATIC_OPS and p.name and p.name not in out:
                out.append(p.name)
    return out


def quantize_static_int8(src: str, dst: str, calibration: str,
                         nodes_to_exclude: list[str] | None = None,
                         per_channel: bool = True, reduce_range: bool = True
                         ) -> dict[str, Any]:
    """Static int8 in the QDQ format with ONNX Runtime's own quantizer
    (``onnxruntime.quantization.quantize_static``): weights int8 symmetric (one scale per output
    channel with ``per_channel``), activations uint8 with ranges fixed ahead of time - the
    min/max each tensor reaches over the ``calibration`` feeds (a ``files.save_feeds`` .npz).
    ONNX Runtime runs the QuantizeLinear/DequantizeLinear pairs around a Conv as one int8
    QLinearConv (likewise MatMul, Add, pooling): the int8 lever for convolutions, which
    quantize_dynamic turns into ConvInteger with run-time activation ranges - slower than
    float32 on the CPU (ResNet-50: 0.27x). ``nodes_to_exclude`` stay float32. Standard ONNX ops
    (portable), the accuracy depends on how well the calibration feeds cover the real inputs.
    ``reduce_range``: 7-bit weights (as :func:`quantize_int8`; int8 activations would not
    help: ONNX Runtime's x86 kernels shift them to uint8 and saturate alike)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )


    feeds = load_feeds(calibration)
    before = op_counts(src)
    graph = onnx.load(src, load_external_data=False).graph
    layers = [n.name for n in graph.node if n.op_type in STATIC_OPS and n.name]
    excluded = with_producers(graph, list(nodes_to_exclude or []))

    def run(op_types: list[str] | None) -> None:
        quantize_static(src, dst, feed_reader(feeds), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=op_types, per_channel=per_channel,
                        reduce_range=reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax, nodes_to_exclude=excluded,
                        use_external_data_format=has_external_data(src),
                        calibration_providers=["CPUExecutionProvider"])

    op_types = "every op type ONNX Runtime quantizes"
    try:
        run(None)
    except ValueError as e:  # e.g. "Quantization parameter shared mode is not supported for
        # weight yet": a constant shared by several normalisations (diffusers' VAE)
        logger.info("quantize_static on every op type failed (%s); layers only", e)
        run(list(STATIC_OPS))
        op_types = f"{', '.join(STATIC_OPS)} only (every op type: {str(e)[:120]})"
    info = op_count_diff(before, op_counts(dst))
    info["op_types"] = op_types
    info["excluded"] = excluded
    info["layers"] = layers
    info["calibration_sets"] = len(feeds)
    info["reduce_range"] = reduce_range
    return info


def is_convolutional(path: str | os.PathLike[str]) -> bool:
    """Whether convolutions make up the graph's layers (at least as many Conv nodes as
    MatMul/Gemm ones: ResNet, not a ViT or Whisper with a convolutional stem), where static
    int8 is the candidate that can pay (:func:`quantize_static_int8`)."""
    counts = op_counts(path)
    return counts["Conv"] > 0 and counts["Conv"] >= counts["MatMul"] + counts["Gemm"]
