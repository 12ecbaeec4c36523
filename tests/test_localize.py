"""Divergence localisation by seeded fault injection: export a small model, corrupt one ONNX
node, and check that localisation names exactly that node's FX node."""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import onnxmedic
from onnxmedic.verify import localize as loc_mod
from tests.onnx_models import identity_model


class Stack(nn.Module):
    """Linear/tanh/LayerNorm blocks with residual adds: many op kinds, all mapped by name."""

    def __init__(self, depth: int = 4, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.layers, self.norms):
            x = norm(torch.tanh(lin(x)) * 0.5 + x)
        return x


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def exported():
    res = onnxmedic.export(Stack(), (X,))
    assert res.ok, [f.one_paragraph() for f in res.findings]
    decomposed = loc_mod.decomposed_program(res.program)
    return res.onnx_model, decomposed


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    return m


def _swap_op(proto, seed):
    """Add <-> Sub (or Tanh -> Sigmoid) on one node picked by the seed; returns its output."""
    rng = random.Random(seed)
    swaps = {"Add": "Sub", "Sub": "Add", "Tanh": "Sigmoid", "Mul": "Add"}
    nodes = [n for n in proto.graph.node if n.op_type in swaps]
    node = rng.choice(nodes)
    node.op_type = swaps[node.op_type]
    return node.output[0]


def _perturb_weight(proto, seed):
    """Add 0.5 to one element of one Linear weight; returns the output of its Gemm/MatMul."""
    rng = random.Random(seed)
    inits = [i for i in proto.graph.initializer if i.name.endswith(".weight")
             and i.name.startswith("layers.")]
    init = rng.choice(inits)
    a = numpy_helper.to_array(init).copy()
    a.flat[rng.randrange(a.size)] += 0.5
    init.CopyFrom(numpy_helper.from_array(a, init.name))
    return next(n.output[0] for n in proto.graph.node if init.name in n.input), init.name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swapped_op_is_named(exported, seed):
    proto, program = exported
    bad = _copy(proto)
    target = _swap_op(bad, seed)
    loc = loc_mod.localize(bad, program, (X,), feeds={"x": X.numpy()}, decomposed=True)
    assert loc.first is not None
    assert loc.first.fx_node == target
    assert loc.first.input_score <= 1.0  # born there, not inherited
    assert loc.compared == loc.fx_nodes  # every FX node matched an ONNX value
    f = next(f for f in loc.findings if f.code == "OM610")
    assert target in f.message and f.location is not None and f.location.file
    assert f.location.file.endswith("test_localize.py")
    # the table: the corrupted node grows the error most
    assert loc.top[0].fx_node == target


def test_perturbed_weight_names_its_consumer(exported):
    proto, program = exported
    bad = _copy(proto)
    target, weight = _perturb_weight(bad, seed=3)
    loc = loc_mod.localize(bad, program, (X,), feeds={"x": X.numpy()}, decomposed=True)
    assert loc.first is not None and loc.first.fx_node == target
    assert [b["name"] for b in loc.bad_initializers] == [weight]
    f = next(f for f in loc.findings if f.code == "OM610")
    assert weight in f.suggestion
    assert f.location is not None and f.location.module_path.startswith("layers.")


def test_chunks_bound_the_exposed_values_and_stop_early(exported):
    proto, program = exported
    bad = _copy(proto)
    target = _swap_op(bad, seed=0)
    full = loc_mod.localize(bad, program, (X,), feeds={"x": X.numpy()}, decomposed=True)
    # 3x8 float32 values are 96 bytes: 200 bytes per chunk is two values per sandbox run
    small = loc_mod.localize(bad, program, (X,), feeds={"x": X.numpy()}, decomposed=True,
                             chunk_bytes=200, full=False)
    assert full.chunks == 1
    n_values = full.compared
    assert small.first is not None and small.first.fx_node == target
    assert 1 < small.chunks < (n_values + 1) // 2  # stopped at the divergent chunk
    assert small.compared < n_values


def test_verify_localize_end_to_end(tmp_path):
    model = Stack(depth=2)
    res = onnxmedic.export(model, (X,), tmp_path / "m.onnx")
    assert res.ok
    proto = onnx.load(tmp_path / "m.onnx")
    target = _swap_op(proto, seed=5)
    onnx.save(proto, tmp_path / "bad.onnx")
    out = onnxmedic.verify(tmp_path / "bad.onnx", model, (X,), localize=True,
                           report=tmp_path / "r.json")
    assert not out.ok and out.exit_code == 1
    codes = [f.code for f in out.findings]
    assert "OM601" in codes and "OM610" in codes
    assert out.localization.first.fx_node == target
    import json

    data = json.loads((tmp_path / "r.json").read_text())
    assert data["localization"]["first"]["fx_node"] == target
    assert data["localization"]["top"][0]["fx_node"] == target
    from onnxmedic.report.files import render_html

    assert 'id="localization"' in render_html(out)


def test_clean_model_localises_nothing(exported):
    proto, program = exported
    loc = loc_mod.localize(proto, program, (X,), feeds={"x": X.numpy()}, decomposed=True)
    assert loc.first is None and loc.compared == loc.fx_nodes > 0
    assert [f.code for f in loc.findings] == ["OM612"]


def test_foreign_onnx_file_is_unmapped(tmp_path):
    class Identity(nn.Module):
        def forward(self, x):
            return x + 0

    path = identity_model(tmp_path / "id.onnx")
    program = torch.export.export(Identity(), (torch.ones(2, 3),))
    loc = loc_mod.localize(onnx.load(path), program, (torch.ones(2, 3),),
                           feeds={"x": np.ones((2, 3), np.float32)})
    assert loc.first is None and loc.compared == 0
    assert [f.code for f in loc.findings] == ["OM611"]


def test_export_localises_a_wrong_translation(registry_snapshot):
    """A deliberately wrong translation (tanh as Sigmoid): export finds the mismatch and
    localisation names the tanh node, without being asked."""
    from onnxscript import opset18 as op

    from onnxmedic.ops import translation

    @translation(torch.ops.aten.tanh.default)
    def aten_tanh_default(self):
        return op.Sigmoid(self)

    res = onnxmedic.export(Stack(depth=2), (X,))
    assert not res.ok
    f = next(f for f in res.findings if f.code == "OM610")
    assert res.localization.first.aten_op.startswith("aten::tanh")
    assert res.localization.first.onnx_op == "Sigmoid"
    assert f.op.startswith("aten::tanh")


def test_score_is_relative_to_tolerance():
    e = np.array([1.0, 2.0, np.nan, np.inf], np.float32)
    assert loc_mod.score(e, e.copy(), 1e-4, 1e-5) == 0.0
    a = e.copy()
    a[1] += 2e-4 + 1e-5  # exactly at the tolerance of 2.0
    assert loc_mod.score(e, a, 1e-4, 1e-5) == pytest.approx(1.0, rel=1e-3)
    a[2] = 0.0
    assert loc_mod.score(e, a, 1e-4, 1e-5) == float("inf")
    assert loc_mod.score(np.array([1, 2]), np.array([1, 5]), 0, 0) > 1


def test_localisation_failure_never_changes_the_verdict(tmp_path, monkeypatch):
    model = Stack(depth=1)
    res = onnxmedic.export(model, (X,), tmp_path / "m.onnx")
    assert res.ok

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(loc_mod, "localize", broken)
    out = onnxmedic.verify(tmp_path / "m.onnx", model, (X,), localize=True)
    assert out.ok and out.exit_code == 0
    f = next(f for f in out.findings if f.code == "OM611")
    assert "boom" in f.message and f.severity.value == "warning"
