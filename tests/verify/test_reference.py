"""The float64 reference (verify/reference.py) and what happens without one."""

from __future__ import annotations

import resource
import sys

import numpy as np
import pytest
import torch

import onnxmedic
from onnxmedic.inputs import Inputs
from onnxmedic.verify import reference as ref_mod
from onnxmedic.verify.reference import reference_outputs

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def _expected(model, x):
    return [model(x).detach().numpy()]


def test_reference_runs_a_float64_copy_and_leaves_the_model_alone():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    ref = reference_outputs(model, [Inputs((X,), {})], [_expected(model, X)])
    assert ref.why_not is None and ref.dtype == "float64"
    assert ref.outputs[0][0].dtype == np.float64
    assert all(p.dtype == torch.float32 for p in model.parameters())


class CastsItself(torch.nn.Module):
    def forward(self, x):
        return x.float() * 2, x * 3  # the first output is float32 whatever the input


def test_an_output_the_model_computes_in_float32_itself_has_no_reference():
    m = CastsItself()
    exp = [t.numpy() for t in m(X)]
    ref = reference_outputs(m, [Inputs((X,), {})], [exp])
    assert ref.outputs[0][0] is None and ref.outputs[0][1].dtype == np.float64


class Kept(torch.nn.Module):
    def forward(self, x):
        keep = x[:, 0] > 0.5  # a data-dependent count, as a detector's
        return x[keep], torch.nonzero(keep)[:, 0]


def test_the_raw_reference_keeps_outputs_of_another_shape_or_dtype():
    """The per-output reference needs PyTorch's shape and a float dtype; the raw one keeps
    what the float64 run gave (a detection set's own count and its integer labels)."""
    m = Kept()
    x = torch.full((4, 8), 0.5).index_fill_(0, torch.tensor([1]), 0.9)
    exp = [t.numpy() for t in m(x)]
    exp[0] = exp[0][:0]  # PyTorch's float32 run kept another number of rows
    ref = reference_outputs(m, [Inputs((x,), {})], [exp])
    assert ref.outputs[0] == [None, None]
    raw = ref.raw[0]
    assert raw[0].shape == (1, 8) and raw[0].dtype == np.float64 and raw[1].tolist() == [1]


class Float32Only(torch.nn.Module):
    def forward(self, x):
        return x @ torch.ones(8, 3)  # a float32 constant: float64 inputs fail here


def test_a_model_that_cannot_run_in_float64_verifies_with_om605():
    r = onnxmedic.export(Float32Only(), (X,))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    om605 = [f for f in r.findings if f.code == "OM605"]
    if om605:  # only asked for when the outputs are not within a few ulps anyway
        assert "does not run in float64" in om605[0].message


def test_no_reference_when_the_copy_would_not_fit(monkeypatch):
    monkeypatch.setattr(ref_mod, "MEMORY_SHARE", 1e-12)
    model = torch.nn.Linear(8, 8)
    ref = reference_outputs(model, [Inputs((X,), {})], [_expected(model, X)])
    assert ref.outputs == [] and "GiB" in ref.why_not and "available" in ref.why_not


def test_float16_models_get_a_float32_reference():
    model = torch.nn.Linear(8, 8).half()
    x = X.half()
    ref = reference_outputs(model, [Inputs((x,), {})], [_expected(model, x)])
    assert ref.dtype == "float32" and ref.outputs[0][0].dtype == np.float32


class Cancels(torch.nn.Module):
    def forward(self, x):  # each row sums 64 values near 1e6 and subtracts 64e6: float32
        return (x + 1e6).sum(-1) - 64e6  # keeps ~1/16 of x's precision, in any order


def test_an_unstable_model_gets_om604_not_a_false_om601():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    r = onnxmedic.export(Cancels(), (x,))
    codes = [f.code for f in r.findings]
    assert r.ok and "OM601" not in codes, codes
    (w,) = [f for f in r.findings if f.code == "OM604"]
    assert "numerically unstable" in w.message


def test_the_float64_runs_stop_at_the_time_limit(monkeypatch):
    """Sets after the limit get no reference (judged by the scaled normwise rule), said why."""
    monkeypatch.setattr(ref_mod, "TIME_LIMIT", 0.0)
    model = torch.nn.Linear(8, 8)
    sets = [Inputs((X,), {}), Inputs((X * 2,), {}), Inputs((X * 3,), {})]
    ref = reference_outputs(model, sets, [_expected(model, s.args[0]) for s in sets])
    assert ref.outputs[0][0] is not None and ref.outputs[1] == [None] and ref.outputs[2] == [None]
    assert "took over 0 s" in ref.why_not


