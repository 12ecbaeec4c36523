"""Divergence localisation by seeded fault injection: export a small model, corrupt one ONNX
node, and check that localisation names exactly that node's FX node."""

from __future__ import annotations

import math
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


# --- localisation without capture: the program rebuilt from the ONNX file's metadata ---


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * 0.5 + x  # INNER_LINE


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.inner(x)) - x * 0.25  # BLOCK_LINE


class Nested(nn.Module):
    """Blocks of sub-modules, ops at every level: Nested > Block > Inner > Linear."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _line_of(marker: str) -> int:
    from pathlib import Path

    lines = Path(__file__).read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if ln.rstrip().endswith(f"# {marker}"))


@pytest.fixture(scope="module")
def nested_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("nested") / "m.onnx"
    res = onnxmedic.export(Nested(), (X,), path)
    assert res.ok, [f.one_paragraph() for f in res.findings]
    return onnx.load(path)


def _no_capture(monkeypatch):
    """Fail the test if localisation captures the model with torch.export."""
    from onnxmedic.stages import verify as verify_stage

    def captured(*a, **k):
        raise AssertionError("localisation captured the model")

    monkeypatch.setattr(verify_stage, "program_for", captured)


@pytest.mark.parametrize("op,index,module_path,marker", [
    ("Add", 1, "blocks.1.inner", "INNER_LINE"),  # inside Inner, two levels down
    ("Tanh", 2, "blocks.2.inner", "INNER_LINE"),
    ("Sub", 0, "blocks.0", "BLOCK_LINE"),  # in Block's own forward
])
def test_nested_module_fault_named_without_capture(nested_file, tmp_path, monkeypatch, op,
                                                   index, module_path, marker):
    bad = _copy(nested_file)
    node = [n for n in bad.graph.node if n.op_type == op][index]
    node.op_type = {"Add": "Sub", "Sub": "Add", "Tanh": "Sigmoid"}[op]
    target = node.output[0]
    onnx.save(bad, tmp_path / "bad.onnx")
    _no_capture(monkeypatch)
    out = onnxmedic.verify(tmp_path / "bad.onnx", Nested(), (X,), localize=True)
    assert not out.ok
    loc = out.localization
    assert loc.program == "onnx metadata"
    assert loc.first is not None and loc.first.fx_node == target
    assert loc.first.input_score <= 1.0
    assert loc.compared == loc.fx_nodes > 0
    f = next(f for f in out.findings if f.code == "OM610")
    assert f.location.module_path == module_path
    assert f.location.file.endswith("test_localize.py")
    assert f.location.line == _line_of(marker)
    assert loc.top[0].fx_node == target


def test_replay_and_capture_agree(nested_file):
    """The rebuilt program and the captured one give the same localisation."""
    from onnxmedic.verify.replay import replay_program

    bad = _copy(nested_file)
    target = _swap_op(bad, seed=7)
    model = Nested()
    ref = [model(X).detach().numpy()]
    rebuilt = loc_mod.localize(bad, replay_program(bad, model, {"x": X.numpy()}), (X,),
                               feeds={"x": X.numpy()}, reference=ref)
    captured = loc_mod.localize(bad, torch.export.export(model, (X,)), (X,),
                                feeds={"x": X.numpy()})
    assert rebuilt.first.fx_node == captured.first.fx_node == target
    assert rebuilt.compared == captured.compared
    assert [e.fx_node for e in rebuilt.top] == [e.fx_node for e in captured.top]
    assert [e.score for e in rebuilt.top] == pytest.approx([e.score for e in captured.top])
    assert rebuilt.first.location.line == captured.first.location.line


def test_file_without_metadata_falls_back_to_capture(nested_file, tmp_path):
    bad = _copy(nested_file)
    target = _swap_op(bad, seed=1)
    for n in bad.graph.node:
        del n.metadata_props[:]
    onnx.save(bad, tmp_path / "bad.onnx")
    out = onnxmedic.verify(tmp_path / "bad.onnx", Nested(), (X,), localize=True)
    assert out.localization.program == "torch.export"
    assert out.localization.first.fx_node == target


def test_metadata_of_another_program_falls_back_to_capture(nested_file, tmp_path):
    """The file's metadata says mul by 0.125 where the model multiplies by 0.25 (a file
    exported from another version of the model): the rebuilt program does not compute the
    model's outputs, so localisation captures instead of blaming a node of that program."""
    bad = _copy(nested_file)
    target = _swap_op(bad, seed=2)
    edited = 0
    for n in bad.graph.node:
        for p in n.metadata_props:
            if p.key == "pkg.torch.onnx.fx_node" and "(%x, 0.25)" in p.value:
                p.value = p.value.replace("(%x, 0.25)", "(%x, 0.125)")
                edited += 1
    assert edited
    from onnxmedic.verify.replay import NotReplayable, replay_program

    model = Nested()
    with pytest.raises(NotReplayable, match="differs"):
        loc_mod.localize(bad, replay_program(bad, model, {"x": X.numpy()}), (X,),
                         feeds={"x": X.numpy()}, reference=[model(X).detach().numpy()])
    onnx.save(bad, tmp_path / "bad.onnx")
    out = onnxmedic.verify(tmp_path / "bad.onnx", model, (X,), localize=True)
    assert out.localization.program == "torch.export"
    assert out.localization.first.fx_node == target


