"""Program rewrites that make translation succeed without changing a value: mixed int/float
Scalar arguments (OM124, SincNet's clamp) and stride queries of contiguous tensors (OM206,
julius's unfold)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import onnxmedic
from onnxmedic._torch_compat import prepare_for_export
from onnxmedic.fixes.rewrites import (
    check_mixed_scalars_crash,
    storage_order_before_as_strided,
    strides_from_sizes,
)
from onnxmedic.ops import REGISTRY
from onnxmedic.stages.translate import onnx_export


class _Band(torch.nn.Module):
    """SincNet's band edges: clamp of a float tensor between an int and a float."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.band = torch.nn.Parameter(torch.randn(4, 1, generator=g) * 3000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        high = torch.clamp(self.band.abs() + 50, 50, 8000 / 2)
        low = torch.clamp(x, -1, 0.5)  # a graph input, at the clamp's edges
        return x * high + low


def _codes(result):
    return [f.code for f in result.findings]


def test_mixed_int_float_scalars_crash_plain_torch_onnx():
    """The class: plain torch.onnx's decompositions crash (the rewrite is what fixes it)."""
    ep = torch.export.export(_Band().eval(), (torch.randn(4, 3),), strict=False)
    try:
        prepare_for_export(ep, REGISTRY.onnx_registry())
    except RuntimeError as e:
        assert check_mixed_scalars_crash(e) is None
    else:  # pragma: no cover - torch fixed it
        raise AssertionError("torch.onnx no longer crashes on clamp(x, int, float)")


def test_mixed_int_float_scalars_export_and_verify():
    x = torch.tensor([[-3.0, -1.0, 0.0], [0.5, 0.7, 2.0], [1e30, -1e30, 0.25],
                      [float("inf"), float("-inf"), -0.0]])
    result = onnxmedic.export(_Band().eval(), (x,))
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert "OM124" in _codes(result)
    assert all(v.ok and v.max_abs == 0.0 for v in result.verification if v.input_set == "example")


class _Frames(torch.nn.Module):
    """julius.core.unfold: frames of a padded signal through as_strided and its strides. The
    stride of the channel dim (size 1) is ``Max(1, length)``, a value no traced op made, so
    torch.export leaves the query (aten.sym_stride.int) in the graph."""

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        n_frames = math.ceil((max(length, 6) - 6) / 3) + 1
        padded = F.pad(x, (0, (n_frames - 1) * 3 + 6 - length))
        padded = padded.transpose(0, 1) if self.transposed else padded.contiguous()
        strides = [padded.stride(d) for d in range(padded.dim())]
        return padded.as_strided(list(padded.shape[:-1]) + [n_frames, 6],
                                 strides[:-1] + [3, 1]) * 2


def _program(module: torch.nn.Module) -> torch.export.ExportedProgram:
    t = torch.export.Dim("t", min=8)
    return torch.export.export(module, (torch.randn(2, 1, 20),),
                               dynamic_shapes=({2: t},), strict=False)


def _queries(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in ep.graph.nodes if n.target is torch.ops.aten.sym_stride.int]


def test_stride_queries_of_contiguous_tensors_become_sizes():
    ep = _program(_Frames())
    assert _queries(ep)
    n, left = strides_from_sizes(ep)
    assert n >= 1 and left == [] and not _queries(ep)
    for t in (20, 9, 33):
        x = torch.randn(2, 1, t)
        prog = onnx_export(ep, (x,), None, registry=REGISTRY)
        torch.testing.assert_close(prog(x)[0], _Frames()(x), rtol=0, atol=0)


def test_stride_query_without_the_rewrite_has_no_translation():
    ep = _program(_Frames())
    try:
        onnx_export(ep, (torch.randn(2, 1, 20),), None, registry=REGISTRY)
    except Exception as e:
        assert "sym_stride" in str(e)
    else:  # pragma: no cover - torchlib gained a translation
        raise AssertionError("aten.sym_stride.int translated without the rewrite")


def test_export_of_stride_queries_verifies():
    result = onnxmedic.export(_Frames().eval(), (torch.randn(2, 1, 20),),
                              dynamic_shapes=({2: "samples"},))
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert "OM206" in _codes(result)


