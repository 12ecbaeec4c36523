"""Verified, measured optimization of an ONNX file for a target (issue 17).

``optimize(onnx_path, model, args)`` builds candidate variants (onnxscript's optimizer, its ONNX
Runtime fusions, ONNX Runtime's offline optimizer, int8 dynamic quantization (per tensor, per
channel, fused), weight-only block-wise int8 (MatMulNBits) and, for convolutional graphs,
static QDQ int8 calibrated on input sets apart from the verification sets (or on the user's,
``calibration=``), each with per-layer sensitivity, float16 with a measured block list - see
``optimize/fp16.py``), verifies each against PyTorch on the same input sets as an export (the
example, derived random sets, every dynamic size), times the verified ones in the sandbox and
writes the fastest one that beats the plain file beyond the measurement noise.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# ``bench`` is the function, not the module of that name: bound here, before an import of
# onnxmedic.optimize.bench could set the package's attribute to the module
from onnxmedic.optimize.bench import BenchResult, bench

if TYPE_CHECKING:
    from onnxmedic.optimize.core import *  # noqa: F403

__all__ = ["DEFAULT_COSINE", "BenchResult", "bench", "OptimizationResult", "Pipeline", "Variant",
           "block_list_findings", "calibration_feeds", "default_pipelines",
           "given_calibration_feeds", "judge_reduced", "optimize", "optimize_file",
           "ort_model_type", "parse_accuracy", "reference_sets", "Rejection", "run_pipeline",
           "target_findings", "time_variants", "Verifier", "Why"]


def __getattr__(name: str) -> Any:
    """A submodule, or a name of optimize/core.py (its imports - the passes, the verifier,
    the stages - made on first use, so that the command line's parser needs none of them)."""
    if name.startswith("__"):
        raise AttributeError(name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    core = importlib.import_module(f"{__name__}.core")
    try:
        value = getattr(core, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value
