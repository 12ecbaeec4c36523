"""Capture with backed sizes after torch lost an unbacked one (SizesBacked), and roll by a
symbolic shift (ops.complex.aten_roll): neuraloperator's FNO in small, library-free.

FNO's spectral convolution keeps ``n_modes`` Fourier modes: ``start = max_modes - min(n,
n_modes)`` picks the weight's centre modes when the input has fewer (``if start``), and the
input's centre modes are sliced by the weight's size. Under backed_size_oblivious (capture's
default for dynamic shapes) the slice bounds become unbacked sizes torch cannot bind
(PendingUnbackedSymbolNotFound); with backed sizes torch follows the example's branch and keeps
``n >= n_modes`` as a guard, which the written file records (OM408). ``torch.fft.fftshift``
over a dynamic dim rolls by ``n // 2``, a symbolic shift torchlib cannot translate."""

from __future__ import annotations

import pytest
import torch

import onnxmedic
from onnxmedic.capture import strategies


class Modes(torch.nn.Module):
    """FNO's mode selection (neuralop spectral_convolution.py:459-506) over the last dim."""

    def __init__(self, n_modes: int = 4) -> None:
        super().__init__()
        self.n_modes = n_modes
        self.weight = torch.nn.Parameter(torch.randn(n_modes, generator=torch.Generator()
                                                     .manual_seed(1)))

    def forward(self, x):
        n = x.shape[-1]
        start = self.n_modes - min(n, self.n_modes)
        w = self.weight[slice(start // 2, -start // 2) if start else slice(start, None)]
        k = w.shape[0]
        c = n // 2
        s = slice(c - k // 2, c + k // 2 + k % 2)
        out = torch.zeros_like(x)
        out[..., s] = x[..., s] * w
        return out


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _ort(path):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])


def test_mode_selection_exports_with_backed_sizes_and_a_minimum(tmp_path):
    model = Modes()
    r = onnxmedic.export(model, (_x(2, 16),), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "batch", 1: "n"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    attempts = [(a["strategy"], a["ok"]) for a in r.attempts]
    assert attempts[0] == ("torch.export(strict=False)", False)
    assert "Pending unbacked symbols" in r.attempts[0]["error"]
    assert attempts[-1] == ("torch.export(strict=False), backed sizes", True)
    # below n_modes the model takes the other branch: the file failed at 1 and says which
    # sizes it holds at (from the guard torch kept; at least 5: the sizes verified)
    (f,) = [f for f in r.findings if f.code == "OM408"]
    assert f.message.startswith("n is dynamic in sizes that are at least 5"), f.message
    assert f.details["failed_at"] == [1] and f.details["verified_at"] == [5, 16, 17]
    run = _ort(tmp_path / "m.onnx")
    for shape in [(1, 5), (3, 6), (2, 31), (5, 64)]:
        torch.testing.assert_close(run(_x(*shape)), model(_x(*shape)))
    with pytest.raises(AssertionError):  # below n_modes: not the model's modes
        torch.testing.assert_close(run(_x(2, 3)), model(_x(2, 3)))


def test_without_backed_sizes_the_unbacked_slice_fails(monkeypatch):
    monkeypatch.setattr(strategies, "CAPTURE_STRATEGIES", [
        s for s in strategies.CAPTURE_STRATEGIES if s is not strategies.SizesBacked])
    r = onnxmedic.export(Modes(), (_x(2, 16),), dynamic_shapes=({0: "batch", 1: "n"},))
    assert not r.ok and r.stages["capture"] == "failed"


def test_backed_sizes_only_after_a_lost_unbacked_size():
    s = strategies.SizesBacked()
    failed = strategies.Result(None, "x", RuntimeError("Constraints violated"))
    lost = strategies.Result(None, "x", RuntimeError("Pending unbacked symbols {u4} not in "
                                                     "returned outputs"))
    assert s.check([failed], (), {}).startswith("no earlier attempt lost an unbacked size")
    assert s.check([failed, lost], (), {}) is None
    # MPT's ALiBi bias with a cache (AlibiSlice below), as torch.export(strict=False) says it
    mpt = strategies.Result(None, "x", RuntimeError(
        "The size of tensor a (s70) must match the size of tensor b (1 - Max(0, -s69 - 2*s70 "
        "+ 1)) at non-singleton dimension 2"))
    fixed = strategies.Result(None, "x", RuntimeError(
        "The size of tensor a (3) must match the size of tensor b (4) at non-singleton "
        "dimension 1"))  # a model's own broadcast error, not a size torch could not prove
    assert s.check([mpt], (), {}) is None and s.check([fixed], (), {}) is not None


class AlibiSlice(torch.nn.Module):
    """MPT's ALiBi bias with a cache (transformers' modeling_mpt.py): a [heads, 1, max_len]
    bias sliced at max(0, 1 - query_length) and added to [batch, heads, new, past + new]
    scores. Its query dim is 1 at every size, which backed_size_oblivious cannot prove (the
    query length MPT computes, new + past + new, is never below 1, but only its values say
    so): 'The size of tensor a (s) must match the size of tensor b (1 - Max(0, ...))'."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(2, 1, 32, generator=torch.Generator()
                                                   .manual_seed(2)))

    def forward(self, x, past):
        k = torch.cat([past, x], dim=2)
        scores = x @ k.transpose(-1, -2)
        query_length, key_length = x.shape[2] + k.shape[2], k.shape[2]
        bias = self.bias[:, max(0, self.bias.size(1) - query_length):,
                         max(0, self.bias.size(2) - key_length):]
        return scores + bias


@pytest.mark.slow  # three capture attempts (~30 s on 2 busy cores); the check is tested above
def test_a_broadcast_oblivious_sizes_cannot_prove_exports_with_backed_sizes(tmp_path):
    args = (_x(2, 2, 3, 4), _x(2, 2, 5, 4))
    shapes = ({0: "batch", 2: "new"}, {0: "batch", 2: "past"})
    r = onnxmedic.export(AlibiSlice().eval(), args, tmp_path / "m.onnx", dynamic_shapes=shapes)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "must match the size of tensor b" in r.attempts[0]["error"]
    assert (r.attempts[-1]["strategy"], r.attempts[-1]["ok"]) == (
        "torch.export(strict=False), backed sizes", True)


class Shift(torch.nn.Module):
    """fftshift of a dynamic dim (a roll by n // 2), of a real and of a complex tensor, and a
    roll of the flattened tensor by a size."""

    def forward(self, x):
        spec = torch.fft.fftshift(torch.fft.fft(x, dim=-1), dim=-1)
        return (torch.fft.fftshift(x, dim=(0, -1)) + spec.real * spec.imag
                + torch.roll(x, x.shape[-1] // 3) - torch.roll(x, -x.shape[0], dims=0))


@pytest.mark.parametrize("shape", [(2, 8), (3, 7)])
def test_roll_by_a_symbolic_shift(tmp_path, shape):
    model = Shift()
    r = onnxmedic.export(model, (_x(*shape),), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "b", 1: "n"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM408" not in [f.code for f in r.findings]
    run = _ort(tmp_path / "m.onnx")
    for other in [(1, 1), (1, 5), (4, 9), (6, 16)]:
        torch.testing.assert_close(run(_x(*other)), model(_x(*other)), atol=1e-5, rtol=1e-5)
