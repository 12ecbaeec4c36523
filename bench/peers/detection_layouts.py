"""A real-size torchvision detector as a new user has it - fresh random weights, its dict
flattened in one of three layouts (tests/vision/test_layouts.py's ``Layout``: sorted keys,
insertion order, a hand-written nested tuple) - exported and verified by onnxmedic; with
``faults``, a moved box, a dropped box and a wrong label injected and each verified again.

    PYTHONPATH=src:. .venv-vision/bin/python bench/peers/detection_layouts.py \
        ssdlite320_mobilenet_v3_large sorted [export|faults]

Prints the verdict, the rule that judged each output, the wall time and the peak memory (this
process and, separately, its largest child: the ONNX Runtime sandbox).
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.zoo.torchvision_cpu import install  # noqa: E402

install()

import torch  # noqa: E402
import torchvision  # noqa: E402

import onnxmedic  # noqa: E402
from tests.vision.test_layouts import Layout, check_layout  # noqa: E402


def main(name: str, layout: str, mode: str = "export") -> None:
    kw = dict(min_size=320, max_size=320) if name.endswith("resnet50_fpn") else {}
    torch.manual_seed(0)
    det = torchvision.models.get_model(name, weights=None, weights_backbone=None, **kw).eval()
    size = 300 if name == "ssd300_vgg16" else 320
    image = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "faults":
            print("faults caught:", check_layout(Path(tmp), det, image, layout))
        else:
            r = onnxmedic.export(Layout(det, layout).eval(), (image,), Path(tmp) / "m.onnx",
                                 localize=False, keep_unverified=True)
            print("verified:", r.ok)
            for f in r.findings:
                if f.severity.value != "info":
                    print(f.code, f.message[:400])
            for c in r.verification:
                print(" ", c.name, c.input_set, c.ok, c.rule, c.expected_shape)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    print(f"{name} {layout} {mode}: {time.time() - start:.0f} s, peak {peak} MiB "
          f"(largest child {child} MiB)")


if __name__ == "__main__":
    main(*sys.argv[1:4])