def test_stride_query_of_a_transposed_tensor_is_left_alone():
    ep = torch.export.export(_Frames(transposed=True), (torch.randn(2, 3, 20),), strict=False)
    # (the strides of the transposed tensor are static here: add a query of its dim 0)
    src = next(n for n in ep.graph.nodes if n.target is torch.ops.aten.transpose.int)
    with ep.graph.inserting_after(src):
        q = ep.graph.call_function(torch.ops.aten.sym_stride.int, (src, 0))
    q.meta["val"] = src.meta["val"].stride(0)
    n, left = strides_from_sizes(ep)
    assert n == 0 and left == [q]



class _SetInput(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.set_(y)
        return x + 1


def test_set_on_an_input_crashes_plain_torch_onnx_and_the_rewrite_reads_the_source():
    """The class (issue 54): torch's decompositions assert on x.set_(y) of a graph input; after
    the rewrite the program reads y where it read x, and decomposes."""
    from onnxmedic.fixes.rewrites import check_set_input_crash, set_inputs_as_sources

    x, y = torch.zeros(2, 3), torch.randn(4, 5)
    ep = torch.export.export(_SetInput(), (x.clone(), y), strict=False)
    try:
        prepare_for_export(ep, REGISTRY.onnx_registry())
    except AssertionError as e:
        assert check_set_input_crash(e) is None
    else:  # pragma: no cover - torch fixed it
        raise AssertionError("torch's decompositions no longer assert on set_ of an input")
    assert set_inputs_as_sources(ep) == 1
    prepare_for_export(ep, REGISTRY.onnx_registry())
    assert torch.equal(ep.module()(x.clone(), y), y + 1)


class _Numbers(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return x + 1, x.shape[1] / 2, x.shape[0], x.dim() == 2


def test_number_outputs_become_0d_tensors_of_torch_tensors_dtype():
    """Python numbers returned by forward() (constants at static shapes) become 0-d tensors;
    each is reported with its index among the outputs."""
    from onnxmedic.fixes.rewrites import constant_outputs_as_tensors

    ep = torch.export.export(_Numbers(), (torch.randn(2, 3),), strict=False)
    made = constant_outputs_as_tensors(ep)
    assert made == [(1, 1.5, torch.float32), (2, 2, torch.int64), (3, True, torch.bool)]
    out = ep.module()(torch.randn(2, 3))
    assert [o.dtype for o in out[1:]] == [torch.float32, torch.int64, torch.bool]
    assert [o.item() for o in out[1:]] == [1.5, 2, True]
    assert constant_outputs_as_tensors(ep) == []  # nothing left to do


class _Chunks(torch.nn.Module):
    """Longformer's and LED's ``_chunk``: heads split off a (seq, batch, embed) tensor,
    ``transpose(1, 2).reshape(...)`` (a view, not a copy: the tensor is not laid out row-major)
    and overlapping chunks read from it by as_strided with its own strides."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, e = x.shape
        q = x.view(s, b, 2, e // 2).transpose(0, 1)
        q = q.transpose(1, 2).reshape(b * 2, s, e // 2)
        q = q.view(b * 2, s // 4, 4, e // 2)
        size, stride = list(q.size()), list(q.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        return q.as_strided(size=size, stride=stride) * 2


def test_as_strided_of_a_view_reads_its_storage_order():
    x = torch.randn(8, 2, 6)
    assert not _Chunks()(x).eq(0).all()
    ep = torch.export.export(_Chunks(), (x,), strict=False)
    plain = onnx_export(ep, (x,), None, registry=REGISTRY)(x)[0]
    # the fault the rewrite mends: row-major values where PyTorch reads the storage
    assert not torch.allclose(plain, _Chunks()(x))
    ep = torch.export.export(_Chunks(), (x,), strict=False)
    assert storage_order_before_as_strided(ep) == 1
    torch.testing.assert_close(ep.module()(x), _Chunks()(x), rtol=0, atol=0)
    prog = onnx_export(ep, (x,), None, registry=REGISTRY)
    torch.testing.assert_close(prog(x)[0], _Chunks()(x), rtol=0, atol=0)
    # a contiguous input is left as it is
    assert storage_order_before_as_strided(_program(_Frames())) == 0


def test_export_of_chunks_from_a_view_verifies():
    result = onnxmedic.export(_Chunks().eval(), (torch.randn(8, 2, 6),))
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert "OM215" in _codes(result)
