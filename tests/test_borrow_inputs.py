"""The example inputs are borrowed like the model (issue 41): every run of the model during
export, verify and optimize gets its own copy, the caller's tensors, lists and dicts come back
bit-equal, the references are computed on pristine copies, and a model that writes its inputs
is named (OM013)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import onnxmedic
from onnxmedic import borrow
from onnxmedic.context import ExportContext, ExportOptions
from onnxmedic.result import ExportResult
from onnxmedic.stages.preflight import export_preflight
from onnxmedic.stages.verify import expected_outputs
from onnxmedic.verify.input_sets import derived_input_sets
from onnxmedic.verify.reference import reference_outputs


class IndexAdd(nn.Module):
    """The issue's model: index_add_ into the input, with repeated indices."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        x.index_add_(0, idx, src)
        return x * 2


# every way PyTorch lets forward() write what it is given; each takes (x, xs, d) - a tensor, a
# list of two tensors and a dict of two tensors - and returns a tensor
def _add_(x, xs, d):
    return x.add_(1.5) * 2


def _index_add_(x, xs, d):
    return x.index_add_(0, torch.tensor([0, 1, 1]), torch.ones(3, x.shape[1])) * 2


def _setitem(x, xs, d):
    x[0] = 7.0
    return x + 1


def _copy_(x, xs, d):
    x.copy_(xs[0])
    return x * 3


def _mul_view(x, xs, d):
    x[:, :1].mul_(4.0)
    return x - 1


def _out_op(x, xs, d):
    torch.add(xs[0], xs[1], out=x)
    return x * 2


def _list_element_written(x, xs, d):
    xs[1].sub_(2.0)
    return xs[1] + x


def _list_element_replaced(x, xs, d):
    xs[0] = xs[0] * 5
    xs.append(x)
    return xs[0] + xs[1]


def _dict_written(x, xs, d):
    d["a"].clamp_(max=0.1)
    d["b"] = d["b"] + 1
    return d["a"] + d["b"]


def _resize(x, xs, d):
    y = xs[0].clone()
    xs[0].resize_(1)
    return y + x


def _data_written(x, xs, d):
    x.data[0, 0] = 3.0  # no version bump: seen by value
    return x * 1


def _pure(x, xs, d):
    return x * 2 + xs[0] - d["a"]


WRITES = {f.__name__.lstrip("_"): f for f in (
    _add_, _index_add_, _setitem, _copy_, _mul_view, _out_op, _list_element_written,
    _list_element_replaced, _dict_written, _resize, _data_written, _pure)}


# the input path each write is named by (D: the dict, by position or keyword)
WRITTEN = {"add_": "args[0]", "index_add_": "args[0]", "setitem": "args[0]", "copy_": "args[0]",
           "mul_view": "args[0]", "out_op": "args[0]", "list_element_written": "args[1][1]",
           "list_element_replaced": "args[1]", "dict_written": "D['a']", "resize": "args[1][0]",
           "data_written": "args[0]", "pure": ""}


class Writer(nn.Module):
    def __init__(self, fns: list[Any]) -> None:
        super().__init__()
        self.fns = fns

    def forward(self, x: torch.Tensor, xs: list[torch.Tensor],
                d: dict[str, torch.Tensor]) -> torch.Tensor:
        out = x.new_zeros(())
        for fn in self.fns:
            out = out + fn(x, xs, d).sum()
        return out.reshape(1)


def _inputs(seed: int, rows: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, 3, generator=g), [torch.rand(rows, 3, generator=g),
                                               torch.rand(rows, 3, generator=g)],
            {"a": torch.rand(rows, 3, generator=g), "b": torch.rand(rows, 3, generator=g)})


def test_copy_inputs_copies_every_tensor_and_container_and_keeps_aliasing() -> None:
    x = torch.rand(2, 3)
    nested = (x, [x, {"k": (torch.ones(1),)}], {"y": x.t()})
    c = borrow.copy_inputs(nested)
    assert borrow.same_inputs(c, nested)
    assert c[0] is not x and c[1] is not nested[1] and c[1][1] is not nested[1][1]
    assert c[0] is c[1][0]  # one tensor given twice stays one tensor
    c[0].add_(1)
    assert borrow.same_inputs(nested, (x, [x, {"k": (torch.ones(1),)}], {"y": x.t()}))
    assert not borrow.same_inputs(c, nested)


def test_same_inputs_sees_one_bit() -> None:
    """The comparison the tests rely on catches the smallest write: one ulp, -0.0, a NaN."""
    x = torch.zeros(3)
    y = x.clone()
    y[1] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))
    assert not borrow.same_inputs((x,), (y,))
    assert not borrow.same_inputs((x,), (-x,))
    assert borrow.same_inputs([torch.tensor(float("nan"))], [torch.tensor(float("nan"))])
    assert not borrow.same_inputs([x], [x, x]) and not borrow.same_inputs({"a": x}, {"b": x})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(writes=st.lists(st.sampled_from(sorted(WRITES)), min_size=1, max_size=3, unique=True),
       seed=st.integers(0, 2**16), rows=st.integers(3, 5), keyword=st.booleans())
