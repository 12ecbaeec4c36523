"""Faster, Mask and Keypoint R-CNN end to end. torchvision's per-box postprocess
(paste_masks_in_image, heatmaps_to_keypoints) is captured in the forms of capture.detection
(OM221): checked here against torchvision's own functions (fast), and on tiny R-CNNs built from torchvision's classes with a two-level backbone (slow:
about a minute each on 2 cores)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import onnxmedic
from tests.vision.conftest import SKIP_REASON

torchvision = pytest.importorskip("torchvision", reason=SKIP_REASON)

from torchvision.models.detection import roi_heads  # noqa: E402

from bench.zoo.vision import calibrated  # noqa: E402
from onnxmedic.capture import detection  # noqa: E402


def _boxes(n: int, seed: int, span: float = 60.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * span
    boxes = torch.cat([xy, xy + 0.3 + torch.rand(n, 2, generator=g) * 80], 1)
    boxes[0] = torch.tensor([10.0, 10.0, 10.5, 10.2])  # under a pixel
    return boxes


def test_paste_masks_matches_torchvision() -> None:
    g = torch.Generator().manual_seed(0)
    masks = torch.rand(7, 1, 28, 28, generator=g)
    boxes = _boxes(7, 1)
    boxes[1] = torch.tensor([0.0, 0.0, 109.0, 89.0])  # the whole image
    want = roi_heads.paste_masks_in_image(masks, boxes, (90, 110))
    got = detection.paste_masks_in_image(masks, boxes, (90, 110))
    assert got.shape == want.shape == (7, 1, 90, 110)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    empty = detection.paste_masks_in_image(masks[:0], boxes[:0], (90, 110))
    assert empty.shape == roi_heads.paste_masks_in_image(masks[:0], boxes[:0], (90, 110)).shape


def test_heatmaps_to_keypoints_matches_torchvision() -> None:
    maps = torch.randn(9, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    boxes = _boxes(9, 3)
    (want_xy, want_s), (got_xy, got_s) = (roi_heads.heatmaps_to_keypoints(maps, boxes),
                                          detection.heatmaps_to_keypoints(maps, boxes))
    assert torch.equal(got_xy, want_xy)  # the same argmax pixel for every keypoint
    torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=1e-5)
    assert detection.heatmaps_to_keypoints(maps[:0], boxes[:0])[0].shape == (0, 3, 3)


class _Keypoints(nn.Module):
    """The boxes a score threshold keeps (a data-dependent count) decoded by the rewrite."""

    def forward(self, maps: torch.Tensor, boxes: torch.Tensor, scores: torch.Tensor):
        keep = scores > 0.5
        return detection.heatmaps_to_keypoints(maps[keep], boxes[keep])


def test_heatmaps_to_keypoints_captures_non_strict() -> None:
    """Non-strict capture (left when the user's wrapper defeats TorchDynamo) keeps the
    largest box's size an unbacked size: no int() of it to specialise (was OM112)."""
    from onnxmedic.capture.strategies import TorchExportNonStrict, capture

    g = torch.Generator().manual_seed(4)
    args = (torch.randn(9, 3, 56, 56, generator=g), _boxes(9, 3), torch.rand(9, generator=g))
    res = capture(_Keypoints(), args, {}, None, strategies=[TorchExportNonStrict])
    assert res[-1].ok, res[-1].error
    got, want = res[-1].program.module()(*args), _Keypoints()(*args)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])


def test_rewrites_apply_to_models_holding_their_modules_and_are_undone() -> None:
    from torchvision.models.detection import mask_rcnn, transform

    original = transform.paste_masks_in_image
    heads = nn.Sequential(mask_rcnn.MaskRCNNPredictor(8, 8, 4))
    with detection.Rewritten(heads) as rewritten:
        assert len(rewritten.on) == 1 and "paste_masks_in_image" in rewritten.on[0]
        assert transform.paste_masks_in_image is detection.paste_masks_in_image
    assert transform.paste_masks_in_image is original
    with detection.Rewritten(nn.Linear(2, 2)) as rewritten:  # no torchvision module: nothing
        assert rewritten.on == [] and transform.paste_masks_in_image is original


