"""export() hands the user's model and torch's global state back as it found them (issue 15)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import onnxmedic
from onnxmedic import borrow
from tests import models
from tests._state import snapshot_state, state_differences
from tests.sweep_zoo import tiny


class BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).mean((2, 3)))


def _cases() -> dict[str, tuple[nn.Module, tuple]]:
    torch.manual_seed(0)
    x = models.make_inputs()
    cases = {name: (cls(), x) for name, cls in (
        ("conv_log1p", models.ConvLog1p), ("pool_view", models.PoolView),
        ("two_linear", models.TwoLinear), ("data_dependent_if", models.DataDependentIf),
        ("raises", models.Raises), ("multi_output", models.MultiOutput),
        ("named_script", models.NamedScript), ("custom_norm", models.CustomNorm))}
    for name, factory in tiny.GOOD.items():
        case = factory()
        model, args = (case.model, case.args) if hasattr(case, "model") else case
        cases[f"tiny.{name}"] = (model, args)
    return cases


@pytest.mark.parametrize("name", sorted(_cases()))
@pytest.mark.parametrize("training", [False, True])
def test_export_leaves_model_and_torch_state_unchanged(name: str, training: bool) -> None:
    model, args = _cases()[name]
    model.train(training)
    before = snapshot_state(model)
    given = borrow.copy_inputs(args)  # the caller's inputs come back bit-equal too (issue 41)
    onnxmedic.export(model, args)
    assert state_differences(before, snapshot_state(model)) == []
    assert borrow.same_inputs(given, args)


def test_mixed_modes_come_back_mixed() -> None:
    """A frozen batch-norm backbone (eval) under a root in train must stay in eval: the old
    model.train(True) after export put it back in training mode."""
    model = BnNet()
    model.train(True)
    model.backbone.eval()
    before = snapshot_state(model)
    result = onnxmedic.export(model, (torch.randn(2, 3, 8, 8),))
    assert any(f.code == "OM011" for f in result.findings)
    assert state_differences(before, snapshot_state(model)) == []
    assert not model.backbone[1].training and model.head[0].training


def test_eval_batchnorm_model_runs_at_batch_1_after_dynamic_export() -> None:
    """The issue's report: after a dynamic-batch export, an eval-mode batch-norm model run at
    batch 1 behaved as if in training mode. Outputs must be bit-identical before and after."""
    torch.manual_seed(0)
    model = BnNet().eval()
    x1 = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        expected = model(x1)
    before = snapshot_state(model)
    onnxmedic.export(model, (torch.randn(2, 3, 8, 8),), dynamic_shapes=({0: "batch"},))
    assert state_differences(before, snapshot_state(model)) == []
    with torch.no_grad():
        assert torch.equal(model(x1), expected)


def test_snapshot_sees_injected_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison catches what it claims to: a clobbered mode, a patched function, a changed
    buffer and a global flag."""
    model = BnNet()
    model.backbone.eval()
    before = snapshot_state(model)
    model.train(True)
    monkeypatch.setattr(torch.nn.functional, "relu", lambda x: x)
    model.backbone[1].running_mean.add_(1)
    torch.set_grad_enabled(False)
    try:
        diffs = state_differences(before, snapshot_state(model))
    finally:
        torch.set_grad_enabled(True)
    assert any(d.startswith("modes") for d in diffs)
    assert any(d.startswith("functional") and "relu" in d for d in diffs)
    assert any("running_mean: value changed" in d for d in diffs)
    assert any(d.startswith("grad") for d in diffs)


