"""A DETR-style detector end to end: transformers' DetrForObjectDetection from a tiny config
with its own ResNet backbone (no timm, no download), its set predictions post-processed in the
model (softmax over the classes without "no object", a score threshold given as an input, boxes
from (cx, cy, w, h) to image corners), so the number of detections depends on the data. Verified
as a detection set; an image below the threshold everywhere gives [0, 4], [0], [0]."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import onnxmedic
from onnxmedic.verify.detections import compare_detections

transformers = pytest.importorskip("transformers")


class DetrDetections(nn.Module):
    """DETR's outputs for one image as (boxes, scores, labels) above ``threshold``."""

    def __init__(self, detr: nn.Module) -> None:
        super().__init__()
        self.detr = detr

    def forward(self, pixel_values: torch.Tensor, threshold: torch.Tensor):
        out = self.detr(pixel_values=pixel_values)
        scores, labels = out.logits[0].softmax(-1)[:, :-1].max(-1)
        cx, cy, w, h = out.pred_boxes[0].unbind(-1)
        height, width = pixel_values.shape[-2:]
        boxes = torch.stack([(cx - w / 2) * width, (cy - h / 2) * height,
                             (cx + w / 2) * width, (cy + h / 2) * height], -1)
        keep = scores > threshold
        return boxes[keep], scores[keep], labels[keep]


def tiny_detr() -> nn.Module:
    """A 2-layer DETR (d_model 32, 20 queries, 5 classes) on a 4-stage ResNet of 8-16
    channels. Fresh weights give every query nearly the same prediction: the query embeddings
    and the decoder's and heads' weights are drawn again so that the scores are distinct."""
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    torch.manual_seed(0)
    backbone = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 16, 16],
                            depths=[1, 1, 1, 1], out_features=["stage4"])
    cfg = DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone=None,
                     backbone_config=backbone, d_model=32, encoder_layers=1, decoder_layers=2,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                     decoder_ffn_dim=32, num_queries=20, num_labels=5, auxiliary_loss=False)
    detr = DetrForObjectDetection(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in detr.named_parameters():
            if "query_position" in name or ("decoder" in name and p.dim() > 1):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "class_labels_classifier" in name or "bbox_predictor" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return DetrDetections(detr).eval()


@pytest.mark.slow  # about 13 s of CPU
def test_detr_exports_and_verifies_as_a_detection_set(tmp_path) -> None:
    model = tiny_detr()
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        every = model(image, torch.tensor(0.0))[1]
    assert len(every) == 20 and len(torch.unique(every)) > 15  # distinct scores
    threshold = every.median()
    res = onnxmedic.export(model, (image, threshold), tmp_path / "detr.onnx")
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]
    sess = ort.InferenceSession(str(tmp_path / "detr.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    other = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    for t in (float(threshold), 0.0, 1.0):
        got = sess.run(None, dict(zip(names, [other.numpy(), np.array(t, np.float32)])))
        with torch.no_grad():
            want = tuple(x.numpy() for x in model(other, torch.tensor(t)))
        cmp = compare_detections(want, tuple(got))
        assert cmp.ok and cmp.matched == len(want[0]), [f.message for f in cmp.findings]
        assert (got[0].shape == (0, 4)) == (t == 1.0)