def test_the_time_limit_grows_with_pytorchs_own_time(monkeypatch):
    """A big model's reference may take TIME_FACTOR x PyTorch's own runs of the same sets: the
    sets a fixed limit would have cut (a 1.5 B bf16 decoder) keep their reference; a run past
    that limit is still cut."""
    monkeypatch.setattr(ref_mod, "TIME_LIMIT", 0.0)
    model = torch.nn.Linear(8, 8)
    sets = [Inputs((X,), {}), Inputs((X * 2,), {}), Inputs((X * 3,), {})]
    exp = [_expected(model, s.args[0]) for s in sets]
    ref = reference_outputs(model, sets, exp, torch_seconds=60.0)
    assert ref.why_not is None and all(o[0] is not None for o in ref.outputs)
    ref = reference_outputs(model, sets, exp, torch_seconds=1e-9)
    assert ref.outputs[1] == [None] and "took over 0 s" in ref.why_not


def test_a_bf16_model_with_a_float32_buffer_gets_a_float32_reference():
    """transformers keeps a bf16 model's rotary frequencies (a buffer) in float32: the
    parameters decide, and float32 is enough to judge bfloat16 (and twice as fast as float64)."""
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    model.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 8))
    xb = X.to(torch.bfloat16)
    from onnxmedic._tensors import to_numpy

    expected = to_numpy(model(xb).detach())  # ml_dtypes' bfloat16: numpy kind 'V', not 'f'
    ref = reference_outputs(model, [Inputs((xb,), {})], [[expected]])
    assert ref.dtype == "float32" and ref.outputs[0][0].dtype == np.float32
    assert ref_mod.reference_precision(torch.nn.Linear(8, 8))[0] == torch.float64


class ReadsWeightDtype(torch.nn.Module):
    """Linear layers, a LayerNorm, a tied weight used outside its module, a floating buffer
    and a cast to a weight's dtype: what a whole float64 copy computes, op for op."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 8))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x)).to(self.b.weight.dtype)
        h = self.norm(self.b(h) * self.scale)
        return h @ self.a.weight[:8, :8].T, h.sum(-1)


def _whole_copy(model, x):
    high = __import__("copy").deepcopy(model).double()
    with torch.no_grad():
        out = high(x.double())
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def test_the_reference_runs_as_a_whole_float64_copy_would_without_making_one(monkeypatch):
    """Each weight is seen through an upcasting tensor: bit-equal to a float64 copy of the
    model, while no copy of the model is made (deepcopy made to fail)."""
    torch.manual_seed(0)
    model = ReadsWeightDtype().eval()
    want = _whole_copy(model, X)
    monkeypatch.setattr(ref_mod.copy, "deepcopy", lambda *a: 1 / 0)
    ref = reference_outputs(model, [Inputs((X,), {})], [[t.detach().numpy() for t in model(X)]])
    assert ref.why_not is None and ref.dtype == "float64"
    for got, exp in zip(ref.outputs[0], want):
        assert got.dtype == np.float64 and np.array_equal(got, exp)
    assert all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32
               for t in [*model.parameters(), *model.buffers()])


class WritesItsBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1.0)
        return self.lin(x) + self.calls


def test_a_model_writing_its_weights_gets_a_whole_copy_reference():
    """Upcast weights refuse a write (a temporary would lose it): the reference falls back to
    a whole float64 copy, which keeps the write; the model's own buffer is left alone."""
    model = WritesItsBuffer()
    exp = [model(X).detach().numpy()]
    model.calls.zero_()
    want = _whole_copy(model, X)
    ref = reference_outputs(model, [Inputs((X,), {})], [exp])
    assert ref.why_not is None and np.array_equal(ref.outputs[0][0], want[0])
    assert float(model.calls) == 0.0


