"""Sizes declared dynamic stay dynamic through ops whose torch shape rule fixes them
(capture.decomps): nn.LSTM / nn.GRU (torch's default decomposition loops over the time steps in
Python: OM401 "specialized it to be a constant (11)"; now torch's while_loop rule, the op stays
one aten.lstm/gru and becomes one ONNX LSTM/GRU) and affine_grid (linspace with a float
endpoint (w - 1) / w)."""

from __future__ import annotations

import onnx
import pytest
import torch

import onnxmedic
from onnxmedic.capture.decomps import SYMBOLIC_DECOMPOSITIONS, symbolic_shape_rules
from onnxmedic.verify.input_sets import next_prime


class BiRNN(torch.nn.Module):
    def __init__(self, cell: type[torch.nn.Module]):
        super().__init__()
        self.rnn = cell(16, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(48, 5)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("cell", [torch.nn.LSTM,  # GRU with -m slow: the same rule (20-minute budget)
                                  pytest.param(torch.nn.GRU, marks=pytest.mark.slow)])
def test_rnn_time_dim_declared_dynamic_stays_dynamic(tmp_path, cell):
    torch.manual_seed(0)
    model = BiRNN(cell).eval()
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(model, (x,), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "batch", 1: "time"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert not {"OM401", "OM406", "OM407"} & {f.code for f in r.findings}
    m = onnx.load(tmp_path / "m.onnx")
    dims = m.graph.input[0].type.tensor_type.shape.dim
    assert dims[1].dim_param == "time", dims
    assert cell.__name__ in {n.op_type for n in m.graph.node}  # one ONNX LSTM/GRU, no unrolling
    # the export's own verification ran other sequence lengths, 1 included
    sets = {c.input_set for c in r.verification}
    assert {"time=1", "time=13"} <= sets, sets
    assert all(c.ok for c in r.verification)


def test_symbolic_shape_rules_restore_torch():
    """The patch is scoped: torch's decomposition table and kernels are as they were after."""
    from torch._decomp import decomposition_table

    ops = (torch.ops.aten.lstm.input, torch.ops.aten.gru.input, *SYMBOLIC_DECOMPOSITIONS)
    before = [(decomposition_table.get(op), dict(op.py_kernels)) for op in ops]
    with symbolic_shape_rules():
        assert all(decomposition_table.get(op) is not b[0] for op, b in zip(ops, before))
    assert [(decomposition_table.get(op), dict(op.py_kernels)) for op in ops] == before


class AffineWarp(torch.nn.Module):
    """A spatial transformer's warp: theta from the input (per sample), the grid sized by
    ``list(x.shape)`` (nn/stn_grid_sample)."""

    def __init__(self, align_corners: bool, dims: int = 2):
        super().__init__()
        self.align_corners = align_corners
        eye = torch.eye(dims, dims + 1)
        eye[0, 1], eye[1, 0] = 0.1, -0.1
        self.register_buffer("theta0", eye)

    def forward(self, x):
        theta = self.theta0 * (1 + x.flatten(1).mean(1)).view(-1, 1, 1)
        grid = torch.nn.functional.affine_grid(theta, list(x.shape),
                                               align_corners=self.align_corners)
        return torch.nn.functional.grid_sample(x, grid, align_corners=self.align_corners)


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("dims", [2, 3])
def test_affine_grid_sized_by_the_input_stays_dynamic(tmp_path, align_corners, dims):
    """torch's affine_grid decomposition calls linspace with a float endpoint (w - 1) / w,
    which torch.export can only specialise (OM401 'specialized it to be a constant (28)')."""
    model = AffineWarp(align_corners, dims).eval()
    shape = (2, 3, 12, 10) if dims == 2 else (2, 3, 6, 8, 10)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    spec = {0: "batch", 2: "height", 3: "width"} if dims == 2 else \
        {0: "batch", 2: "depth", 3: "height", 4: "width"}
    r = onnxmedic.export(model, (x,), tmp_path / "m.onnx", dynamic_shapes=(spec,))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert not {"OM401", "OM406", "OM407"} & {f.code for f in r.findings}
    dims_out = onnx.load(tmp_path / "m.onnx").graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims_out[2:]] == list(spec.values())[1:]
    sets = {c.input_set for c in r.verification}
    assert {"height=1", "width=1", f"height={next_prime(shape[-2])}",
            f"width={next_prime(shape[-1])}"} <= sets
    assert all(c.ok for c in r.verification)


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("size", [[2, 3, 1, 1], [2, 3, 1, 7], [1, 3, 5, 4], [2, 1, 3, 4, 5],
                                  [1, 1, 1, 2, 1]])
def test_symbolic_affine_grid_rule_matches_torch(align_corners, size):
    """The replacement rule computes torch's grid (within float32 rounding), sizes 1 included."""
    from onnxmedic.capture.decomps import affine_grid_generator

    k = len(size) - 2
    theta = torch.randn(size[0], k, k + 1, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.affine_grid(theta, size, align_corners=align_corners)
    got = affine_grid_generator(theta, size, align_corners)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _scan(x):
    out = []
    for t in range(x.shape[1]):  # a Python loop over the sequence: fixes its length
        out.append(x[:, t].cumsum(-1))
    return torch.stack(out, 1)


class Scan(torch.nn.Module):
    def forward(self, x):
        return _scan(x) * 2


class SizeBranch(torch.nn.Module):
    def forward(self, x):
        if x.shape[2] == 5:  # a branch on a size: both capture modes fix it
            return x * 2
        return x


@pytest.mark.parametrize("model, line", [(Scan(), "for t in range(x.shape[1])"),
                                         (SizeBranch(), "if x.shape[2] == 5:")])
def test_om401_names_the_line_that_fixes_a_declared_dim(model, line):
    """A model that genuinely specialises a declared dim: OM401 names the line that did it (the
    innermost frame outside torch, a library's line when a library does it), the size, and
    that the file would only work at that size; the suggestion offers the static export."""
    x = torch.randn(2, 6, 5)
    r = onnxmedic.export(model, (x,), dynamic_shapes=({0: "batch", 1: "seq", 2: "w"},))
    (f,) = [f for f in r.findings if f.code == "OM401"]
    assert f.location is not None and f.location.code.startswith(line), f.location
    assert f.location.file == __file__
    dim, size = ("x[1]", 6) if isinstance(model, Scan) else ("x[2]", 5)
    assert f"{dim} is fixed to {size} by {__file__}:{f.location.line}" in f.message, f.message
    assert f"only work at {dim} = {size}" in f.message
    assert "static" in f.suggestion
    assert f.details["fixed_by"][0]["dim"] == dim


class SpectralMix(torch.nn.Module):
    """neuralop's spectral convolution contracts with a three-operand einsum."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 6, 5))
        self.s = torch.nn.Parameter(torch.randn(5))

    def forward(self, x):
        return torch.einsum("bix,iox,x->box", x, self.w, self.s)


def test_einsum_keeps_the_batch_dynamic(tmp_path):
    """torch.einsum with opt_einsum installed asked it for a contraction path, which turns
    every size into a Python int (neuralop/fno: 'x[0] is fixed to 2 by
    opt_einsum/contract.py:317')."""
    x = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    before = torch.backends.opt_einsum.enabled  # True only where opt_einsum is installed
    r = onnxmedic.export(SpectralMix().eval(), (x,), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "batch"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert {"batch=1", "batch=3"} <= {c.input_set for c in r.verification}
    assert torch.backends.opt_einsum.enabled == before  # restored


class LocNetWarp(torch.nn.Module):
    """nn/stn_grid_sample's spatial transformer with a trained-looking localisation head (the
    zoo's is zero-initialised, so there only the pooled size matters, not its values)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.loc = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(128, 6))
        with torch.no_grad():
            self.loc[-1].weight.mul_(0.1)
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0.1, 0.0, -0.1, 1.0, 0.0]))

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3)
        grid = torch.nn.functional.affine_grid(theta, list(x.shape), align_corners=False)
        return torch.nn.functional.grid_sample(x, grid, align_corners=False)


def _export_dynamic_hw(model, x, path):
    return onnxmedic.export(model, (x,), path,
                            dynamic_shapes=({0: "batch", 2: "height", 3: "width"},))


def _onnx_vs_torch(path, model, shapes):
    """The shapes at which the ONNX file and PyTorch differ by more than the float32 tolerance
    of the op tests (shape -> the comparison's reason)."""
    from onnxmedic.ops.testing import run_onnx
    from onnxmedic.verify.compare import compare_outputs

    m = onnx.load(path)
    bad = {}
    for shape in shapes:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            want = model(x).numpy()
        try:
            got = run_onnx(m, (x,))
        except Exception as e:  # noqa: BLE001 - a failing size is a result
            bad[shape] = f"{type(e).__name__}: {e}"[:200]
            continue
        (c,) = compare_outputs(["out"], [want], got)
        if not c.ok:
            bad[shape] = f"{c.reason}; max abs {c.max_abs:.3g}"
    return bad


def test_stn_adaptive_pool_stays_dynamic(tmp_path):
    """torch's _adaptive_avg_pool2d decomposition takes avg_pool2d with a kernel computed at
    the example size when the size divides the output (16 -> kernel 2): the file had a fixed
    window and failed at height = 56 (OM402 in nn/stn_grid_sample)."""
    model = LocNetWarp().eval()
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    r = _export_dynamic_hw(model, x, tmp_path / "m.onnx")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert not {"OM401", "OM402", "OM406", "OM407", "OM502"} & {f.code for f in r.findings}
    sets = {c.input_set for c in r.verification}
    assert {"height=1", "width=1", "height=17", "width=17"} <= sets, sets
    assert all(c.ok for c in r.verification)
    # primes, and sizes below the output size (1 -> 4 windows of the one pixel), judged by
    # onnxmedic's own verification (float64 reference)
    for shape in [(1, 1, 1, 1), (2, 1, 31, 37), (1, 1, 97, 7), (1, 1, 3, 5)]:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        v = onnxmedic.verify(tmp_path / "m.onnx", model, (x,))
        assert v.ok, (shape, [f.one_paragraph() for f in v.findings])


class AdaptiveMean(torch.nn.Module):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x):
        if x.dim() == 3:
            return torch.nn.functional.adaptive_avg_pool1d(x, self.out)
        return torch.nn.functional.adaptive_avg_pool2d(x, self.out)


_OUTS = [(4, 4), (3, 5), (7, 1), (1, 2), (16, 9)]
_SIZES = [(1, 1), (2, 3), (4, 4), (8, 8), (12, 20), (13, 29), (31, 7), (5, 97), (56, 56)]


@pytest.mark.parametrize("out", _OUTS)
def test_symbolic_adaptive_avg_pool2d_matches_torch_at_every_size(tmp_path, out):
    """One file exported at 12 x 20, run at sizes below, above, dividing and not dividing the
    output size: PyTorch's windows [floor(i H / out), ceil((i + 1) H / out)) everywhere."""
    x = torch.randn(2, 3, 12, 20, generator=torch.Generator().manual_seed(0))
    r = _export_dynamic_hw(AdaptiveMean(out).eval(), x, tmp_path / "m.onnx")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert not _onnx_vs_torch(tmp_path / "m.onnx", AdaptiveMean(out),
                              [(2, 3, h, w) for h, w in _SIZES])


def test_symbolic_adaptive_avg_pool1d_matches_torch_at_every_size(tmp_path):
    """adaptive_avg_pool1d is the 2-d op on an unsqueezed input: the same rule."""
    x = torch.randn(2, 3, 13, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(AdaptiveMean(5).eval(), (x,), tmp_path / "m.onnx",
                         dynamic_shapes=({2: "n"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert not _onnx_vs_torch(tmp_path / "m.onnx", AdaptiveMean(5),
                              [(2, 3, n) for n in (1, 4, 5, 13, 15, 26, 97, 1000)])


def test_without_the_rule_the_adaptive_pool_window_is_fixed(tmp_path, monkeypatch):
    """torch's own decomposition (the rule removed): the file computes 3 x 3 windows at every
    size, wrong or failing at any size but the example's."""
    monkeypatch.delitem(SYMBOLIC_DECOMPOSITIONS, torch.ops.aten._adaptive_avg_pool2d.default)
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(AdaptiveMean((4, 4)).eval(), (x,), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "batch", 2: "height", 3: "width"},),
                         keep_unverified=True)
    assert not r.ok
    bad = _onnx_vs_torch(tmp_path / "m.onnx", AdaptiveMean((4, 4)),
                         [(2, 3, 12, 12), (2, 3, 24, 24), (2, 3, 13, 12)])
    assert set(bad) == {(2, 3, 24, 24), (2, 3, 13, 12)}, bad


class SizedByLen(torch.nn.Module):
    """normflows' log_prob: ``torch.zeros(len(x))``; Python's len() must return an int."""

    def forward(self, x):
        return torch.zeros(len(x), dtype=x.dtype) + x.sum(1)


def test_len_of_a_tensor_keeps_the_batch_dynamic_in_a_non_strict_capture():
    import builtins

    from onnxmedic.capture.strategies import TorchExportNonStrict, capture, symbolic_len

    before = builtins.len
    res = capture(SizedByLen(), (torch.randn(6, 4),), {}, ({0: torch.export.Dim.DYNAMIC},),
                  strategies=[TorchExportNonStrict])
    assert res[-1].ok, res[-1].error
    assert builtins.len is before
    with symbolic_len():  # plain objects, 0-d tensors and static sizes are left to the builtin
        assert len([1, 2]) == 2 and len(torch.ones(3, 2)) == 3
        with pytest.raises(TypeError):
            len(torch.tensor(1.0))
    assert builtins.len is before


class PickedByLen(torch.nn.Module):
    """Rows a mask picks (a data-dependent count) sized by len() - torchvision's
    MultiScaleRoIAlign: ``len(rois)`` - and the outputs flattened from a dict in sorted order,
    which TorchDynamo cannot sort (so only non-strict capture is left)."""

    def forward(self, x):
        rows = x[x[:, 0] > 0]
        d = {"rows": rows, "out": torch.zeros(len(rows), 2) + rows[:, :1]}
        return tuple(v for _, v in sorted(d.items()))


def test_len_of_a_data_dependent_size_stays_symbolic_without_dynamic_shapes():
    from onnxmedic.capture.strategies import TorchExportNonStrict, capture

    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    res = capture(PickedByLen(), (x,), {}, None, strategies=[TorchExportNonStrict])
    assert res[-1].ok, res[-1].error
    out = res[-1].program.module()(x)
    want = PickedByLen()(x)
    assert all(torch.equal(a, b) for a, b in zip(out, want))


def test_a_strict_capture_after_the_len_stand_in_still_traces_len():
    """TorchDynamo lists the builtins once, lazily: listed while ``symbolic_len`` had its
    stand-in in ``builtins``, the real ``len`` was missing for the rest of the process and every
    later strict capture failed ("Attempted to call function marked as skipped"), so the
    refinement after a failed non-strict capture read that instead of torch.export's fixes.
    A fresh process: in this one TorchDynamo may have listed them already."""
    import subprocess
    import sys

    code = """if True:
        import torch
        from onnxmedic.capture.strategies import TorchExportNonStrict, TorchExportStrict
        class M(torch.nn.Module):
            def forward(self, x):
                return torch.zeros(len(x)) + x.sum(1)
        dims = ({0: torch.export.Dim.DYNAMIC},)
        for s in (TorchExportNonStrict, TorchExportStrict):
            r = s()(M(), (torch.randn(6, 4),), {}, dims)
            assert r.ok, (s.name, str(r.error)[:300])
        print("both captured")
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "both captured" in p.stdout, p.stderr[-2000:]


@pytest.mark.parametrize("spec", [({0: "batch", 1: "seq"},), {"x": {0: "batch", 1: "seq"}}],
                         ids=["by position", "by name"])
def test_a_dim_python_code_fixes_is_refused_not_made_static(spec):
    """torch.export says "specialized it to be a constant" both for a dim a weight fixes and for
    one a Python loop fixes. Only the first is made static (OM406): PyTorch itself runs the loop
    at another length, so a static file would silently drop what was declared - OM401 with the
    line (by name, such dims used to be made static)."""
    r = onnxmedic.export(Scan(), (torch.randn(2, 6, 5),), dynamic_shapes=spec)
    codes = {f.code for f in r.findings}
    assert not r.ok and "OM401" in codes and "OM406" not in codes, codes


class MaskedScan(torch.nn.Module):
    def forward(self, x, mask):
        out = []
        for t in range(x.shape[1]):  # a Python loop over the sequence, the mask's too
            out.append(x[:, t] * mask[:, t, None])
        return torch.stack(out, 1)


def test_the_eager_probe_resizes_the_inputs_that_share_the_dim():
    """x and mask both declare (batch, seq): PyTorch runs another length only when both take
    it. Resizing x alone made eager fail and the refinement fixed every dim of both inputs to
    the example's with a mere warning (x-transformers' decoder: the sweep's size check then
    found the written file rejecting every other batch and length)."""
    x, mask = torch.randn(2, 6, 3), torch.ones(2, 6)
    spec = ({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"})
    r = onnxmedic.export(MaskedScan(), (x, mask), dynamic_shapes=spec)
    codes = {f.code for f in r.findings}
    assert not r.ok and "OM401" in codes and "OM406" not in codes, codes