class Views(nn.Module):
    """Nodes the optimizer removes (clone, a no-op view) or rewrites (split and its
    getitems, topk's getitem): no ONNX node carries them."""

    def forward(self, x):
        a, b = x.split(4, dim=1)
        v, _ = torch.topk(a, 2)
        return v * 2 + b.clone().contiguous().view(3, 4)[:, :2]


def test_removed_nodes_are_recorded_in_the_file(tmp_path, monkeypatch):
    """onnxmedic export records the FX nodes no ONNX node carries any more (model metadata),
    so that localisation rebuilds the whole program without capture; without that record
    the file does not describe the program, and the rebuild is refused."""
    from onnxmedic.verify.replay import RECORD, NotReplayable, replay_program

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    res = onnxmedic.export(Views(), (x,), tmp_path / "v.onnx")
    assert res.ok
    proto = onnx.load(tmp_path / "v.onnx")
    assert any(p.key == RECORD for p in proto.metadata_props)
    bad = _copy(proto)
    mul = next(n for n in bad.graph.node if n.op_type == "Mul")
    mul.op_type = "Add"
    onnx.save(bad, tmp_path / "bad.onnx")
    _no_capture(monkeypatch)
    out = onnxmedic.verify(tmp_path / "bad.onnx", Views(), (x,), localize=True)
    assert out.localization.program == "onnx metadata"
    assert out.localization.first.fx_node == mul.output[0]

    del bad.metadata_props[:]
    with pytest.raises(NotReplayable, match="not in the ONNX file"):
        replay_program(bad, Views(), {"x": x.numpy()})


@pytest.mark.parametrize("name", ["encoder_layer", "conv_bn", "gru"])
def test_replayed_program_computes_the_model(name):
    """Common layers (attention, conv + batch norm, recurrent) rebuild from the exported
    file: the same outputs as the module."""
    from onnxmedic.verify.replay import replay_program

    torch.manual_seed(0)
    model, x = {
        "encoder_layer": (nn.TransformerEncoderLayer(16, 2, 32, batch_first=True,
                                                     dropout=0.0), torch.randn(2, 5, 16)),
        "conv_bn": (nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Flatten(), nn.Linear(72, 4)),
                    torch.randn(2, 3, 8, 8)),
        "gru": (nn.GRU(4, 8, batch_first=True), torch.randn(2, 3, 4)),
    }[name]
    model.eval()
    res = onnxmedic.export(model, (x,))
    assert res.ok
    replayed = replay_program(res.onnx_model, model,
                              {res.onnx_model.graph.input[0].name: x.numpy()})
    got = torch.fx.Interpreter(replayed.graph_module).run(*replayed.flat_inputs)
    with torch.no_grad():
        want = model(x)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)  # eager attention may take a fused kernel


