"""Grouped (ragged) matrix products, the kernel of mixture-of-experts layers.

``grouped_mm(input [S, K], weight [G, K, N], offs [G])``: the rows of ``input`` are sorted by
group (expert) and ``offs`` holds each group's cumulative end row, so group ``g`` owns rows
``offs[g-1]:offs[g]`` and multiplies them by ``weight[g]``. transformers 5 runs its MoE experts
(Mixtral, Qwen2-MoE, DeepSeek, ...) through it: ``aten._grouped_mm`` where the kernel can run
(bf16 only under export), else its own custom op ``transformers::grouped_mm_fallback`` (float32
and float16 weights in export), whose Python loop over ``offs.tolist()`` cannot be traced.
``aten._grouped_mm`` is not translated here: its only export dtype, bf16, has no ONNX Runtime
CPU MatMul to verify a translation against.

Translation: the number of groups is static (the experts' weight is a parameter), so it unrolls
into one ``Slice`` of the group's rows and one ``MatMul`` by that group's weight per group, then
one ``Concat``. That is the work the kernel does - each row meets only its own expert's weight,
the weight is read where it is (no per-row weight gather, which would materialise
[S, K, N]; no dense all-experts product, which would cost G / top_k times the FLOPs) - and every
row count may be dynamic, including 0 for an expert no token chose. Rows past ``offs[-1]`` (no
group) come out as zeros, as in transformers' fallback.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import opset18 as op

from onnxmedic.ops._common import ints
from onnxmedic.ops._registry import translation

_INT64 = ir.DataType.INT64


def _num_groups(weight, opname: str) -> int:
    shape = getattr(weight, "shape", None)
    if shape is None or len(shape) != 3 or not isinstance(shape[0], int):
        raise ValueError(f"{opname}: the weight must be [groups, K, N] with a static number of "
                         f"groups (got shape {shape})")
    return shape[0]


def _grouped_rows_mm(input, weight, offs, opname: str):
    """[S, K] rows sorted by group x [G, K, N] -> [S, N]."""
    groups = _num_groups(weight, opname)
    ends = op.Cast(offs, to=_INT64)
    # one Split each instead of a Slice per group: fewer nodes for the optimizer's rules
    group_ends = op.Split(ends, axis=0, num_outputs=groups) if groups > 1 else [ends]
    group_weights = op.Split(weight, axis=0, num_outputs=groups) if groups > 1 else [weight]
    axis0 = ints([0])
    start = ints([0])
    outs = []
    for g in range(groups):
        rows = op.Slice(input, start, group_ends[g], axis0)  # [n_g, K]
        out = op.MatMul(rows, op.Squeeze(group_weights[g], axis0))  # [n_g, N]
        outs.append(out)
        start = group_ends[g]
    result = op.Concat(*outs, axis=0) if groups > 1 else outs[0]  # [offs[-1], N]
    # rows after the last group's end belong to no group: zeros
    tail = op.Sub(op.Shape(input, start=0, end=1), op.Shape(result, start=0, end=1))
    return op.Pad(result, op.Concat(ints([0, 0]), tail, ints([0]), axis=0))


@translation("transformers::grouped_mm_fallback", defined_later=True,
             note="transformers' MoE experts (defined when transformers' MoE code is imported)")
def transformers_grouped_mm_fallback(input, weight, offs):
    """grouped_mm_fallback(Tensor input, Tensor weight, Tensor offs) -> Tensor

    input [S, K] sorted by group, weight [G, K, N], offs [G] (int32/int64) cumulative ends."""
    return _grouped_rows_mm(input, weight, offs, "transformers::grouped_mm_fallback")

