"""PyTorch's outputs on the verification input sets, computed in a forked child while the
model translates (verify/ahead.py): the parent no longer runs those sets itself, the verdict
is the same, and a fault at another size is still caught."""

from __future__ import annotations

import sys

import pytest
import torch

import onnxmedic
from onnxmedic.inputs import Inputs
from onnxmedic.verify import ahead
from onnxmedic.verify.stage import expected_outputs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="sets are computed ahead on Linux only")

CALLS: list[tuple[int, torch.dtype]] = []  # this process's real calls: (batch, dtype)


class _Centre(torch.nn.Module):
    """A batch-centring block (its mean over the dynamic batch is what the fault breaks) that
    records each real call in this process."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if type(x) is torch.Tensor:  # not a capture's fake tensor
            CALLS.append((x.shape[0], x.dtype))
        h = self.lin(x).relu()
        return (h - h.mean(0, keepdim=True)).tanh()


def _export(**kw):
    CALLS.clear()
    return onnxmedic.export(_Centre().eval(), (torch.randn(2, 4),),
                            dynamic_shapes={"x": {0: "batch"}}, **kw)


def _float32_sizes() -> set[int]:
    return {b for b, dt in CALLS if dt == torch.float32}


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv(ahead.ENV, "1")


def test_the_parent_no_longer_runs_the_verification_sets(on, monkeypatch):
    r = _export()
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert {"example", "random#1", "batch=1", "batch=3"} <= {c.input_set
                                                              for c in r.verification}
    assert _float32_sizes() == {2}  # the example only (preflight): the child ran 1 and 3
    monkeypatch.setenv(ahead.ENV, "0")  # the control: without it, this process runs them
    r = _export()
    assert r.ok and {1, 3} <= _float32_sizes()


def test_a_fault_at_another_size_is_caught_with_sets_computed_ahead(on, registry_snapshot):
    """The mean over the batch translated as a sum divided by the example's batch: right at 2,
    wrong at 1 and 3, whose PyTorch outputs came from the child."""
    from onnxscript import opset18 as op

    from onnxmedic.ops import translation

    @translation(torch.ops.aten.mean.dim)
    def aten_mean_dim(self, dim, keepdim=False, dtype=None):
        axes = op.Constant(value_ints=list(dim))
        return op.Div(op.ReduceSum(self, axes, keepdims=1 if keepdim else 0),
                      op.Constant(value_float=2.0))

    r = _export(localize=False)
    assert not r.ok and r.stages["compare"] == "failed"
    assert all(c.ok for c in r.verification if c.input_set in ("example", "random#1"))
    assert {f.details["input_set"] for f in r.errors if f.code == "OM402"} == {"batch=1",
                                                                              "batch=3"}
    assert 1 not in _float32_sizes() and 3 not in _float32_sizes()


def test_unplanned_and_failed_sets_are_left_to_the_parent(on):
    model = _Centre().eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), dynamic_shapes={"x": {0: torch.export.Dim("b")}})
    (dims,) = ahead.program_dims(program)
    assert isinstance(dims[0], str) and dims[1] == 4  # the batch a symbol, the features not

    def run(s: Inputs):
        if s.args[0].shape[0] == 1:
            raise ValueError("no batch of one")
        return expected_outputs(model, [s])[0]

    a = ahead.start(model, Inputs((x,), {}), program, run, timeout=60,
                    reference=lambda seconds: ("float64 reference", seconds > 0))
    assert a is not None
    try:
        planned = a.sets
        a.join()  # the child done: every planned set is its (no race with this process)
        assert [s.args[0].shape[0] for s in planned] == [2, 1, 3]
        got = a.take([Inputs((torch.randn(5, 4),), {})] + planned)
        assert got[0] is None  # not planned
        assert got[2] is None  # the child failed there: the parent computes it (and says why)
        for s, g in zip([planned[0], planned[2]], [got[1], got[3]]):
            assert g is not None
            torch.testing.assert_close(torch.from_numpy(g[0][0]),
                                       torch.from_numpy(expected_outputs(model, [s])[0][0]))
        # the example's float64 reference, run after the sets, given one set's seconds
        assert a.take_reference() == ("float64 reference", True)
        assert a.take_reference() is None  # taken once
        assert a.take([planned[0]]) == [None]  # each set once, too
    finally:
        a.close()


def test_a_reference_still_running_is_not_waited_for(on):
    """On one thread a float64 run can take far longer than the parent's own: the parent
    stops the child and runs it itself."""
    import time

    model = _Centre().eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), dynamic_shapes={"x": {0: torch.export.Dim("b")}})
    a = ahead.start(model, Inputs((x,), {}), program, lambda s: expected_outputs(model, [s])[0],
                    timeout=60, reference=lambda seconds: time.sleep(60))
    assert a is not None
    try:
        deadline = time.monotonic() + 30
        while not (a.folder / f"{len(a.sets)}.claim").exists():  # the child is at it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        assert a.take_reference() is None and time.monotonic() - t0 < 5
        assert a.pid == 0  # stopped
    finally:
        a.close()
