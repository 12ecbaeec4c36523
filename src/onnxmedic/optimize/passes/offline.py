"""ONNX Runtime's offline optimizer pass (the "ort-offline-*" candidates): the session's own graph
optimizations, saved to a file. Its step is named ``onnxmedic.optimize.passes:ort_offline``;
its test is tests/optimize/passes/test_offline.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onnxmedic.optimize.files import has_external_data, op_count_diff, op_counts


def ort_offline(src: str, dst: str, level: str = "basic") -> dict[str, Any]:
    """ONNX Runtime's own graph optimizer, saved to a file (SessionOptions.optimized_model_filepath).
    ``basic`` is portable (standard ops only); ``extended``/``all`` emit provider-specific
    (com.microsoft, layout-specific) ops and are only valid for the provider they were made on."""
    import onnxruntime as ort

    before = op_counts(src)
    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    so.optimized_model_filepath = dst
    if has_external_data(src):  # torch.onnx.export's default: weights next to dst, not src's
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    Path(dst).name + ".data")
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return op_count_diff(before, op_counts(dst))
