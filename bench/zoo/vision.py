"""The vision zoo: torchvision and timm models at real size, random weights (no downloads).

torchvision's CUDA-built ops do not load next to the CPU torch; ``torchvision_cpu.install()``
defines them first (run in .venv-vision: ``make .venv-vision/.installed``). Every entry has a
dynamic batch; detection entries take one image (the list-of-images API, per-image Python
loops) with a data-dependent number of detections.

    .venv-vision/bin/python bench/peers/zoo_bench.py --zoo bench/zoo/vision.py:ALL --jobs 1 \
        --results build/vision_bench.json
    .venv-vision/bin/python -m onnxmedic sweep bench/zoo/vision.py:ALL --jobs 1

``ZOO`` maps "library/model" to a factory; ``ALL`` is ``ZOO``; ``FAST`` a small subset with the
smallest models.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.zoo.torchvision_cpu import install  # noqa: E402

install()

from onnxmedic.sweep import ZooCase  # noqa: E402

B = 2
BATCH = {0: "batch"}


def _image(size: int = 224, batch: int = B, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _classifier(build: Callable[[], nn.Module], size: int = 224, note: str = ""
                ) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        torch.manual_seed(0)
        return ZooCase(build().eval(), (_image(size),), {}, (BATCH,), note=note)
    return make


def _tv(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kw)
    return build


def _timm(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kw)
    return build


class SegmentationOut(nn.Module):
    """torchvision's segmentation models return {"out": ..., "aux": ...}: the main map."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x)["out"]


class FirstImage(nn.Module):
    """A detector's list-of-images API as one image in, (boxes, scores, labels) out (then
    masks, or keypoints and their scores, for Mask and Keypoint R-CNN)."""

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = detector

    def forward(self, image: torch.Tensor):
        out = self.detector([image[0]])[0]
        # Mask R-CNN's masks, Keypoint R-CNN's keypoints and their scores after the triple
        extra = tuple(out[k] for k in ("masks", "keypoints", "keypoints_scores") if k in out)
        return (out["boxes"], out["scores"], out["labels"], *extra)


class TinyYolo(nn.Module):
    """A YOLO-style single-scale head: per cell (cx, cy, w, h), objectness and class logits;
    detections above a score threshold (an input), then class-wise NMS."""

    def __init__(self, classes: int = 3, stride: int = 8) -> None:
        super().__init__()
        self.stride = stride
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, 2, 1), nn.ReLU(),
                                  nn.Conv2d(16, 5 + classes, 3, 2, 1))

    def forward(self, image: torch.Tensor, threshold: torch.Tensor):
        p = self.body(image)[0]  # [5 + C, h, w]
        h, w = p.shape[-2:]
        p = p.flatten(1).T  # [h*w, 5 + C]
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        grid = torch.stack([xs, ys], -1).reshape(-1, 2).to(p)
        centre = (grid + p[:, :2].sigmoid()) * self.stride
        size = p[:, 2:4].exp().clamp(max=8.0) * self.stride * 3
        boxes = torch.cat([centre - size / 2, centre + size / 2], 1)
        scores, labels = (p[:, 4:5].sigmoid() * p[:, 5:].softmax(1)).max(1)
        keep = scores > threshold
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
        from torchvision.ops import batched_nms

        kept = batched_nms(boxes, scores, labels, 0.45)
        return boxes[kept], scores[kept], labels[kept]


