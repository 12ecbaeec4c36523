"""torchvision's detection ops: ``torchvision::nms``, ``roi_align``, ``roi_pool``,
``deform_conv2d``.

torchvision defines these ops when it is imported; the entries are registered with
``defined_later=True``, so onnxmedic works without torchvision and never imports it. torchlib has
translations for them too, but registers them only when torchvision is installed at the time its
registry is built, and its ``roi_pool`` reads the arguments of the Python function
``torchvision.ops.roi_pool`` (``output_size``, then ``spatial_scale``) where the op passes
``spatial_scale, pooled_height, pooled_width`` and expects two outputs, so every export of a model
with a ``RoIPool`` fails.

- ``nms`` -> ``NonMaxSuppression`` with one batch and one class: both suppress a box whose IoU with
  a kept one is *greater* than the threshold, visit the boxes by decreasing score (ties: the
  lower index first) and return the kept indices in that order; the count of kept boxes is data
  dependent and may be 0. ``batched_nms`` needs nothing more: its coordinate trick (offsetting each
  class's boxes by ``class * (max coordinate + 1)``) is plain tensor arithmetic before ``nms``.
- ``roi_align`` -> ``RoiAlign`` (average mode): ``aligned=True`` is ``half_pixel``, ``aligned=False``
  ``output_half_pixel`` (which also clamps the RoI size to >= 1, as torchvision does); an adaptive
  ``sampling_ratio`` (<= 0) is ONNX's 0.
- ``roi_pool`` -> ``MaxRoiPool`` (Fast R-CNN's integer bins, C++ rounding of the RoI corners).
  The op's second output, the argmax the backward uses, has no ONNX counterpart: it is returned
  as -1 everywhere, so a model that outputs it fails verification rather than passing wrongly.
- ``deform_conv2d`` -> ``DeformConv`` (opset 19) where the runtime has a kernel.

``ps_roi_align``/``ps_roi_pool`` (position-sensitive pooling) have no ONNX op and stay
untranslated.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import opset18 as op
from onnxscript import opset19

from onnxmedic.ops._common import ints
from onnxmedic.ops._registry import translation

_FLOAT = ir.DataType.FLOAT
_INT32 = ir.DataType.INT32
_INT64 = ir.DataType.INT64
_INT64_MAX = 0x7FFFFFFFFFFFFFFF


@translation("torchvision::nms", defined_later=True,
             note="torchvision's nms; torchlib registers its own only when torchvision is "
                  "installed before torch.onnx builds its registry")
def torchvision_nms(dets, scores, iou_threshold: float):
    """nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"""
    boxes = op.Unsqueeze(op.Cast(dets, to=_FLOAT), ints([0]))  # [1, N, 4]
    conf = op.Unsqueeze(op.Cast(scores, to=_FLOAT), ints([0, 1]))  # [1, 1, N]
    selected = op.NonMaxSuppression(boxes, conf, ints([_INT64_MAX]),
                                    op.Constant(value_floats=[float(iou_threshold)]))
    # selected: [K, 3] rows of (batch, class, box), in the order NMS kept them
    return op.Reshape(op.Slice(selected, ints([2]), ints([3]), ints([1])), ints([-1]))


@translation("torchvision::roi_align", defined_later=True,
             note="RoiAlign: aligned=True as half_pixel, aligned=False as output_half_pixel")
def torchvision_roi_align(input, rois, spatial_scale: float, pooled_height: int,
                          pooled_width: int, sampling_ratio: int, aligned: bool):
    """roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height,
    SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor"""
    batch = op.Cast(op.Squeeze(op.Slice(rois, ints([0]), ints([1]), ints([1])), ints([1])),
                    to=_INT64)
    boxes = op.Slice(rois, ints([1]), ints([5]), ints([1]))
    return op.RoiAlign(
        input, boxes, batch,
        coordinate_transformation_mode="half_pixel" if aligned else "output_half_pixel",
        mode="avg", output_height=pooled_height, output_width=pooled_width,
        sampling_ratio=max(int(sampling_ratio), 0), spatial_scale=float(spatial_scale),
    )


@translation("torchvision::roi_pool", defined_later=True, overrides_torchlib=True,
             note="MaxRoiPool; torchlib's entry reads the Python API's arguments, not the op's")
def torchvision_roi_pool(input, rois, spatial_scale: float, pooled_height: int,
                         pooled_width: int):
    """roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height,
    SymInt pooled_width) -> (Tensor, Tensor)"""
    out = op.MaxRoiPool(input, rois, pooled_shape=[pooled_height, pooled_width],
                        spatial_scale=float(spatial_scale))
    # the backward's argmax has no ONNX counterpart: -1 (torchvision's "no element") everywhere
    argmax = op.Cast(op.Expand(op.Constant(value_ints=[-1]), op.Shape(out)), to=_INT32)
    return out, argmax


@translation("torchvision::deform_conv2d", defined_later=True,
             note="DeformConv (opset 19)")
def torchvision_deform_conv2d(input, weight, offset, mask, bias, stride_h: int, stride_w: int,
                              pad_h: int, pad_w: int, dilation_h: int, dilation_w: int,
                              groups: int, offset_groups: int, use_mask: bool):
    """deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias,
    SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h,
    SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor"""
    return opset19.DeformConv(
        input, weight, offset, bias, mask if use_mask else None,
        dilations=[dilation_h, dilation_w], group=groups, offset_group=offset_groups,
        pads=[pad_h, pad_w, pad_h, pad_w], strides=[stride_h, stride_w],
    )
