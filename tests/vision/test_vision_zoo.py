"""The real-size vision zoo (bench/zoo/vision.py) through `onnxmedic sweep`, in .venv-vision.
The whole zoo is slow (real sizes, one model at a time); the default run checks its shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnxmedic.sweep import import_source, sweep
from tests.vision.conftest import SKIP_REASON

pytest.importorskip("torchvision", reason=SKIP_REASON)

ROOT = Path(__file__).resolve().parents[2]
ZOO = str(ROOT / "bench" / "zoo" / "vision.py")
VISION = import_source(ZOO)

# entries that do not export and verify yet, each with the finding it ends in and why (from
# the slow test's run; an entry listed here that starts to pass, or one not listed that fails,
# fails the test)
KNOWN_FAILURES: dict[str, str] = {}


def test_zoo_covers_the_families() -> None:
    names = set(VISION.ZOO)
    assert len(names) >= 35
    for family in ("tv/resnet50", "tv/deeplabv3_mobilenet_v3_large",
                   "tv/ssdlite320_mobilenet_v3_large", "tv/fasterrcnn_mobilenet_v3_large_320_fpn",
                   "timm/vit_small_patch16_224", "timm/coatnet_0_rw_224", "timm/mixer_b16_224",
                   "timm/nest_tiny", "timm/hiera_tiny_224", "timm/samvit_base_patch16",
                   "tv/fasterrcnn_resnet50_fpn", "tv/maskrcnn_resnet50_fpn",
                   "tv/keypointrcnn_resnet50_fpn"):
        assert family in names, family
    assert set(VISION.FAST) <= names


@pytest.mark.slow
@pytest.mark.timeout(7200)  # ~40 real-size models one at a time
def test_whole_vision_zoo(tmp_path) -> None:
    res = sweep(ZOO + ":ALL", jobs=1, timeout=1200, results=tmp_path / "r.json")
    failed = {e["name"]: [f["code"] for f in e["findings"] if f["severity"] == "error"]
              for e in res.entries if not e["ok"]}
    assert len(res.entries) == len(VISION.ZOO)
    assert set(failed) == set(KNOWN_FAILURES), failed
    for name, codes in failed.items():
        assert codes and KNOWN_FAILURES[name].split(":")[0] in codes, (name, codes)
