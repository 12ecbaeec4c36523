"""How long optimize's static int8 candidate (calibration, search, verification, timing) takes on
real-size ResNet-50 (random weights, 224x224), and what it decides; one JSON line.

    PYTHONPATH=src python bench/optimize/static_search.py [--repeats 5] [--rounds 2] [--accuracy cosine=X]

Run it on two trees one after the other (PYTHONPATH=<tree>/src) to compare them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from optimize import resnet50  # noqa: E402 - bench/optimize/optimize.py, the benchmark's model

import onnxmedic  # noqa: E402
from onnxmedic.optimize import optimize, passes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--accuracy", default=None, help="the budget, e.g. cosine=0.997")
    ns = ap.parse_args()
    torch.manual_seed(0)
    model, args, _ = resnet50()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "rn50.onnx"
        torch.onnx.export(model, args, str(src), dynamo=True, verbose=False)
        static = [p for p in passes.default_pipelines("cpu", "int8", None, True)
                  if p.name == "int8-static"]
        t0 = time.perf_counter()
        res = optimize(src, model, args, precision="int8", pipelines=static,
                       repeats=ns.repeats, rounds=ns.rounds, accuracy=ns.accuracy)
        seconds = time.perf_counter() - t0
    v = res.variants[1]
    print(json.dumps({"onnxmedic": onnxmedic.__file__, "seconds": round(seconds, 1),
                      "verified": v.verified, "rejected": v.rejected,
                      "excluded": len(v.steps[-1].get("excluded", [])) if v.steps else None,
                      "cosine": min((m["cosine"] for m in v.accuracy.values()), default=None),
                      "median_ms": v.median_ms, "plain_ms": res.variants[0].median_ms}))


if __name__ == "__main__":
    main()
