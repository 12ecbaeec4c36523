"""What plain torch.onnx.export(dynamo=True) does with the demo model (it fails)."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gaussian_copula import GaussianCopulaHead, make_inputs  # noqa: E402

logging.getLogger("torch.onnx").setLevel(logging.CRITICAL)
warnings.simplefilter("ignore")

print("== plain torch.onnx.export(dynamo=True) on examples/gaussian_copula.py ==")
try:
    torch.onnx.export(GaussianCopulaHead(), make_inputs(), dynamo=True, verbose=False)
    print("torch.onnx.export succeeded (unexpected)")
except Exception as e:
    lines = [ln for ln in str(e).splitlines() if "No ONNX function" in ln]
    print(f"torch.onnx.export failed: {type(e).__name__}")
    print("  " + (lines[0].strip() if lines else str(e).splitlines()[0]))
print("== onnxmedic export on the same model ==")