def test_printed_arguments_parse_against_the_schema():
    from onnxmedic.verify import replay

    args = replay.parse_printed("(%x, [2, -1], 1e-05, None, torch.float64)")
    assert args == (replay.Ref("x"), ["2", "-1"], "1e-05", "None", "torch.float64")
    kwargs = replay.parse_printed("{dtype: torch.float16, device: cpu, approximate: tanh}")
    assert kwargs == {"dtype": "torch.float16", "device": "cpu", "approximate": "tanh"}
    assert replay.coerce_printed(args[1], "SymInt[]") == [2, -1]
    assert replay.coerce_printed("inf", "float") == math.inf
    assert replay.coerce_printed("False", "bool") is False
    assert replay.coerce_printed("tanh", "str") == "tanh"
    assert replay.coerce_printed("torch.float16", "ScalarType?") is torch.float16
    assert replay.coerce_printed("cpu", "Device?") == torch.device("cpu")
    assert replay.coerce_printed([replay.Ref("a"), "None"], "Tensor?[]") == [replay.Ref("a"), None]
    a, k = replay.typed_arguments(torch.ops.aten.gelu.default, (replay.Ref("x"),),
                             {"approximate": "tanh"})
    assert a == (replay.Ref("x"),) and k == {"approximate": "tanh"}
    with pytest.raises(replay.NotReplayable):
        replay.coerce_printed("tanh", "float")
    with pytest.raises(replay.NotReplayable):
        replay.typed_arguments(torch.ops.aten.gelu.default, (replay.Ref("x"),), {"bogus": "1"})
    with pytest.raises(replay.NotReplayable):
        replay.parse_printed("[1, 2, ...[total_len=300]]")
    assert replay.replay_target("torch.ops.aten.add.Tensor") is torch.ops.aten.add.Tensor
    with pytest.raises(replay.NotReplayable):  # only ATen ops run from a file's metadata
        replay.replay_target("torch.ops.profiler._record_function_enter.default")


def test_module_path_from_full_name_scopes():
    from onnx import helper

    from onnxmedic._locate import location_from_onnx_node

    n = helper.make_node("Tanh", ["a"], ["b"])
    helper.set_metadata_props(n, {"pkg.torch.onnx.name_scopes":
                                  "['', 'blocks.0', 'blocks.0.inner', 'tanh']"})
    assert location_from_onnx_node(n).module_path == "blocks.0.inner"
    helper.set_metadata_props(n, {"pkg.torch.onnx.name_scopes": "['', 'enc', 'layer', 'x']"})
    assert location_from_onnx_node(n).module_path == "enc.layer"


def test_top_nodes_are_measured_and_ordered(exported):
    proto, program = exported
    bad = _copy(proto)
    _swap_op(bad, seed=0)
    loc = loc_mod.localize(bad, program, (X,), feeds={"x": X.numpy()}, decomposed=True,
                           top_k=3)
    assert len(loc.top) == 3
    keys = [(e.growth if e.exceeds else 0.0, e.score) for e in loc.top]
    assert keys == sorted(keys, reverse=True)
    for e in loc.top + [loc.first]:
        assert not math.isnan(e.max_abs) and e.max_abs > 0
        if e.exceeds:
            assert e.mismatched > 0


def test_replayed_values_are_sized_from_the_inputs():
    """With a dynamic batch, the chunks are sized at the batch the inputs give, not at 1."""
    from onnxmedic.verify.replay import replay_program

    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    res = onnxmedic.export(Stack(depth=1), (x,), dynamic_shapes=({0: "batch"},))
    assert res.ok
    assert res.onnx_model.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    big = torch.randn(40, 8)
    replayed = replay_program(res.onnx_model, Stack(depth=1), {"x": big.numpy()})
    sized = [n.meta["val"] for n in replayed.graph_module.graph.nodes if "val" in n.meta]
    assert sized and all(tuple(v.shape) == (40, 8) for v in sized)


