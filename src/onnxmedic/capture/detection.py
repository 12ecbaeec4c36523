"""torchvision's detection postprocess written so that torch.export can capture it.

Each function here computes what torchvision's does, with the per-box steps whose sizes depend on
the data written as ops with unbacked sizes that torch.export keeps symbolic.
``Rewritten`` (used by capture.strategies.capture) puts them in place of torchvision's for the
capture of a model that holds the torchvision module calling them, and torchvision's back when
the capture ends (OM221 lists them); verification compares the ONNX model with torchvision's
own code.

- ``paste_masks_in_image``: Mask R-CNN's masks resized to their boxes and pasted into the image,
  per box in torchvision (a resize to a size read from the box's values), here for all boxes
  at once as ``rows @ mask @ cols^T`` with the bilinear weights of each box's rows and columns.
- ``heatmaps_to_keypoints``: Keypoint R-CNN's heatmaps resized bicubically to their boxes'
  ceiled sizes and decoded at their argmax, per box in torchvision, here for all boxes at once
  (resized to the largest box, the rest masked out).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch


def _bilinear_rows(start: torch.Tensor, end: torch.Tensor, out: int, size: int
                   ) -> torch.Tensor:
    """[N, out, size]: row j of detection n holds the weights of ``F.interpolate(...,
    mode="bilinear", align_corners=False)`` resizing ``size`` samples to the box's
    ``end - start + 1`` (at least 1) pixels, for the image pixel j (zero outside the box)."""
    length = (end - start + 1).clamp(min=1)
    pixel = torch.arange(out, device=start.device)[None, :]
    inside = (pixel >= start[:, None]) & (pixel <= end[:, None])
    scale = size / length.to(torch.float32)  # as torch: input size / output size, in float
    src = ((pixel - start[:, None]).to(torch.float32) + 0.5) * scale[:, None] - 0.5
    src = src.clamp(min=0)
    lo = src.floor().clamp(max=size - 1)
    frac = src - lo
    lo = lo.to(torch.int64)
    hi = torch.where(lo < size - 1, lo + 1, lo)
    k = torch.arange(size, device=start.device)[None, None, :]
    weights = (1 - frac)[..., None] * (k == lo[..., None]) + frac[..., None] * (k == hi[..., None])
    return weights * inside[..., None]


def paste_masks_in_image(masks: torch.Tensor, boxes: torch.Tensor, img_shape: Any,
                         padding: int = 1) -> torch.Tensor:
    """torchvision.models.detection.roi_heads.paste_masks_in_image for every box at once:
    each mask (padded, its box expanded alike and rounded to integers, as torchvision does)
    resized bilinearly to its box and written into an image of zeros, as one product of
    interpolation matrices ``rows @ mask @ cols^T`` instead of a loop over the boxes."""
    roi_heads = sys.modules["torchvision.models.detection.roi_heads"]
    masks, scale = roi_heads.expand_masks(masks, padding=padding)
    boxes = roi_heads.expand_boxes(boxes, scale).to(dtype=torch.int64)
    im_h, im_w = img_shape
    size = masks.shape[-1]
    rows = _bilinear_rows(boxes[:, 1], boxes[:, 3], im_h, size).to(masks.dtype)
    cols = _bilinear_rows(boxes[:, 0], boxes[:, 2], im_w, size).to(masks.dtype)
    return (rows @ masks[:, 0] @ cols.transpose(1, 2))[:, None]


def _cubic(t: torch.Tensor) -> list[torch.Tensor]:
    """torch's bicubic coefficients (A = -0.75) of the taps at -1, 0, 1, 2 for offset ``t``."""
    a = -0.75

    def near(x: torch.Tensor) -> torch.Tensor:
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _bicubic_rows(length: torch.Tensor, out: int, size: int) -> torch.Tensor:
    """[N, out, size]: the weights of ``F.interpolate(..., mode="bicubic",
    align_corners=False)`` resizing ``size`` samples to ``length[n]`` pixels (rows past it
    zero)."""
    pixel = torch.arange(out, device=length.device)[None, :]
    scale = size / length.to(torch.float32)
    src = (pixel.to(torch.float32) + 0.5) * scale[:, None] - 0.5  # not clamped for cubic
    base = src.floor()
    t = src - base
    base = base.to(torch.int64)
    k = torch.arange(size, device=length.device)[None, None, :]
    weights = torch.zeros(())
    for tap, coef in zip(range(-1, 3), _cubic(t), strict=True):
        at = (base + tap).clamp(0, size - 1)
        weights = weights + coef[..., None] * (k == at[..., None])
    return weights * (pixel < length[:, None])[..., None]


