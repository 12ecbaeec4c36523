"""One detection entry of the vision zoo through onnxmedic.export, with its findings, time and
peak memory (run in .venv-vision, through the shared lock for real-size models):

    PYTHONPATH=src:. .venv-vision/bin/python bench/peers/detection_export.py \
        tv/maskrcnn_resnet50_fpn [--no-rewrites]

``--no-rewrites`` switches capture.detection's rewrites off (to see what they are needed for).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import onnxmedic  # noqa: E402
from bench.zoo import vision  # noqa: E402  (defines torchvision's ops first)


def main() -> None:
    """Export and verify one zoo entry; print its outcome, findings, time and peak memory."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(vision.ZOO))
    ap.add_argument("--no-rewrites", action="store_true")
    ap.add_argument("-o", default="build/detection.onnx")
    a = ap.parse_args()
    if a.no_rewrites:
        from onnxmedic.capture import detection

        detection.REWRITES.clear()
    case = vision.ZOO[a.name]()
    with torch.no_grad():
        shapes = [tuple(o.shape) for o in case.model(*case.args)]
    start = time.perf_counter()
    res = onnxmedic.export(case.model, case.args, a.o, dynamic_shapes=case.dynamic_shapes)
    print(f"{a.name}: ok={res.ok} export+verify {time.perf_counter() - start:.1f} s, "
          f"outputs {shapes}, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}"
          " MiB")
    for f in res.findings:
        if f.code != "OM204":
            print(f.code, f.message[:400])


if __name__ == "__main__":
    main()