def test_every_run_of_the_model_gets_its_own_inputs(writes: list[str], seed: int,
                                                    rows: int, keyword: bool) -> None:
    """Property: whatever forward() writes, preflight, the expected outputs of the input sets
    and the float64 references leave the caller's inputs bit-equal; every run sees pristine
    inputs (the example's output equals a plain call's on a fresh copy, and the float64
    reference of the example agrees with it); OM013 says exactly when an input is written."""
    model = Writer([WRITES[w] for w in writes]).eval()
    args, kwargs = _inputs(seed, rows), {}
    if keyword:  # the dict (and what is written into it) passed by keyword
        args, kwargs = args[:2], {"d": args[2]}
    given_ = borrow.copy_inputs((args, kwargs))
    with torch.no_grad():
        plain = model(*borrow.copy_inputs(args), **borrow.copy_inputs(kwargs))
    ctx = ExportContext(ExportResult(command="export"), model, args, kwargs, ExportOptions())
    assert export_preflight(ctx)
    assert borrow.same_inputs(given_, (args, kwargs))
    assert torch.equal(torch.from_numpy(ctx.expected[0]), plain)
    om013 = [f for f in ctx.result.findings if f.code == "OM013"]
    assert bool(om013) == (writes != ["pure"])
    named = om013[0].details["inputs"] if om013 else []
    for w in writes:  # each write is named by the input it wrote (or a container above it)
        want = WRITTEN[w].replace("D", "kwargs['d']" if keyword else "args[2]")
        assert w == "pure" or any(want.startswith(n) for n in named), (w, named)
    sets = [ctx.example, *derived_input_sets(ctx.example, 1)]
    expected = expected_outputs(model, sets)
    assert torch.equal(torch.from_numpy(expected[0][0]), plain)
    ref = reference_outputs(model, sets, expected)
    assert borrow.same_inputs(given_, (args, kwargs))
    if ref.outputs:
        assert abs(float(ref.outputs[0][0][0]) - float(plain[0])) <= 1e-4 * abs(float(plain[0]))


@pytest.mark.parametrize("write", ["add_", "setitem", "mul_view", "list_element_written",
                                   "dict_written"])
def test_export_of_a_model_that_writes_its_inputs_leaves_them_unchanged(write: str) -> None:
    model = Writer([WRITES[write]]).eval()
    args = _inputs(0, 4)
    given_ = borrow.copy_inputs(args)
    result = onnxmedic.export(model, args)
    assert borrow.same_inputs(given_, args)
    assert result.ok, [f.message for f in result.findings]
    assert [f.code for f in result.findings].count("OM013") == 1


def test_issue_index_add_model_verifies_and_its_input_comes_back() -> None:
    """The issue's report: x.index_add_ with repeated indices was refused (OM601/OM604, the
    references computed on inputs earlier runs had changed) and the caller's x changed."""
    x, idx, src = torch.ones(4, 3), torch.tensor([0, 1, 1, 1]), torch.ones(4, 3) * 2
    given_ = borrow.copy_inputs((x, idx, src))
    result = onnxmedic.export(IndexAdd(), (x, idx, src))
    assert borrow.same_inputs(given_, (x, idx, src))
    assert result.ok, [(f.code, f.message) for f in result.findings]
    om013 = [f for f in result.findings if f.code == "OM013"]
    assert len(om013) == 1 and "args[0] (x)" in om013[0].message
    assert om013[0].severity.name.lower() == "info"


def test_verify_and_optimize_leave_the_inputs_unchanged(tmp_path) -> None:
    x, idx, src = torch.ones(4, 3), torch.tensor([0, 1, 1, 1]), torch.ones(4, 3) * 2
    given_ = borrow.copy_inputs((x, idx, src))
    path = tmp_path / "m.onnx"
    assert onnxmedic.export(IndexAdd(), (x, idx, src), path).ok
    result = onnxmedic.verify(path, IndexAdd(), (x, idx, src))
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert borrow.same_inputs(given_, (x, idx, src))
    from onnxmedic.optimize import optimize

    optimize(path, IndexAdd(), (x, idx, src), out=tmp_path / "o.onnx", repeats=2, rounds=1)
    assert borrow.same_inputs(given_, (x, idx, src))


class ReturnsIt(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y.mul_(3)
        return x.sum(0), x.add_(1)


def test_om013_says_which_written_input_the_file_returns() -> None:
    """``return x.add_(1)``: the new value of x is output 1 of the file; y's is not returned,
    and the finding says the file cannot hand it back."""
    x, y = torch.ones(2, 3), torch.ones(2)
    given_ = borrow.copy_inputs((x, y))
    result = onnxmedic.export(ReturnsIt(), (x, y))
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert borrow.same_inputs(given_, (x, y))
    f = next(f for f in result.findings if f.code == "OM013")
    assert f.details["returned"] == {"args[0]": 1}
    assert "args[0] (x), returned as output 1" in f.message
    assert "For args[1] (y) it cannot" in f.message