@pytest.mark.own_sandbox_children  # counts the Workers started
def test_localisation_worker_starts_with_verify_and_is_always_closed(tmp_path, monkeypatch):
    """verify(localize=True) starts localisation's sandbox worker before verifying (its ONNX
    Runtime import overlaps the verify run) and closes it whether localisation runs or not."""
    from onnxmedic import sandbox

    started: list[sandbox.Worker] = []

    class Counted(sandbox.Worker):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append(self)

    monkeypatch.setattr(sandbox, "Worker", Counted)
    model = Stack(depth=1)
    assert onnxmedic.export(model, (X,), tmp_path / "m.onnx").ok
    from onnxmedic.stages import verify as verify_stage

    before_verifying = []
    run_and_compare = verify_stage.run_and_compare

    def spy(*a, **k):
        before_verifying.append(len(started))
        return run_and_compare(*a, **k)

    monkeypatch.setattr(verify_stage, "run_and_compare", spy)
    started.clear()
    out = onnxmedic.verify(tmp_path / "m.onnx", model, (X,), localize=True)
    assert out.ok and out.localization is not None
    assert before_verifying == [2]  # the verify run's and localisation's, both started
    assert len(started) == 2  # and no third
    assert all(w.proc is None for w in started)

    started.clear()
    out = onnxmedic.verify(tmp_path / "m.onnx", model, (torch.randn(3, 5),), localize=True)
    assert not out.ok and out.localization is None  # PyTorch rejects the input: no localising
    assert started and all(w.proc is None for w in started)


# --------------------------------------------------- replay: what a hostile file cannot do

def _chain_proto(n: int, last: str | None = None):
    """An ONNX graph whose nodes carry torch.onnx FX metadata: x -> add -> add -> ... (n)."""
    from onnx import TensorProto, helper

    from onnxmedic.verify.replay import FX_NODE

    nodes, prev = [], "x"
    for i in range(n):
        name = f"add_{i}"
        fx = last if (last is not None and i == n - 1) else (
            f"%{name} : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor]"
            f"(args = (%{prev}, %{prev}), kwargs = {{}})")
        node = helper.make_node("Add", [prev, prev], [name], name=f"node_{name}")
        node.metadata_props.add(key=FX_NODE, value=fx)
        nodes.append(node)
        prev = name
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [2])])
    return helper.make_model(g)


def test_replay_of_a_graph_deeper_than_python_recursion():
    import numpy as np

    from onnxmedic.verify.replay import replay_program

    proto = _chain_proto(5000)
    r = replay_program(proto, torch.nn.Module(), {"x": np.ones(2, np.float32)})
    (out,) = torch.fx.Interpreter(r.graph_module).run(*r.flat_inputs)
    assert r.outputs == ["add_4999"] and torch.isinf(out).all()  # 2**5000 overflows float32


def test_replay_refuses_huge_sizes_and_cycles():
    import numpy as np

    from onnxmedic.verify.replay import NotReplayable, replay_program

    huge = ("%add_2 : [num_users=1] = call_function[target=torch.ops.aten.new_zeros.default]"
            "(args = (%add_1, [100000, 100000, 1000]), kwargs = {})")
    with pytest.raises(NotReplayable, match="size of"):
        replay_program(_chain_proto(3, huge), torch.nn.Module(), {"x": np.ones(2, np.float32)})
    cycle = ("%add_2 : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor]"
             "(args = (%add_2, %add_1), kwargs = {})")
    with pytest.raises(NotReplayable, match="cycle"):
        replay_program(_chain_proto(3, cycle), torch.nn.Module(), {"x": np.ones(2, np.float32)})


