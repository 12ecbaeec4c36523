"""Models in the style of PyTorch's own ONNX export tests (test/onnx, eager models) that
onnxmedic failed on (issue 54): each exports and verifies."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

import onnxmedic


def _codes(result) -> list[str]:
    return [f.code for f in result.findings]


def _verified(r) -> None:
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert r.verification and all(c.ok for c in r.verification)


def _run(path, *inputs: torch.Tensor) -> list[np.ndarray]:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {i.name: t.numpy() for i, t in zip(s.get_inputs(), inputs)})


class SetInput(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.set_(y)
        return x


def test_set_on_an_input_verifies_and_the_callers_tensors_are_untouched(tmp_path):
    """x.set_(y) verified before inputs were borrowed only because the example run had left
    the caller's x an alias of y; on a fresh copy torch's decompositions assert
    ("Encountered a set_ on a graph input", OM203). The program now reads y for x (OM213)."""
    x, y = torch.ones(2, 3), torch.randn(4, 6)
    x0, y0 = x.clone(), y.clone()
    dims = {"x": {0: "a", 1: "b"}, "y": {0: "c", 1: "d"}}
    r = onnxmedic.export(SetInput(), (x, y), tmp_path / "m.onnx", dynamic_shapes=dims)
    _verified(r)
    assert "OM213" in _codes(r) and "OM013" in _codes(r)
    assert torch.equal(x, x0) and torch.equal(y, y0) and x.data_ptr() != y.data_ptr()
    y2 = torch.randn(3, 5)
    (out,) = _run(tmp_path / "m.onnx", torch.zeros(7, 2), y2)
    assert np.array_equal(out, y2.numpy())


class ShapeFloat(nn.Module):
    def forward(self, x: torch.Tensor) -> float:
        return x.shape[1] / 2


class SampleSize(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return torch.distributions.Uniform(x, y).sample().size(0), x, y


def test_python_number_outputs_are_0d_tensors(tmp_path):
    """A float (x.shape[1] / 2) and an int (a sample's size) returned by forward() failed
    translation ("'float' object has no attribute 'name'", OM202); each is a 0-d tensor of
    torch.tensor(value)'s dtype, named by OM214."""
    r = onnxmedic.export(ShapeFloat(), (torch.randn(2, 3),), tmp_path / "f.onnx")
    _verified(r)
    (found,) = [f for f in r.findings if f.code == "OM214"]
    assert "output 0" in found.message and "1.5" in found.message
    (out,) = _run(tmp_path / "f.onnx", torch.randn(2, 3))
    assert out.shape == () and out.dtype == np.float32 and out == 1.5

    r = onnxmedic.export(SampleSize(), (torch.zeros(3), torch.ones(3)), tmp_path / "i.onnx")
    _verified(r)
    (found,) = [f for f in r.findings if f.code == "OM214"]
    assert found.details == {"output": 0, "value": 3, "dtype": "int64"}
    n, *_ = _run(tmp_path / "i.onnx", torch.zeros(3), torch.ones(3))
    assert n.dtype == np.int64 and n == 3


class ArgKeepdim(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return torch.argmin(x, keepdim=True), torch.argmax(x, dim=1, keepdim=True)


def test_argmin_keepdim_without_dim_keeps_every_dim(tmp_path):
    """argmin(x, keepdim=True) of a 3-D input is [1, 1, 1] in PyTorch; torchlib gave [1]
    (OM602)."""
    x = torch.randn(3, 4, 5)
    r = onnxmedic.export(ArgKeepdim(), (x,), tmp_path / "m.onnx")
    _verified(r)
    a, b = _run(tmp_path / "m.onnx", x)
    assert a.shape == (1, 1, 1) and b.shape == (3, 1, 5)
    assert a.item() == torch.argmin(x).item()


class OldConvTranspose(nn.Module):
    """torch._convolution as older traced code calls it: transposed, output_padding, TF32 on."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 2, 3, 3, generator=g))
        self.bias = nn.Parameter(torch.randn(2, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._convolution(x, self.weight, self.bias, [2, 2], [1, 1], [1, 1], True,
                                  [1, 1], 1, False, False, True, True)


def test_aten__convolution_verifies():
    """aten._convolution had no translation (OM201)."""
    r = onnxmedic.export(OldConvTranspose(), (torch.randn(1, 4, 6, 5),))
    _verified(r)
    assert any(f.code == "OM204" and f.op == "aten._convolution.default" for f in r.findings)


class ByteMask(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x[mask] * 2


def test_byte_mask_indexing_verifies_at_every_mask_density(tmp_path):
    """x[mask] with a uint8 mask (PyTorch's test_index_mask; a mask in PyTorch, with a
    deprecation warning) failed capture (OM111: torch's fake-tensor rule takes int8 for the
    byte mask). Captured as a bool mask, the file computes the data-dependent size."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.5).to(torch.uint8)
    dims = {"x": {0: "n"}, "mask": {0: "n"}}
    r = onnxmedic.export(ByteMask(), (x, mask), tmp_path / "m.onnx", dynamic_shapes=dims)
    _verified(r)
    for density in (0.0, 0.3, 1.0):
        x2 = torch.randn(6, 5, generator=g)
        m2 = (torch.rand(6, 5, generator=g) < density).to(torch.uint8) * 3  # nonzero: in
        (out,) = _run(tmp_path / "m.onnx", x2, m2)
        assert np.array_equal(out, (x2[m2.bool()] * 2).numpy())