def test_where_a_whole_copy_would_not_fit_the_time_limit_stops_the_first_run(monkeypatch):
    """A model that had no reference for want of memory gets one through upcast weights, but
    within TIME_LIMIT: past it the run stops (OM605's reason says so) instead of taking
    minutes; with time to spare it completes."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    exp = [_expected(model, X)]
    # the largest weight in float64 (512 B) fits in 40% of 2000 B; a whole copy (1152 B) not
    monkeypatch.setattr(ref_mod, "available_memory", lambda: 2000)
    ref = reference_outputs(model, [Inputs((X,), {})], exp)
    assert ref.why_not is None and ref.outputs[0][0].dtype == np.float64
    monkeypatch.setattr(ref_mod, "TIME_LIMIT", -1.0)
    ref = reference_outputs(model, [Inputs((X,), {})], exp)
    assert ref.outputs == [] and "was stopped" in ref.why_not
    assert "copy of the model needs" in ref.why_not and "GiB available" in ref.why_not


class TiedEmbedding(torch.nn.Module):
    """A language model's ends: an embedding table read by a few ids, tied to the output
    projection."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(512, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, ids):
        return self.norm(self.emb(ids)) @ self.emb.weight.T


def test_an_embedding_converts_only_the_rows_it_reads(monkeypatch):
    """The upcast embedding picks its rows first, then converts them: bit-equal to the whole
    float64 copy's, and the table is converted only where a matmul reads all of it."""
    torch.manual_seed(0)
    model = TiedEmbedding().eval()
    ids = torch.tensor([[3, 7, 7, 500]])
    with torch.no_grad():
        want = [__import__("copy").deepcopy(model).double()(ids).numpy()]
    converted = []
    to, copy_ = torch.Tensor.to, torch.Tensor.copy_

    def counting_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if out.dtype == torch.float64 and self.dtype == torch.float32:
            converted.append(self.numel())
        return out

    def counting_copy(self, src, *args, **kwargs):  # into a kept float64 buffer
        if self.dtype == torch.float64 and src.dtype == torch.float32:
            converted.append(src.numel())
        return copy_(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    ref = reference_outputs(model, [Inputs((ids,), {})], [[model(ids).detach().numpy()]])
    assert ref.why_not is None and np.array_equal(ref.outputs[0][0], want[0])
    assert converted.count(512 * 8) == 1  # the projection's; the lookup converted 4 rows
    assert 4 * 8 in converted


class ViewsOfWeights(torch.nn.Module):
    """Weights read through views (a transpose, a row, a split, an expand, a reshape) and
    converted one after another in the same op sequence: a view kept while another weight
    is converted must still hold its own values (the converted weights share buffers)."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(8, 8))
        self.w2 = torch.nn.Parameter(torch.randn(8, 8))
        self.w3 = torch.nn.Parameter(torch.randn(16, 8))
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        t1 = self.w1.t()  # a view, read after w2 and w3 are converted
        doubled = self.w2 * 2.0  # a new tensor from w2's converted copy
        top, bottom = torch.split(self.w3, 8)  # views of one weight, two outputs
        row = self.w1[3]
        wide = self.b.expand(4, 8)
        flat = self.w2.reshape(-1)[:8]
        y = x @ t1 + x @ doubled + x @ top.T - x @ bottom.T + row + wide + flat
        return y, torch.nn.functional.linear(x, self.w3, None)


def test_converted_weights_share_buffers_without_one_overwriting_another():
    """Each op's converted weights go into buffers kept for the next op's: bit-equal to the
    whole float64 copy's outputs, through views, split pieces and reused buffers alike."""
    torch.manual_seed(1)
    model = ViewsOfWeights().eval()
    want = _whole_copy(model, X)
    ref = reference_outputs(model, [Inputs((X,), {})], [[t.detach().numpy() for t in model(X)]])
    assert ref.why_not is None
    for got, exp in zip(ref.outputs[0], want):
        assert np.array_equal(got, exp)


@pytest.mark.skipif(sys.platform != "linux", reason="page faults as Linux counts them")
def test_the_converted_weights_reuse_their_buffers():
    """Six same-size layers: their float64 copies (6 x 42 MiB, each read by one matmul) take
    one buffer's pages, not six: a page fault per 4 KiB of fresh memory was as long as the
    arithmetic of a 0.5 B decoder's reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2304, 2304) for _ in range(6)]).eval()
    x = torch.randn(4, 2304)
    exp = [_expected(model, x)]
    reference_outputs(model, [Inputs((x,), {})], exp)  # imports, first-call allocations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ref = reference_outputs(model, [Inputs((x,), {})], exp)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    fresh_each = 6 * 2304 * 2304 * 8 // resource.getpagesize()
    assert ref.why_not is None
    assert faults < fresh_each / 3, (faults, fresh_each)