def test_localisation_reads_external_data(tmp_path, monkeypatch):
    """A model written with external data (the proto held holds references, not weights):
    localisation loads the weights from beside the file for its exposed-value runs."""
    from onnxmedic import onnxfile

    monkeypatch.setattr(onnxfile, "EXTERNAL_DATA_THRESHOLD", 100)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).eval()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    r = onnxmedic.export(model, (x,), tmp_path / "m.onnx")
    assert r.ok and (tmp_path / "m.onnx.data").is_file()
    assert any(t.data_location == onnx.TensorProto.EXTERNAL
               for t in r.onnx_model.graph.initializer)  # no second copy of the weights
    out = onnxmedic.verify(tmp_path / "m.onnx", model, (x,), localize=True)
    codes = [f.code for f in out.findings]
    assert out.ok and out.localization is not None and "OM611" not in codes, codes
    assert out.localization.onnx_nodes > 0


def test_localisation_judges_values_by_the_float64_budget(tmp_path):
    """A weight scaled by 1 +/- 1e-5: the outputs fail the float64 budget, yet no value leaves
    the fixed float32 tolerance (localising by it finds nothing, OM612). Judged by the same
    budget as the outputs - each value against its float64 shadow - the first value out is
    the faulted layer's, born there."""
    torch.manual_seed(0)
    model = Stack(depth=6, width=64).eval()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    res = onnxmedic.export(model, (x,))
    assert res.ok, [f.one_paragraph() for f in res.findings]
    program = loc_mod.decomposed_program(res.program)
    bad = _copy(res.onnx_model)
    init = next(i for i in bad.graph.initializer if i.name == "layers.3.weight")
    w = numpy_helper.to_array(init).astype(np.float64)
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=w.shape)
    init.CopyFrom(numpy_helper.from_array((w * (1 + 1e-5 * signs)).astype(np.float32),
                                          init.name))
    target = next(n.output[0] for n in bad.graph.node if init.name in n.input)
    feeds = {"x": x.numpy()}
    fixed = loc_mod.localize(bad, program, (x,), feeds=feeds, decomposed=True,
                             tolerance=(1e-4, 1e-5))
    assert fixed.first is None and fixed.findings[-1].code == "OM612"
    loc = loc_mod.localize(bad, program, (x,), feeds=feeds, decomposed=True)
    assert loc.first is not None and loc.first.fx_node == target
    assert loc.first.rule == "float64 budget" and loc.first.input_score <= 1.0
    f = next(f for f in loc.findings if f.code == "OM610")
    assert "float64 error budget" in f.message
    # end to end: verify refuses the file by the budget and names the layer
    onnx.save(bad, tmp_path / "bad.onnx")
    v = onnxmedic.verify(tmp_path / "bad.onnx", model, (x,), localize=True)
    assert not v.ok and {"OM601", "OM610"} <= {f.code for f in v.findings}
    assert "layers.3" in next(f for f in v.findings if f.code == "OM610").location.module_path
    # and the clean file: every value within its budget
    clean = loc_mod.localize(res.onnx_model, program, (x,), feeds=feeds, decomposed=True)
    assert clean.first is None and max(clean_scores(clean)) <= 1.0


def clean_scores(loc):
    return [n.score for n in loc.top] or [0.0]


