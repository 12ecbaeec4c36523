"""Issue 16: a dynamic dim the exported file only supports at some sizes (a multiple of k, a
minimum) is found from torch.export's guards, checked at sizes the rule allows, recorded in the
file and reported (OM408) - never silently static, never refused when the rule explains every
failure; and refused (OM402) when it does not."""

from __future__ import annotations

import inspect
import json

import onnx
import pytest
import torch
from torch import nn
from torch.export import Dim

import onnxmedic
from onnxmedic.sweep import ZooCase
from onnxmedic.sweep.sizes import size_check
from onnxmedic.verify.size_rules import METADATA_KEY, SizeRule, rules_from_metadata


class _Level(nn.Module):
    """One UNet level: conv down (stride 2), conv-transpose up, crop to the skip, concat."""

    def __init__(self, c: int, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.down = nn.Conv2d(c, c, 3, padding=1, stride=2)
        self.inner = inner
        self.up = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.mix = nn.Conv2d(2 * c, c, 1)

    def forward(self, x):
        y = self.down(x)
        if self.inner is not None:
            y = self.inner(y)
        u = self.up(y)
        if u.shape[-1] != x.shape[-1] or u.shape[-2] != x.shape[-2]:  # CROP
            u = u[..., :x.shape[-2], :x.shape[-1]]
        return self.mix(torch.cat([x, u], 1))


class SkipUNet(nn.Module):
    """A 2-level conv UNet: PyTorch runs it at every size (it crops odd ones); torch.export
    follows the example's branch (no crop), so the file works at multiples of 4 only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Conv2d(1, 4, 3, padding=1)
        self.body = _Level(4, _Level(4))
        self.out = nn.Conv2d(4, 1, 1)

    def forward(self, x):
        return self.out(self.body(self.inp(x)))


class LongOnly(nn.Module):
    """Filters sequences of 8 or more, passes shorter ones through: the file (the long branch)
    is wrong below 8."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(2, 2, 3, padding=1)

    def forward(self, x):
        if x.shape[-1] >= 8:  # LONG
            return self.conv(x)
        return x * 2


class EvenOrNot(nn.Module):
    """Branches on the parity of the width, but both branches compute the same: the file
    works at every size, so no rule is applied."""

    def forward(self, x):
        if x.shape[-1] % 2 == 0:
            return x * 2.0
        return x + x


def _line(fn, marker: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, t in enumerate(src) if marker in t)


SPELLINGS = {
    "strings": ({0: "batch", 2: "height", 3: "width"},),
    "dims": {"x": {0: Dim("batch"), 2: Dim("height"), 3: Dim("width")}},
    "dynamic_axes": {"x": [0, 2, 3]},
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_unet_valid_at_multiples_of_four_is_refined_and_written(spelling, tmp_path):
    path = tmp_path / "m.onnx"
    r = onnxmedic.export(SkipUNet().eval(), (torch.randn(2, 1, 16, 16),), path,
                         dynamic_shapes=SPELLINGS[spelling])
    assert r.ok, [f.one_paragraph() for f in r.findings]
    found = {f.details["dim"]: f for f in r.findings if f.code == "OM408"}
    b, h, w = (("x_dim0", "x_dim2", "x_dim3") if spelling == "dynamic_axes"
               else ("batch", "height", "width"))
    assert set(found) == {h, w}, [f.one_paragraph() for f in r.findings]
    f = found[h]
    assert f.severity.value == "warning" and "a multiple of 4" in f.message
    assert f.location.file.endswith("test_size_rules.py")
    assert f.location.line == _line(_Level.forward, "# CROP")
    # refused before: the file fails at the sizes the rule excludes (1, 17: the first prime
    # above the example)...
    assert f.details["failed_at"] == [1, 17]
    # ...and verified at sizes it allows: 1*4, the example, twice it, 4 * a prime
    assert f.details["verified_at"] == [4, 16, 20, 32]
    sets = {c.input_set for c in r.verification}
    assert {f"{h}=4", f"{h}=20", f"{h}=32", f"{b}=3"} <= sets and f"{h}=17" not in sets
    assert all(c.ok for c in r.verification)
    # the file says so
    proto = onnx.load(path)
    rules = rules_from_metadata(proto)
    assert rules[h] == SizeRule(h, multiple=4, minimum=4) and rules[w].multiple == 4
    meta = json.loads({p.key: p.value for p in proto.metadata_props}[METADATA_KEY])
    assert meta[h]["text"] == "a multiple of 4" and meta[h]["from"].endswith(
        f"test_size_rules.py:{f.location.line}")
    assert not r.errors


def test_size_check_and_verify_honour_the_files_rule(tmp_path):
    """The sweep's fresh-session check and the verify command check only allowed sizes."""
    path = tmp_path / "m.onnx"
    case = ZooCase(SkipUNet().eval(), (torch.randn(2, 1, 16, 16),), {},
                   ({0: "batch", 2: "height", 3: "width"},))
    assert onnxmedic.export(case.model, case.args, path, dynamic_shapes=case.dynamic_shapes).ok
    out = size_check(str(path), case)
    assert out["ok"], out
    assert out["rules"] == {"height": "a multiple of 4", "width": "a multiple of 4"}
    assert {k for k in out["sizes"] if k.startswith("height")} == {
        "height=4", "height=16", "height=20", "height=32"}
    assert set(out["sizes"]) >= {"batch=1", "batch=5"}  # other dims as before
    v = onnxmedic.verify(path, case.model, case.args)
    assert v.ok, [f.one_paragraph() for f in v.findings]
    assert any(f.code == "OM409" for f in v.findings)
    assert "height=17" not in {c.input_set for c in v.verification}


def test_minimum_size_is_refined(tmp_path):
    path = tmp_path / "m.onnx"
    r = onnxmedic.export(LongOnly().eval(), (torch.randn(2, 2, 16),), path,
                         dynamic_shapes=({2: "length"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    f = next(f for f in r.findings if f.code == "OM408")
    assert "at least 8" in f.message and f.details["failed_at"] == [1]
    assert f.location.line == _line(LongOnly.forward, "# LONG")
    assert 8 in f.details["verified_at"]
    assert rules_from_metadata(onnx.load(path))["length"] == SizeRule("length", minimum=8)


def test_no_rule_when_the_file_works_at_every_size(tmp_path):
    path = tmp_path / "m.onnx"
    r = onnxmedic.export(EvenOrNot().eval(), (torch.randn(2, 8),), path,
                         dynamic_shapes=({1: "width"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert not [f for f in r.findings if f.code == "OM408"]
    assert {"width=1", "width=11"} <= {c.input_set for c in r.verification}
    assert not rules_from_metadata(onnx.load(path))


class _MeanWidth(nn.Module):
    def forward(self, x):
        if x.shape[-1] % 2:
            x = torch.nn.functional.pad(x, (0, 1))
        return x.mean(-1)


def test_file_wrong_at_allowed_sizes_too_is_refused(registry_snapshot, tmp_path):
    """The guard allows even widths, but a translation baked the example's width in: the file
    is wrong at allowed sizes too, so no rule explains it - OM402, nothing written, and the
    message gives the sizes that passed and failed."""
    from onnxscript import opset18 as op

    from onnxmedic.ops import translation

    @translation(torch.ops.aten.mean.dim)
    def aten_mean_dim(self, dim, keepdim=False, dtype=None):
        axes = op.Constant(value_ints=list(dim))
        return op.Div(op.ReduceSum(self, axes, keepdims=1 if keepdim else 0),
                      op.Constant(value_float=8.0))

    r = onnxmedic.export(_MeanWidth().eval(), (torch.randn(2, 8),), tmp_path / "m.onnx",
                         dynamic_shapes=({1: "width"},))
    assert not r.ok and not (tmp_path / "m.onnx").exists()
    assert not [f for f in r.findings if f.code == "OM408"]
    e = next(f for f in r.errors if f.code == "OM402")
    assert "passes at 8; fails at" in e.message and "a multiple of 2" in e.message
