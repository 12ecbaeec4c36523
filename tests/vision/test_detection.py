"""Detection end to end: a YOLO-style head in plain torch with torchvision's batched_nms (fast),
torchvision's SSDlite (slow). Box counts depend on the data (unbacked sizes), zero detections
keep the output shapes [0, 4], [0], [0], and outputs are verified as detection sets."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import onnxmedic
from tests.vision.conftest import SKIP_REASON

torchvision = pytest.importorskip("torchvision", reason=SKIP_REASON)

from bench.zoo.vision import FirstImage, TinyYolo, calibrated  # noqa: E402


def _yolo() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyYolo().eval()
    image = torch.rand(1, 3, 96, 128, generator=torch.Generator().manual_seed(1))
    return model, (image, torch.tensor(0.05))


def _run(path, image: torch.Tensor, threshold: float) -> list[np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, dict(zip(names, [image.numpy(), np.array(threshold, np.float32)])))


def test_yolo_head_exports_verifies_and_keeps_empty_shapes(tmp_path) -> None:
    model, args = _yolo()
    with torch.no_grad():
        n = model(*args)[0].shape[0]
    assert 3 < n < 150  # of 192 cells: some boxes suppressed, some kept
    path = tmp_path / "yolo.onnx"
    res = onnxmedic.export(model, args, path)
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]
    codes = [f.code for f in res.findings]
    # batched_nms branches on the (data-dependent) box count: its trick was used for capture
    assert "OM118" in codes, codes
    om118 = next(f for f in res.findings if f.code == "OM118")
    assert "batched_nms" in om118.message
    for threshold, expect_none in ((0.05, False), (1.5, True)):
        outs = _run(path, args[0], threshold)
        with torch.no_grad():
            ref = model(args[0], torch.tensor(threshold))
        assert [o.shape for o in outs] == [tuple(r.shape) for r in ref]
        assert (outs[0].shape == (0, 4)) == expect_none
        assert outs[1].dtype == np.float32 and outs[2].dtype == np.int64
    # the function is torchvision's again
    assert torchvision.ops.boxes.batched_nms.__module__ == "torchvision.ops.boxes"


def test_wrong_nms_translation_is_caught_as_detections(tmp_path, registry_snapshot) -> None:
    """An injected fault: an nms translation with a looser IoU threshold drops boxes PyTorch
    keeps; verification names the dropped detections (OM613), not a bare shape mismatch."""
    from onnxscript import opset18 as op

    @onnxmedic.translation("torchvision::nms")
    def faulty_nms(dets, scores, iou_threshold: float):
        boxes = op.Unsqueeze(dets, op.Constant(value_ints=[0]))
        conf = op.Unsqueeze(scores, op.Constant(value_ints=[0, 1]))
        sel = op.NonMaxSuppression(boxes, conf, op.Constant(value_ints=[1 << 40]),
                                   op.Constant(value_floats=[iou_threshold * 0.2]))
        cols = op.Slice(sel, op.Constant(value_ints=[2]), op.Constant(value_ints=[3]),
                        op.Constant(value_ints=[1]))
        return op.Reshape(cols, op.Constant(value_ints=[-1]))

    model, args = _yolo()
    res = onnxmedic.export(model, args, tmp_path / "bad.onnx")
    codes = [f.code for f in res.findings]
    assert not res.ok and "OM613" in codes, codes
    assert not (tmp_path / "bad.onnx").exists()


def _ssdlite() -> nn.Module:
    torch.manual_seed(0)
    m = torchvision.models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=5)
    return calibrated(m, 160)


@pytest.mark.slow
def test_ssdlite_exports_and_verifies(tmp_path) -> None:
    model = FirstImage(_ssdlite()).eval()
    image = torch.rand(1, 3, 160, 160, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scores = model(image)[1]
    assert len(scores) > 50 and len(torch.unique(scores)) == len(scores)  # distinct scores
    res = onnxmedic.export(model, (image,), tmp_path / "ssd.onnx")
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]


class Pooler(nn.Module):
    """MultiScaleRoIAlign over a two-level pyramid: each box goes to its level by its area
    (torchvision's LevelMapper), then roi_align there."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = torchvision.ops.MultiScaleRoIAlign(["p2", "p3"], 3, 2)

    def forward(self, p2: torch.Tensor, p3: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        return self.pool({"p2": p2, "p3": p3}, [boxes], [(256, 256)])


@pytest.mark.slow  # a 10-20 s export
def test_multiscale_roi_align_maps_boxes_to_levels(tmp_path) -> None:
    """Translated again at opset 21 (RoiAlign-22 has no kernel, OM325): the second
    decomposition of the program used to fail on unbacked symbols the first left pending
    (OM203, PendingUnbackedSymbolNotFound)."""
    g = torch.Generator().manual_seed(3)
    p2, p3 = torch.randn(1, 4, 64, 64, generator=g), torch.randn(1, 4, 32, 32, generator=g)
    xy = torch.rand(9, 2, generator=g) * 150
    boxes = torch.cat([xy, xy + torch.tensor([[8.0, 8.0]]) + torch.rand(9, 2, generator=g) * 200],
                      1)  # small and large boxes: both levels
    res = onnxmedic.export(Pooler().eval(), (p2, p3, boxes), tmp_path / "pool.onnx",
                           dynamic_shapes=(None, None, {0: "boxes"}))
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]
    assert "OM325" in {f.code for f in res.findings}
    sess = ort.InferenceSession(str(tmp_path / "pool.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for n in (1, 4):
        out = sess.run(None, dict(zip(names, [p2.numpy(), p3.numpy(), boxes[:n].numpy()])))[0]
        with torch.no_grad():
            ref = Pooler()(p2, p3, boxes[:n])
        np.testing.assert_allclose(out, ref.numpy(), rtol=1e-4, atol=1e-5)
