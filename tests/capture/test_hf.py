"""Capture fixes found by the zoo: pytree registration of unknown output types (Hugging Face
Cache objects) and the contiguous-view rewrite for decomposition crashes."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import onnxmedic
from onnxmedic.capture import hf
from onnxmedic.fixes import rewrites


class KVState:
    """A cache-like object: tensors in attributes and in a list, plus plain Python values."""

    def __init__(self, keys: list[torch.Tensor], scale: torch.Tensor, step: int) -> None:
        self.keys = keys
        self.scale = scale
        self.step = step
        self.tag = "kv"


class ReturnsState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, KVState]:
        y = self.lin(x)
        return y.relu(), KVState([y * 2, y.sum(-1)], x.mean(0), step=3)


def test_unknown_output_type_is_registered_and_verified():
    assert not hf.is_registered(KVState)
    torch.manual_seed(0)
    res = onnxmedic.export(ReturnsState(), (torch.randn(3, 4),),
                           dynamic_shapes=({0: "batch"},))
    assert res.ok, [f.one_paragraph() for f in res.findings]
    codes = [f.code for f in res.findings]
    assert "OM120" in codes and "OM110" in codes
    om120 = next(f for f in res.findings if f.code == "OM120")
    assert f"{__name__}.KVState" in om120.message and "generic" in om120.message
    assert [a["strategy"] for a in res.attempts] == [
        "torch.export(strict=False)", "pytree registration + torch.export(strict=False)"]
    # the ONNX model has every tensor of the output: y.relu(), keys[0], keys[1], scale
    assert len(res.onnx_model.graph.output) == 4
    assert {c.input_set for c in res.verification} >= {"example", "batch=1", "batch=5"}


def test_generic_flatten_round_trips():
    if not hf.is_registered(KVState):
        hf.register(KVState)
    s = KVState([torch.ones(2), torch.zeros(3)], torch.tensor(5.0), step=7)
    leaves, spec = pytree.tree_flatten(s)
    assert len(leaves) == 3 and all(isinstance(t, torch.Tensor) for t in leaves)
    back = pytree.tree_unflatten([t + 1 for t in leaves], spec)
    assert isinstance(back, KVState) and back.step == 7 and back.tag == "kv"
    assert torch.equal(back.keys[1], torch.ones(3)) and float(back.scale) == 6.0


def test_unknown_type_names_from_torch_export_errors():
    msg = ("Found <class 'transformers.cache_utils.EncoderDecoderCache'> in output, which is "
           "not a known type. If this type holds tensors, you need to register a pytree")
    assert hf.unknown_type_names(RuntimeError(msg)) == [
        "transformers.cache_utils.EncoderDecoderCache"]
    assert hf.unknown_type_names(RuntimeError("shape mismatch")) == []


def test_types_already_known_are_left_alone():
    done, problems = hf.register_unknown_types(None, (torch.randn(2), [1, 2]), {"a": None})
    assert done == {} and problems == []


class Heads(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = x.view(b, s, 2, -1).transpose(1, 2) * 2
        return h.transpose(1, 2).reshape(b, s, -1)


def test_contiguous_before_views_keeps_the_values():
    x = torch.randn(2, 5, 8)
    dims = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
    ep = torch.export.export(Heads(), (x,), dynamic_shapes=(dims,), strict=False)
    views = [n for n in ep.graph.nodes if n.target in (torch.ops.aten.view.default,
                                                       torch.ops.aten.reshape.default)]
    n = rewrites.contiguous_before_views(ep)
    assert n == len(views) - 1  # the view of the input placeholder needs no clone
    clones = [n for n in ep.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == n
    assert all(c.kwargs["memory_format"] == torch.contiguous_format for c in clones)
    y = torch.randn(3, 7, 8)
    torch.testing.assert_close(ep.module()(y), Heads()(y))


def test_view_crash_check_says_why_not():
    crash = ValueError("Cannot view a tensor with shape torch.Size([s1, s2, 2, 16]) and strides "
                       "(32*s2, 16, 16*s2, 1) as a tensor with shape (s1, s2, 32)!")
    wrapped = RuntimeError("decomposition failed")
    wrapped.__cause__ = crash
    assert rewrites.check_view_crash(wrapped) is None
    assert "not a view" in rewrites.check_view_crash(RuntimeError("no kernel"))
    assert rewrites.check_view_crash(None) == "there is no error"


class OneMinus(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1.0 - x) * 3


def test_rsub_as_add_keeps_the_values():
    ep = torch.export.export(OneMinus(), (torch.randn(2, 3),), strict=False)
    assert any(n.target is torch.ops.aten.rsub.Scalar for n in ep.graph.nodes)
    assert rewrites.rsub_as_add(ep) == 1
    assert not any(n.target is torch.ops.aten.rsub.Scalar for n in ep.graph.nodes)
    x = torch.randn(2, 3)
    torch.testing.assert_close(ep.module()(x), OneMinus()(x))


def test_rsub_crash_check():
    msg = ("Cannot find a compatible OpOverload for aten.sub with the provided arguments.\n"
           "While executing %sub_8 : [num_users=1] = call_function[target=torch.ops.aten.sub."
           "Tensor](args = (1.0, %convert_element_type_default), kwargs = {})")
    assert rewrites.check_rsub_crash(RuntimeError(msg)) is None
    assert "rsub" in rewrites.check_rsub_crash(RuntimeError("Cannot view a tensor with shape"))


class Shortcut(torch.nn.Module):
    """RegNet's/ResNet's pattern: a strided stage plus a strided shortcut. At the example both
    are 1x1, and adding two sizes that are both 1 is where torch.export specialises them."""

    def __init__(self) -> None:
        super().__init__()
        self.main = torch.nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1)
        self.short = torch.nn.Conv2d(3, 4, kernel_size=1, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x) + self.short(x)


def test_size_one_at_the_example_is_not_baked_in(monkeypatch):
    import contextlib

    from onnxmedic.capture import strategies

    x = torch.randn(2, 3, 2, 2)  # both branches are 1x1 here, 2x2 at 4 px
    dyn = ({0: "batch", 2: "height", 3: "width"},)
    res = onnxmedic.export(Shortcut().eval(), (x,), dynamic_shapes=dyn)
    assert res.ok, [f.one_paragraph() for f in res.findings]
    assert {"height=3", "width=3"} <= {c.input_set for c in res.verification}
    # without backed_size_oblivious the 1x1 is specialised and other sizes fail
    monkeypatch.setattr(strategies, "size_oblivious", lambda d: contextlib.nullcontext())
    res = onnxmedic.export(Shortcut().eval(), (x,), dynamic_shapes=dyn)
    assert not res.ok, [f.code for f in res.findings]


def test_rsub_crash_is_rewritten_during_export():
    """`1.0 - mask` with an integer mask (XLNet): torch's decomposition of rsub builds an
    aten.sub call no overload accepts; plain torch.onnx fails, onnxmedic rewrites it (OM123)."""
    import onnxmedic

    class Masked(torch.nn.Module):
        def forward(self, x, mask):
            return x * (1.0 - mask)

    args = (torch.randn(2, 3), torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(Exception):
        torch.onnx.export(Masked(), args, dynamo=True, verbose=False)
    r = onnxmedic.export(Masked(), args)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f,) = [f for f in r.findings if f.code == "OM123"]
    assert f.details["rewritten"] == 1