def calibrated(m: nn.Module, size: int, seed: int = 5) -> nn.Module:
    """A detector with random weights made to score like a trained one: its heads' weights
    random (a fresh head scores every box alike) and its BatchNorm statistics measured on a few
    random images (with the default ones, deep random backbones saturate and many locations
    get the same features). Among equal scores, which boxes survive top-k and NMS is arbitrary;
    with these weights the scores are distinct."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "head" in name or "predictor" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return _measure_batchnorm(m, size, g)


def _measure_batchnorm(m: nn.Module, size: int, g: torch.Generator) -> nn.Module:
    """``m`` in eval mode, its BatchNorm statistics measured on a few random images."""
    with torch.no_grad():
        bns = [b for b in m.modules() if isinstance(b, nn.BatchNorm2d)]
        for b in bns:
            b.reset_running_stats()
            b.momentum = None  # a cumulative average
        m.train()
        for _ in range(3):
            images = list(torch.rand(2, 3, size, size, generator=g))
            m.backbone(m.transform(images)[0].tensors)
        for b in bns:
            b.momentum = 0.1
    return m.eval()


def confident(m: nn.Module, size: int, seed: int = 5) -> nn.Module:
    """A detector with random weights that fires like a trained one: many detections with
    distinct, spread-out scores, its boxes near its anchors or proposals (so that a moved box,
    a dropped box and a wrong label can be told apart). BatchNorm statistics measured as in
    ``calibrated``; then each layer of the heads and predictors, in the order one forward pass
    on a random image meets it, scaled so that its output has unit spread (its classifiers:
    logits of standard deviation 1, neither saturated nor tied), the box regressors 0.1
    (small offsets)."""
    g = torch.Generator().manual_seed(seed)
    layers = {name: mod for name, mod in m.named_modules()
              if isinstance(mod, nn.Conv2d | nn.Linear)
              and ("head" in name or "predictor" in name)}
    with torch.no_grad():
        for mod in layers.values():
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=g))
            if mod.bias is not None:
                mod.bias.zero_()
    m = _measure_batchnorm(m, size, g)
    done: set[str] = set()

    def scale(name: str, target: float):
        def hook(mod: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
            if name in done:  # a head shared by the pyramid's levels: scaled at its first
                return out
            done.add(name)
            factor = target / out.float().std().clamp(min=1e-12)
            mod.weight.mul_(factor)
            return out * factor
        return hook

    with torch.no_grad():
        last_reg = {_last_of(layers, n) for n in layers if "regression_head.module_list" in n}
        hooks = [mod.register_forward_hook(scale(n, 0.1 if n in last_reg or n.split(".")[-1]
                                                 in ("bbox_pred", "bbox_reg") else 1.0))
                 for n, mod in layers.items()]
        try:
            m([torch.rand(3, size, size, generator=g)])
        finally:
            for h in hooks:
                h.remove()
    return m.eval()


def _last_of(layers: dict[str, nn.Module], name: str) -> str:
    """The last layer of ``layers`` under the same SSD head branch (``...module_list.i``)."""
    before, after = name.split("module_list.")
    head = before + "module_list." + after.split(".")[0]
    return [n for n in layers if n.startswith(head + ".") or n == head][-1]


def _segmentation(name: str, size: int = 256) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        torch.manual_seed(0)
        m = _tv(name, weights_backbone=None, aux_loss=False)()
        return ZooCase(SegmentationOut(m).eval(), (_image(size),), {}, (BATCH,),
                       note="torchvision segmentation, the 'out' map")
    return make


def _detection(name: str, size: int, init: Callable[[nn.Module, int], nn.Module] = calibrated,
               **kw) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        torch.manual_seed(0)
        m = init(_tv(name, weights_backbone=None, num_classes=11, **kw)(), size)
        return ZooCase(FirstImage(m).eval(), (_image(size, batch=1),), {}, None,
                       note="torchvision detection: one image, data-dependent detections")
    return make


def confident_detection(name: str) -> ZooCase:
    """torchvision's detector ``name`` (e.g. "retinanet_resnet50_fpn", or "ssd300_vgg16",
    which is no zoo entry for its 136 M parameters) as the zoo builds it (one image of 320x320,
    300x300 for SSD300; 11 classes), with ``confident`` weights."""
    # the R-CNNs, RetinaNet and FCOS at 320 too (their default resizes to 800): at 800,
    # Faster R-CNN MobileNetV3-Large FPN's float32 run leaves 10 of its 100 float64
    # detections, and a one-box fault is within that noise
    kw = dict(min_size=320, max_size=320) if name.endswith(("resnet50_fpn", "resnet50_fpn_v2",
                                                             "mobilenet_v3_large_fpn")) else {}
    return _detection(name, 300 if name == "ssd300_vgg16" else 320, confident, **kw)()


def _yolo(size: int = 320) -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(TinyYolo().eval(), (_image(size, batch=1), torch.tensor(0.05)), {}, None,
                   note="a YOLO-style head in plain torch: grid decode, threshold, batched_nms")


ZOO: dict[str, Callable[[], ZooCase]] = {
    # torchvision classification
    "tv/resnet50": _classifier(_tv("resnet50")),
    "tv/mobilenet_v3_large": _classifier(_tv("mobilenet_v3_large")),
    "tv/efficientnet_b0": _classifier(_tv("efficientnet_b0")),
    "tv/convnext_tiny": _classifier(_tv("convnext_tiny")),
    "tv/regnet_y_400mf": _classifier(_tv("regnet_y_400mf")),
    "tv/vit_b_16": _classifier(_tv("vit_b_16")),
    "tv/swin_t": _classifier(_tv("swin_t")),
    "tv/maxvit_t": _classifier(_tv("maxvit_t")),
    "tv/densenet121": _classifier(_tv("densenet121")),
    "tv/squeezenet1_1": _classifier(_tv("squeezenet1_1")),
    "tv/shufflenet_v2_x1_0": _classifier(_tv("shufflenet_v2_x1_0")),
    "tv/inception_v3": _classifier(_tv("inception_v3", aux_logits=False, init_weights=True),
                                   size=299),
    # torchvision segmentation
    "tv/deeplabv3_mobilenet_v3_large": _segmentation("deeplabv3_mobilenet_v3_large"),
    "tv/fcn_resnet50": _segmentation("fcn_resnet50"),
    "tv/lraspp_mobilenet_v3_large": _segmentation("lraspp_mobilenet_v3_large"),
    # torchvision detection
    "tv/ssdlite320_mobilenet_v3_large": _detection("ssdlite320_mobilenet_v3_large", 320),
    "tv/retinanet_resnet50_fpn": _detection("retinanet_resnet50_fpn", 320, min_size=320,
                                            max_size=320),
    "tv/fcos_resnet50_fpn": _detection("fcos_resnet50_fpn", 320, min_size=320, max_size=320),
    "tv/fasterrcnn_mobilenet_v3_large_320_fpn": _detection(
        "fasterrcnn_mobilenet_v3_large_320_fpn", 320),
    "tv/fasterrcnn_resnet50_fpn": _detection("fasterrcnn_resnet50_fpn", 320, min_size=320,
                                             max_size=320),
    "tv/maskrcnn_resnet50_fpn": _detection("maskrcnn_resnet50_fpn", 320, min_size=320,
                                           max_size=320),
    "tv/keypointrcnn_resnet50_fpn": _detection("keypointrcnn_resnet50_fpn", 320, min_size=320,
                                               max_size=320),
    "det/yolo_head": _yolo,
    # timm CNNs
    "timm/resnet50d": _classifier(_timm("resnet50d")),
    "timm/efficientnet_b0": _classifier(_timm("efficientnet_b0")),
    "timm/convnextv2_nano": _classifier(_timm("convnextv2_nano")),
    "timm/regnety_016": _classifier(_timm("regnety_016")),
    "timm/mobilenetv4_conv_small": _classifier(_timm("mobilenetv4_conv_small")),
    "timm/ghostnetv2_100": _classifier(_timm("ghostnetv2_100")),
    # timm ViTs
    "timm/vit_small_patch16_224": _classifier(_timm("vit_small_patch16_224")),
    "timm/deit_small_patch16_224": _classifier(_timm("deit_small_patch16_224")),
    "timm/eva02_tiny_patch14_224": _classifier(_timm("eva02_tiny_patch14_224")),
    "timm/swinv2_cr_tiny_ns_224": _classifier(_timm("swinv2_cr_tiny_ns_224")),
    "timm/nest_tiny": _classifier(_timm("nest_tiny")),
    "timm/hiera_tiny_224": _classifier(_timm("hiera_tiny_224")),
    "timm/samvit_base_patch16": _classifier(_timm("samvit_base_patch16", img_size=256),
                                            size=256),
    # timm hybrids
    "timm/coatnet_0_rw_224": _classifier(_timm("coatnet_0_rw_224")),
    "timm/levit_128": _classifier(_timm("levit_128")),
    "timm/efficientformer_l1": _classifier(_timm("efficientformer_l1")),
    "timm/fastvit_t8": _classifier(_timm("fastvit_t8")),
    # timm MLP-mixers
    "timm/mixer_b16_224": _classifier(_timm("mixer_b16_224")),
    "timm/resmlp_12_224": _classifier(_timm("resmlp_12_224")),
    "timm/gmlp_s16_224": _classifier(_timm("gmlp_s16_224")),
}

FAST = ["tv/squeezenet1_1", "timm/levit_128"]

ALL: dict[str, Callable[[], ZooCase]] = dict(ZOO)