class _CachingRotary(nn.Module):
    """Keeps a frequency table in a buffer, filled up to the longest length seen (like
    rotary-embedding-torch's cached_freqs), and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(64, 4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        pos = torch.arange(n, dtype=torch.float32)[:, None] * torch.ones(4)
        self.cache[:n] = torch.sin(pos)
        self.calls += 1
        return self.proj(x) + self.cache[:n]


def test_buffers_the_model_writes_are_put_back(tmp_path) -> None:
    model = _CachingRotary().eval()
    before = snapshot_state(model)
    res = onnxmedic.export(model, (torch.randn(2, 6, 4),), tmp_path / "m.onnx",
                           dynamic_shapes=({0: "batch", 1: "seq"},))
    assert res.ok, [(f.code, f.message) for f in res.findings]
    assert state_differences(before, snapshot_state(model)) == []
    om012 = next(f for f in res.findings if f.code == "OM012")
    assert set(om012.details["buffers"]) == {"cache", "calls"}


class _InitOnFirstCall(nn.Module):
    """Initialises a parameter from the data on its first call (gpytorch's variational
    strategy does this): a plain call would write it too."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(3))
        self.register_buffer("done", torch.zeros((), dtype=torch.bool), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.done:
            with torch.no_grad():
                self.scale.fill_(2.0)
            self.done.fill_(True)
        return x * self.scale


def test_parameters_the_model_writes_are_named() -> None:
    model = _InitOnFirstCall().eval()
    res = onnxmedic.export(model, (torch.randn(2, 3),))
    om012 = next(f for f in res.findings if f.code == "OM012")
    assert om012.details["parameters"] == ["scale"]
    assert torch.equal(model.scale.detach(), torch.full((3,), 2.0))  # as a plain call leaves it
    assert not model.done  # the buffer is put back


def test_a_model_left_holding_a_fake_tensor_is_a_clear_finding() -> None:
    """A model object that cached a traced value during an earlier torch.onnx.export (zuko's
    lazily built flows do) returns FakeTensors: OM100 says so, not an internal error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with FakeTensorMode():
                self.cache = torch.ones(3)  # what a trace left behind

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.cache

    res = onnxmedic.export(Cached().eval(), (torch.randn(3),))
    assert not res.ok and res.exit_code == 1
    (f,) = [f for f in res.findings if f.severity.value == "error"]
    assert f.code == "OM100" and "FakeTensor" in f.message


class _PermuteThroughData(nn.Module):
    """Writes its weight through ``.data`` on the first call (no version bump, same tensor):
    a permutation, which keeps the values' sum and 2-norm - only the bytes show it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        self.register_buffer("done", torch.zeros((), dtype=torch.bool), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.done:
            self.w.data.copy_(self.w.data.flip(0))
            self.done.fill_(True)
        return x * self.w


def test_a_write_through_data_that_keeps_sum_and_norm_is_named() -> None:
    from onnxmedic import borrow

    model = _PermuteThroughData().eval()
    state = borrow.record_state(model)
    version, ptr = model.w._version, model.w.data_ptr()
    with torch.no_grad():
        model(torch.ones(4))
    assert (model.w._version, model.w.data_ptr()) == (version, ptr)  # only the values show it
    assert borrow.params_written(state) == ["w"]
    assert borrow.written_since(state).params == ["w"]
    assert borrow.written_since(state, params=False).params == []
    res = onnxmedic.export(_PermuteThroughData().eval(), (torch.ones(4),))
    om012 = next(f for f in res.findings if f.code == "OM012")
    assert om012.details["parameters"] == ["w"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fingerprint_sees_one_changed_element(dtype: torch.dtype) -> None:
    from onnxmedic.borrow import tensor_fingerprint

    p = nn.Parameter(torch.randn(3, 5).to(dtype))
    before = tensor_fingerprint(p)
    assert before is not None and before == tensor_fingerprint(p)
    p.data[1, 2] = -p.data[1, 2] + 1
    assert tensor_fingerprint(p) != before
    scalar = nn.Parameter(torch.tensor(1.5, dtype=dtype))  # 0-d and non-contiguous ones too
    assert tensor_fingerprint(scalar) is not None
    t = nn.Parameter(torch.randn(4, 6).to(dtype).t())
    before = tensor_fingerprint(t)
    t.data[0, 1] += 1
    assert tensor_fingerprint(t) != before


def test_fingerprint_of_a_tensor_numpy_cannot_see_falls_back_to_sum_and_norm() -> None:
    from onnxmedic.borrow import tensor_fingerprint

    x = torch.tensor([1.0, -2.0, 3.0])
    fp = tensor_fingerprint(torch._neg_view(x))  # a negative view: no numpy() of its bytes
    assert fp is not None and fp[0] == "sum-norm" and fp[1] == -2.0
    assert tensor_fingerprint(x)[0] == "crc32"


def test_a_model_that_writes_nothing_has_its_parameters_fingerprinted_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Export fingerprints the parameters when it records the model's state and when it puts
    it back; the check after the example run skips them when no state was written."""
    from onnxmedic import borrow

    calls = []
    real = borrow.tensor_fingerprint
    monkeypatch.setattr(borrow, "tensor_fingerprint", lambda p: calls.append(1) or real(p))
    model = models.TwoLinear().eval()
    n = len(list(model.parameters()))
    res = onnxmedic.export(model, models.make_inputs())
    assert res.ok and len(calls) == 2 * n