class TiedRouter(nn.Module):
    """An MoE-style router: sigmoid scores of a gate, top-2 experts, a per-expert table. With
    ``zero`` the gate's weights are all zero (as transformers initialises some routers), so
    every score ties and the chosen experts are arbitrary."""

    def __init__(self, zero: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(8, 4, bias=False)
        if zero:
            nn.init.zeros_(self.gate.weight)
        self.table = nn.Parameter(torch.arange(4.0)[:, None] * torch.ones(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, idx = torch.topk(torch.sigmoid(self.gate(x)), k=2, dim=-1)
        return x + self.table[idx].sum(-2)


def test_topk_over_tied_scores_is_blamed_on_the_ties_not_the_translation():
    """A zero router: PyTorch and ONNX Runtime pick different tied experts. Localisation names
    the TopK and says why (OM860), instead of asking to fix its translation."""
    tied = onnxmedic.export(TiedRouter(zero=True), (X.repeat(2, 1),))
    assert not tied.ok
    codes = [f.code for f in tied.errors]
    assert "OM860" in codes, [f.one_paragraph() for f in tied.findings]
    om610 = next(f for f in tied.findings if f.code == "OM610")
    assert "TopK" in om610.message and "OM860" in om610.suggestion


def test_the_same_router_with_untied_scores_verifies():
    """The translation of the router is right: with random gate weights it verifies."""
    trained = onnxmedic.export(TiedRouter(zero=False), (X.repeat(2, 1),))
    assert trained.ok, [f.one_paragraph() for f in trained.findings]
    assert "OM860" not in [f.code for f in trained.findings]


def test_topk_tied_sees_ties_at_the_kth_place_and_within_the_k():
    x = torch.tensor([[0.9, 0.5, 0.5, 0.1], [0.9, 0.8, 0.5, 0.1]])
    assert loc_mod.topk_tied(x, 2)  # row 0: the 2nd place ties with the 3rd
    assert not loc_mod.topk_tied(x[1:], 2)
    assert loc_mod.topk_tied(torch.tensor([[0.5, 0.5, 0.1]]), 1)  # within the best two
    assert not loc_mod.topk_tied(torch.tensor([[0.5, 0.5, 0.1]]), 1, largest=False)
    assert loc_mod.topk_tied(torch.tensor([[0.5, 0.5, 0.1]]), 2, largest=False)
    assert loc_mod.topk_tied(torch.tensor([[0.5, 0.5, 0.1]]).T, 2, dim=0, largest=True)


def _topk_tied_by_sort(x, k, dim=-1, largest=True):
    """topk_tied as it was: the whole row sorted, then the k+1 best compared."""
    best = torch.sort(x, dim=dim, descending=largest).values
    best = best.narrow(dim, 0, min(k + 1, best.shape[dim]))
    if best.shape[dim] < 2:
        return False
    return bool((best.narrow(dim, 1, best.shape[dim] - 1) ==
                 best.narrow(dim, 0, best.shape[dim] - 1)).any())


def test_topk_tied_by_partial_selection_says_what_the_full_sort_said():
    """topk_tied selects the k+1 best (torch.topk) instead of sorting each row: the same
    verdict as the sort on ties, near-ties, NaN, infinities, signed zeros, every k (also k
    past the row's length), both directions, every dim, integer and half dtypes."""
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    seen = set()
    for trial in range(300):
        shape = [int(torch.randint(1, 6, (1,), generator=g)) for _ in range(1 + trial % 3)]
        x = torch.randint(-3, 4, shape, generator=g).to(torch.float32)  # many ties
        if trial % 2:
            x = x + torch.rand(shape, generator=g) * 1e-3  # mostly none
        if trial % 5 == 0:
            flat = x.view(-1)
            pos = torch.randint(0, flat.numel(), (2,), generator=g)
            flat[pos] = specials[torch.randint(0, len(specials), (2,), generator=g)]
        dtype = (torch.float32, torch.float16, torch.bfloat16, torch.int64)[trial % 4]
        x = x.to(dtype) if dtype != torch.int64 or not x.isnan().any() else x
        for dim in range(-x.dim(), x.dim()):
            for k in range(1, x.shape[dim] + 2):
                for largest in (True, False):
                    want = _topk_tied_by_sort(x, k, dim, largest)
                    assert loc_mod.topk_tied(x, k, dim, largest) == want, (x, k, dim, largest)
                    seen.add(want)
    assert seen == {True, False}
    assert not loc_mod.topk_tied(torch.tensor(3.0), 1)  # a 0-d value ties with nothing
