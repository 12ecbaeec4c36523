"""Dynamic shapes as users write them: strings, torch.export Dims (plain and bounded) and
dynamic_axes give the same export; a dim declared dynamic never comes out silently static."""

from __future__ import annotations

import inspect

import onnx
import onnxruntime as ort
import pytest
import torch
from torch.export import Dim

import onnxmedic


class MaskedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x, mask):
        return self.mha(x, x, x, key_padding_mask=mask)[0]


def _inputs(b=2, s=5):
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[:, -1] = True
    return torch.randn(b, s, 16, generator=g), mask


B, S = Dim("batch"), Dim("seq")
SPELLINGS = {
    "strings": {"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}},
    "Dim objects": {"x": {0: B, 1: S}, "mask": {0: B, 1: S}},
    "bounded Dims": {"x": {0: Dim("batch", min=1, max=64), 1: S},
                     "mask": {0: Dim("batch", min=1, max=64), 1: S}},
    "dynamic_axes": {"x": [0, 1], "mask": [0, 1]},
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_spelling_exports_masked_attention_dynamic(tmp_path, spelling):
    """Dim("batch") used to end in OM401 'Constraints violated (batch)!' where the string
    spelling exported: the model guards batch != 1, which torch.export may refine for DYNAMIC
    dims but not for a user's Dim."""
    model = MaskedAttention().eval()
    r = onnxmedic.export(model, _inputs(), tmp_path / "m.onnx",
                         dynamic_shapes=SPELLINGS[spelling])
    assert r.ok, [f.one_paragraph() for f in r.findings]
    m = onnx.load(tmp_path / "m.onnx")
    for inp in m.graph.input:
        dims = inp.type.tensor_type.shape.dim
        assert not dims[0].HasField("dim_value") and not dims[1].HasField("dim_value")
    # the written file runs at other sizes, independently of onnxmedic's own verification
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for b, s in [(1, 5), (4, 10), (3, 7)]:
        x, mask = _inputs(b, s)
        got = sess.run(None, {"x": x.numpy(), "mask": mask.numpy()})[0]
        with torch.no_grad():
            want = model(x, mask).numpy()
        assert got.shape == want.shape and abs(got - want).max() < 1e-4


class FixesBatch(torch.nn.Module):
    def forward(self, x):
        return x + torch.ones(2, 3)  # broadcasting a fixed (2, 3): batch must be 2


@pytest.mark.parametrize("spec", [{"x": {0: "batch"}}, ({0: "batch"},), [{0: Dim("batch")}]],
                         ids=["by name", "by position", "Dim by position"])
def test_a_declared_dim_the_model_fixes_is_never_static_silently(tmp_path, spec):
    """The model needs batch == 2: torch.export's suggested fix makes the dim static, which
    OM406 says (naming it); a dim that came out static without that is refused (OM407).
    Dims given by position (a tuple or list, as torch.export also takes them) are refined like
    dims given by name (they ended in OM401)."""
    r = onnxmedic.export(FixesBatch(), (torch.randn(2, 3),), tmp_path / "m.onnx",
                         dynamic_shapes=spec)
    codes = [f.code for f in r.findings]
    assert r.ok and "OM406" in codes and "OM407" not in codes, codes
    m = onnx.load(tmp_path / "m.onnx")
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2
    (f,) = [f for f in r.findings if f.code == "OM406"]
    assert "static" in f.message
    # with the line that fixes it, from torch.export's constraint message
    src, start = inspect.getsourcelines(FixesBatch.forward)
    line = start + next(i for i, t in enumerate(src) if "torch.ones(2, 3)" in t)
    assert f.location is not None and f.location.line == line
    assert f"x[0] = 2 (the model fixes it, at {__file__}:{line})" in f.message


class MaskedSum(torch.nn.Module):
    def forward(self, x, mask):
        return (x * mask[..., None]).sum(1)


@pytest.mark.parametrize("dim", [str, Dim], ids=["strings", "Dim objects"])
def test_an_undeclared_mask_follows_its_declared_dims(tmp_path, dim):
    """Only x declared dynamic; the mask, multiplied with it, must have the same batch and
    length. The refinement used to fix x's dims to the example's (OM406 'the model fixes it'):
    a file that rejects every other size. The mask's dims of those sizes follow x's instead."""
    x, mask = torch.randn(2, 6, 4), torch.ones(2, 6)
    r = onnxmedic.export(MaskedSum(), (x, mask), tmp_path / "m.onnx",
                         dynamic_shapes={"x": {0: dim("batch"), 1: dim("seq")}, "mask": None})
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f,) = [f for f in r.findings if f.code == "OM406"]
    assert "mask[0] follows x[0]" in f.message and "mask[1] follows x[1]" in f.message
    assert "model fixes it" not in f.message
    src, start = inspect.getsourcelines(MaskedSum.forward)
    line = start + next(i for i, t in enumerate(src) if "mask[..., None]" in t)
    assert f.location is not None and f.location.line == line  # where they must be equal
    assert f"test_dynamic.py:{line}" in f.message
    m = onnx.load(tmp_path / "m.onnx")
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in m.graph.input}
    assert dims == {"x": ["batch", "seq", 4], "mask": ["batch", "seq"]}
    assert {"batch=1", "batch=3", "seq=1", "seq=7"} <= {c.input_set for c in r.verification}
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for b, n in [(1, 1), (3, 7), (5, 13)]:
        x, mask = torch.randn(b, n, 4), (torch.rand(b, n) > 0.5).float()
        got = sess.run(None, {"x": x.numpy(), "mask": mask.numpy()})[0]
        assert abs(got - MaskedSum()(x, mask).numpy()).max() < 1e-5


def test_static_declared_dims_names_input_dim_and_size():
    from onnxmedic.stages.capture import static_declared_dims

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, "seq"])
    g = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                               [onnx.helper.make_tensor_value_info("y", 1, [2, "seq"])])
    m = onnx.helper.make_model(g)
    (f,) = static_declared_dims({"x": {0: "batch", 1: "seq"}}, m)
    assert f.code == "OM407" and "'x' dim 0" in f.message and "fixed to 2" in f.message
    assert static_declared_dims({"x": {1: Dim("seq")}}, m) == []
    assert static_declared_dims(({0: "batch"},), m)[0].details == {"input": "x", "dim": 0,
                                                                   "fixed_to": 2}


def test_om401_says_which_constraint_was_violated():
    """A derived dim (2 * h) keeps torch.export's strict Dims; the model fixes it to 2, and
    OM401 quotes the constraint, not only 'Constraints violated (2*h)!'."""
    r = onnxmedic.export(FixesBatch(), (torch.randn(2, 3),),
                         dynamic_shapes={"x": {0: 2 * Dim("h")}})
    (f,) = [f for f in r.errors if f.code == "OM401"]
    assert "specialized it to be a constant (2)" in f.message
    assert f.message.count("specialized it to be a constant (2)") == 1