def heatmaps_to_keypoints(maps: torch.Tensor, rois: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision.models.detection.roi_heads.heatmaps_to_keypoints for every box at once:
    each heatmap resized bicubically to its box's ceiled size (as interpolation matrices,
    padded to the largest box, the padding never the maximum), its argmax in row-major order
    (ties: the first), the keypoint at the pixel's centre scaled back to the box."""
    offset_x, offset_y = rois[:, 0], rois[:, 1]
    widths = (rois[:, 2] - rois[:, 0]).clamp(min=1)
    heights = (rois[:, 3] - rois[:, 1]).clamp(min=1)
    wc, hc = widths.ceil(), heights.ceil()
    n, k, size = maps.shape[0], maps.shape[1], maps.shape[-1]
    # an integer item: torch.export keeps it an unbacked size (a float's int() it cannot);
    # no int() around it, which non-strict capture would have to specialise
    top_h = torch.cat([hc, hc.new_ones(1)]).max().to(torch.int64).item()
    top_w = torch.cat([wc, wc.new_ones(1)]).max().to(torch.int64).item()
    torch._check(top_h >= 1)
    torch._check(top_w >= 1)
    rows = _bicubic_rows(hc.to(torch.int64), top_h, size).to(maps.dtype)
    cols = _bicubic_rows(wc.to(torch.int64), top_w, size).to(maps.dtype)
    roi_map = rows[:, None] @ maps @ cols[:, None].transpose(2, 3)  # [N, K, top_h, top_w]
    inside = ((torch.arange(top_h)[None, :, None] < hc[:, None, None])
              & (torch.arange(top_w)[None, None, :] < wc[:, None, None]))
    roi_map = roi_map.masked_fill(~inside[:, None], float("-inf"))
    flat = roi_map.reshape(n, k, top_h * top_w)
    pos = flat.argmax(dim=2)
    scores = flat.gather(2, pos[..., None])[..., 0]
    y_int = torch.div(pos, top_w, rounding_mode="floor")
    x_int = pos - y_int * top_w
    x = (x_int.float() + 0.5) * (widths / wc)[:, None] + offset_x[:, None]
    y = (y_int.float() + 0.5) * (heights / hc)[:, None] + offset_y[:, None]
    xy = torch.stack([x, y, torch.ones_like(x)], dim=2)
    return xy, scores


@dataclass(frozen=True)
class Rewrite:
    """One torchvision function replaced for the capture: ``module.attr`` by ``replacement``,
    when the model holds a module whose class is named one of ``modules`` (defined in
    torchvision); ``what`` says what the replacement does differently, for OM221."""

    module: str
    attr: str
    replacement: Callable[..., Any]
    modules: tuple[str, ...]
    what: str


REWRITES: list[Rewrite] = [
    Rewrite("torchvision.models.detection.transform", "paste_masks_in_image",
            paste_masks_in_image, ("MaskRCNNHeads", "MaskRCNNPredictor"),
            "Mask R-CNN pastes every mask into the image at once with bilinear interpolation "
            "matrices (torchvision: a Python loop over the detections, each resized to its "
            "box's size)"),
    Rewrite("torchvision.models.detection.roi_heads", "heatmaps_to_keypoints",
            heatmaps_to_keypoints, ("KeypointRCNNHeads", "KeypointRCNNPredictor"),
            "Keypoint R-CNN decodes every box's heatmaps at once, resized bicubically to the "
            "largest box by interpolation matrices (torchvision: a Python loop over the "
            "detections, each resized to its box's size)"),
]


def _uses(model: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return any(type(m).__name__ in names and type(m).__module__.startswith("torchvision.")
               for m in model.modules())


class Rewritten:
    """The REWRITES that apply to ``model`` (torchvision imported, one of the modules in the
    model), in place while the context is open; ``on``: what each one changed."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.on: list[str] = []
        self._saved: list[tuple[ModuleType, str, Any]] = []

    def __enter__(self) -> Rewritten:
        if not isinstance(self.model, torch.nn.Module):
            return self
        for r in REWRITES:
            mod = sys.modules.get(r.module)
            if mod is None or not hasattr(mod, r.attr) or not _uses(self.model, r.modules):
                continue
            self._saved.append((mod, r.attr, getattr(mod, r.attr)))
            setattr(mod, r.attr, r.replacement)
            self.on.append(f"{r.module}.{r.attr}: {r.what}")
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, attr, original in reversed(self._saved):
            setattr(mod, attr, original)
        self._saved.clear()
