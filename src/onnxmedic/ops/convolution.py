"""Convolution overloads torchlib lacks: ``aten._convolution``.

``torch._convolution`` is the overload behind ``F.conv*`` and ``F.conv_transpose*`` that
older traced code calls directly (and what code written around
``torch.backends.cudnn.allow_tf32`` reaches): ``aten.convolution``'s arguments plus four
backend flags, ``benchmark``, ``deterministic``, ``cudnn_enabled`` and ``allow_tf32``. The
flags choose among CUDA kernels and their precision; the value they compute is the
convolution's (TF32 only rounds it), so on ONNX's Conv/ConvTranspose they mean nothing and the
call is translated as ``aten.convolution``: torchlib's translation, transposed convolutions
with their ``output_padding`` included.

PyTorch allows a transposed convolution's ``output_padding`` up to ``max(stride, dilation) -
1``; ONNX Runtime's ConvTranspose rejects one not below the stride ("output_padding (3) may be
too large for stride (2)"). Such a call is built as a ConvTranspose without end padding or bias
(the full output past the start padding), whose end is then cut or zero-extended to
PyTorch's length (``output_padding - padding`` per dim), and the bias added: what PyTorch
computes, bias included on the extended rows.
"""

from __future__ import annotations

import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import ints, rank
from onnxmedic.ops._registry import translation

aten = torch.ops.aten


def _per_dim(v, n: int) -> list:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _convolution(input, weight, bias, stride, padding, dilation, transposed: bool,
                 output_padding, groups: int):
    from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

    nd = rank(weight) - 2
    stride, padding, dilation, output_padding = (
        _per_dim(v, nd) for v in (stride, padding, dilation, output_padding))
    if transposed and rank(input) == nd + 2 and all(
            isinstance(v, int) for v in (*stride, *padding, *dilation, *output_padding)) \
            and any(o >= s for o, s in zip(output_padding, stride)):
        return _conv_transpose_wide(input, weight, bias, stride, padding, dilation,
                                    output_padding, groups)
    return torchlib_core.aten_convolution(input, weight, bias, stride, padding, dilation,
                                          transposed, output_padding, groups)


def _conv_transpose_wide(input, weight, bias, stride: list[int], padding: list[int],
                         dilation: list[int], output_padding: list[int], groups: int):
    """A transposed convolution whose output_padding is not below its stride (see the module
    docstring)."""
    nd = len(stride)
    kernel = [d if isinstance(d, int) else None for d in weight.shape[2:]]
    out = op.ConvTranspose(input, weight, strides=stride, pads=[*padding, *[0] * nd],
                           dilations=dilation, group=groups,
                           kernel_shape=kernel if None not in kernel else None)
    grow = [0] * (2 + nd)
    for i, (o, p) in enumerate(zip(output_padding, padding)):
        if o < p:  # the end padding PyTorch crops beyond the output padding
            out = op.Slice(out, ints([0]), ints([o - p]), ints([2 + i]))
        grow[2 + i] = max(o - p, 0)
    if any(grow):  # past the full output: zeros (then the bias, as in PyTorch)
        out = op.Pad(out, ints([0] * (2 + nd) + grow))
    if bias is not None:
        out = op.Add(out, op.Reshape(bias, ints([-1] + [1] * nd)))
    return out


@translation(aten._convolution.default)
def aten__convolution(input, weight, bias, stride, padding, dilation, transposed: bool,
                      output_padding, groups: int, benchmark: bool, deterministic: bool,
                      cudnn_enabled: bool, allow_tf32: bool):
    """_convolution(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups, bool benchmark, bool deterministic, bool cudnn_enabled, bool allow_tf32) -> Tensor

    ``aten.convolution``; the backend flags choose CUDA kernels, not the value."""
    return _convolution(input, weight, bias, stride, padding, dilation, transposed,
                        output_padding, groups)


@translation(aten._convolution.deprecated)
def aten__convolution_deprecated(input, weight, bias, stride, padding, dilation,
                                 transposed: bool, output_padding, groups: int,
                                 benchmark: bool, deterministic: bool, cudnn_enabled: bool):
    """_convolution.deprecated(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed, int[] output_padding, SymInt groups, bool benchmark, bool deterministic, bool cudnn_enabled) -> Tensor

    ``aten.convolution``, as :func:`aten__convolution`."""
    return _convolution(input, weight, bias, stride, padding, dilation, transposed,
                        output_padding, groups)
