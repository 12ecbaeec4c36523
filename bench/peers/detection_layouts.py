"""A real-size torchvision detector as a new user has it, its dict flattened in one of three
layouts (tests/vision/test_layouts.py's ``Layout``: sorted keys, insertion order, a
hand-written nested tuple), exported and verified by onnxmedic; with ``faults``, a moved box,
a dropped box and a wrong label injected into the ONNX model and each verified again.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. .venv-vision/bin/python bench/peers/detection_layouts.py \
        retinanet_resnet50_fpn hand faults [--weights confident|fresh]

``--weights fresh``: torchvision's own initialisation (91 classes), which often scores every
box alike or under the threshold (0 detections); ``confident`` (the default): 11 classes,
bench/zoo/vision.py's ``confident`` weights, which fire with many detections of distinct
scores, so that the faults are tellable. One thread (OMP_NUM_THREADS=1): on a shared 2-core
machine, torch's thread pool makes the reference roi_align's small ops ten times slower.

Prints the verdict, the rule that judged each output, the detections, the wall time and the
peak memory (this process and, separately, its largest child: the ONNX Runtime sandbox).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.zoo.torchvision_cpu import install  # noqa: E402

install()  # torchvision's ops defined before torchvision is imported

import torch  # noqa: E402
import torchvision  # noqa: E402

import onnxmedic  # noqa: E402
from bench.zoo import vision  # noqa: E402
from tests.vision.test_layouts import Layout, check_layout  # noqa: E402


def detector(name: str, weights: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The detector ``name`` with ``weights`` and its image (300x300 for SSD300, else 320)."""
    if weights == "confident":
        case = vision.confident_detection(name)
        return case.model.detector, case.args[0]
    kw = dict(min_size=320, max_size=320) if name.endswith("resnet50_fpn") else {}
    size = 300 if name == "ssd300_vgg16" else 320
    torch.manual_seed(0)
    det = torchvision.models.get_model(name, weights=None, weights_backbone=None, **kw).eval()
    return det, torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))


def main() -> None:
    """Export and verify one detector in one layout (and with ``faults``, inject each fault)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("layout", choices=["sorted", "insertion", "hand"])
    ap.add_argument("mode", choices=["export", "faults"], nargs="?", default="export")
    ap.add_argument("--weights", choices=["confident", "fresh"], default="confident")
    a = ap.parse_args()
    det, image = detector(a.name, a.weights)
    with torch.no_grad():
        scores = det([image[0]])[0]["scores"]
    print(f"detections: {scores.numel()}, distinct scores: {len(set(scores.tolist()))}")
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if a.mode == "faults":
            print("faults caught:", check_layout(Path(tmp), det, image, a.layout))
        else:
            r = onnxmedic.export(Layout(det, a.layout).eval(), (image,), Path(tmp) / "m.onnx",
                                 localize=False, keep_unverified=True)
            print("verified:", r.ok)
            for f in r.findings:
                if f.severity.value != "info":
                    print(f.code, f.message[:400])
            for c in r.verification:
                print(" ", c.name, c.input_set, c.ok, c.rule, c.expected_shape)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    print(f"{a.name} {a.layout} {a.mode} ({a.weights}): {time.time() - start:.0f} s, "
          f"peak {peak} MiB (largest child {child} MiB)")


if __name__ == "__main__":
    main()
