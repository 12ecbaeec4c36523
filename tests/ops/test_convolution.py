"""``aten._convolution`` (torch._convolution: what older traced code and the cuDNN/TF32 paths
call) against PyTorch, on the OpInfo samples of conv1d-3d and conv_transpose1d-3d (strides,
padding, dilation, groups, output_padding) called through it, with every backend flag
setting."""

from __future__ import annotations

import itertools

import torch

from tests.ops._table import OpEntry, make_tests

F32 = {"float32": (1e-5, 1e-5)}


def _tuple(v, n: int) -> list[int]:
    return list(v) if isinstance(v, (list, tuple)) else [v] * n


def _via_convolution(nd: int, transposed: bool, flags: tuple[bool, ...]):
    """F.conv{nd}d / F.conv_transpose{nd}d's arguments, as a torch._convolution call."""

    def fn(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
        args = (x, weight, bias, _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd),
                transposed, _tuple(output_padding, nd), groups)
        if len(flags) == 3:  # the overload without allow_tf32
            return torch.ops.aten._convolution.deprecated(*args, *flags)
        return torch._convolution(*args, *flags)

    return fn


def _batched_numeric(nd: int):
    """torch._convolution takes batched input and numeric padding only (F.conv*d unsqueezes
    an unbatched input and resolves 'same'/'valid' before calling it)."""
    def skip(sample):
        (x, *_), kwargs = sample
        if x.dim() != nd + 2:
            return "unbatched input: F.conv*d adds the batch dim before torch._convolution"
        if isinstance(kwargs.get("padding"), str):
            return "string padding: F.conv*d resolves it before torch._convolution"
        return None
    return skip


def _wide_output_padding(dtype):
    """output_padding not below the stride (PyTorch allows up to max(stride, dilation) - 1;
    ONNX Runtime's ConvTranspose does not): beyond the padding (zero-extended, then the bias)
    and within it (cropped)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 5, 6, generator=g, dtype=dtype)
    w = torch.randn(4, 3, 3, 2, generator=g, dtype=dtype)
    b = torch.randn(3, generator=g, dtype=dtype)
    return [((x, w, b), {"stride": 1, "padding": (0, 2), "dilation": 3,
                         "output_padding": (2, 1)}),
            ((x, w, None), {"stride": (2, 1), "padding": 1, "dilation": (3, 2),
                            "output_padding": (2, 1), "groups": 1})]


# every setting of (benchmark, deterministic, cudnn_enabled, allow_tf32) across the entries:
# none of them may change the ONNX value
_FLAGS = list(itertools.product((False, True), repeat=4))
# OpInfo samples alternate batched / unbatched; max_samples counts both
_SAMPLES = {("conv", 1): 4, ("conv", 2): 6, ("conv", 3): 4, ("conv_transpose", 1): 4,
            ("conv_transpose", 2): 4, ("conv_transpose", 3): 4}
ENTRIES = [
    OpEntry(f"nn.functional.{kind}{nd}d", fn=_via_convolution(nd, kind == "conv_transpose",
                                                                _FLAGS[i * 3 % 16]),
            tolerance=F32, skip_sample=_batched_numeric(nd), max_samples=_SAMPLES[kind, nd],
            edge=_wide_output_padding if (kind, nd) == ("conv_transpose", 2) else None)
    for i, (kind, nd) in enumerate(itertools.product(("conv", "conv_transpose"), (1, 2, 3)))
] + [
    OpEntry("nn.functional.conv_transpose2d", fn=_via_convolution(2, True, (True, False, True)),
            tolerance=F32, use_opinfo=False, edge=_wide_output_padding),
]

make_tests(ENTRIES, globals())