class _Backbone(nn.Module):
    """Two feature levels (strides 4 and 8) of 8 channels."""

    out_channels = 8

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv2d(3, 8, 3, 4, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.c2 = nn.Sequential(nn.Conv2d(8, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        a = self.c1(x)
        return OrderedDict([("0", a), ("1", self.c2(a))])


class Outputs(nn.Module):
    """A batch of images in (a list to the detector: its length is the example's); each
    image's outputs in turn, as a flat tuple (boxes, scores, labels, then masks or keypoints
    and their scores)."""

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = detector

    def forward(self, images: torch.Tensor):
        return tuple(out[k] for out in self.detector(list(images))
                     for k in ("boxes", "scores", "labels", "masks", "keypoints",
                               "keypoints_scores") if k in out)


SIZE = 96


def tiny_rcnn(kind: str) -> nn.Module:
    """A Faster/Mask/Keypoint R-CNN of torchvision's classes at 96x96 with 20 detections."""
    from torchvision.models.detection import FasterRCNN, KeypointRCNN, MaskRCNN
    from torchvision.models.detection import keypoint_rcnn as kp
    from torchvision.models.detection import mask_rcnn as mk
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(0)

    def pool(size: int) -> MultiScaleRoIAlign:
        return MultiScaleRoIAlign(["0", "1"], size, 2)

    kw = dict(min_size=SIZE, max_size=SIZE, rpn_pre_nms_top_n_test=60,
              rpn_post_nms_top_n_test=30, box_detections_per_img=20,
              rpn_anchor_generator=AnchorGenerator(((16,), (32,)), ((0.5, 1.0, 2.0),) * 2),
              box_roi_pool=pool(5), box_head=TwoMLPHead(8 * 25, 32),
              box_predictor=FastRCNNPredictor(32, 2 if kind == "keypoint" else 4))
    if kind == "faster":
        m = FasterRCNN(_Backbone(), **kw)
    elif kind == "mask":
        m = MaskRCNN(_Backbone(), mask_roi_pool=pool(7), mask_head=mk.MaskRCNNHeads(8, [8], 1),
                     mask_predictor=mk.MaskRCNNPredictor(8, 8, 4), **kw)
    else:
        m = KeypointRCNN(_Backbone(), keypoint_roi_pool=pool(7),
                         keypoint_head=kp.KeypointRCNNHeads(8, [8]),
                         keypoint_predictor=kp.KeypointRCNNPredictor(8, 3), **kw)
    return Outputs(calibrated(m, SIZE)).eval()


def _image(seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.rand(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("kind,rows", [("faster", 3), ("mask", 4), ("keypoint", 5)])
def test_tiny_rcnn_exports_and_verifies(tmp_path, kind: str, rows: int) -> None:
    model, image = tiny_rcnn(kind), _image()
    with torch.no_grad():
        ref = model(image)
    assert len(ref) == rows and len(ref[1]) > 5
    path = tmp_path / f"{kind}.onnx"
    res = onnxmedic.export(model, (image,), path)
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]
    codes = [f.code for f in res.findings]
    assert ("OM221" in codes) == (kind != "faster"), codes
    # another image: the ONNX model's detections agree with PyTorch's as a set
    from onnxmedic.verify.detections import compare_detections

    other = _image(7)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: other.numpy()})
    with torch.no_grad():
        want = [t.numpy() for t in model(other)]
    cmp = compare_detections(tuple(want[:3]), tuple(got[:3]), extras=[
        (f"output {k}", want[k], got[k]) for k in range(3, rows)])
    assert cmp.ok and cmp.matched == len(want[0]), [f.message for f in cmp.findings]
    assert [np.shape(g)[1:] for g in got] == [tuple(w.shape[1:]) for w in want]


@pytest.mark.slow
def test_tiny_rcnn_two_images_and_zero_detections(tmp_path) -> None:
    """A list of two images: each image's detections come out in turn, verified as two
    detection sets. A score threshold no box passes: every output keeps its shape with 0
    rows ([0, 4], [0], [0]), in PyTorch and in ONNX Runtime alike."""
    model, images = tiny_rcnn("faster"), _image(3, batch=2)
    res = onnxmedic.export(model, (images,), tmp_path / "two.onnx")
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]
    sess = ort.InferenceSession(str(tmp_path / "two.onnx"), providers=["CPUExecutionProvider"])
    assert len(sess.get_outputs()) == 6
    model.detector.roi_heads.score_thresh = 1.01
    with torch.no_grad():
        assert [tuple(t.shape) for t in model(images)] == [(0, 4), (0,), (0,)] * 2
    res = onnxmedic.export(model, (images[:1],), tmp_path / "none.onnx")
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]
    sess = ort.InferenceSession(str(tmp_path / "none.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: _image(9).numpy()})
    assert [g.shape for g in got] == [(0, 4), (0,), (0,)]
    assert [g.dtype for g in got] == [np.float32, np.float32, np.int64]
