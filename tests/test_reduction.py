"""`onnxmedic reduce` by fault injection: a chain of nodes with one faulty node (a Loop that
never ends, a swapped op, a node a checker command rejects) shrinks to a few nodes holding it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxmedic
from onnxmedic import cli
from tests.onnx_models import endless_loop_model

SHAPE = [2, 3]


def _chain(n: int, fault_at: int, fault: onnx.NodeProto | None = None,
           extra_inits: list[onnx.TensorProto] | None = None) -> onnx.ModelProto:
    """x -> n elementwise nodes (Relu/Neg/Add x/Mul 0.5, with side branches to x) -> y; the node
    at ``fault_at`` is ``fault`` (reading v{fault_at} and writing v{fault_at+1}) or a node
    named 'poison'."""
    ops = ["Relu", "Neg", "Add", "Mul"]
    nodes = []
    for k in range(n):
        src, dst = f"v{k}", f"v{k + 1}" if k < n - 1 else "y"
        if k == fault_at and fault is not None:
            fault.input[-1] = src
            fault.output[0] = dst
            nodes.append(fault)
            continue
        op = ops[k % 4]
        ins = [src] + (["x"] if op == "Add" else ["half"] if op == "Mul" else [])
        nodes.append(helper.make_node(op, ins, [dst], name="poison" if k == fault_at
                                      else f"n{k}"))
    nodes.insert(0, helper.make_node("Identity", ["x"], ["v0"], name="first"))
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "half")] + (extra_inits or [])
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, SHAPE)], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, SHAPE)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


def _loop_node(tmp_path: Path) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    loop = onnx.load(endless_loop_model(tmp_path / "loop.onnx"))
    node = loop.graph.node[0]
    node.name = "endless"
    return node, list(loop.graph.initializer)


def test_hang_reduces_to_the_endless_loop(tmp_path):
    node, inits = _loop_node(tmp_path)
    onnx.save(_chain(10, 6, node, inits), tmp_path / "hang.onnx")
    res = onnxmedic.reduce(tmp_path / "hang.onnx", tmp_path / "min.onnx", until="hang",
                           timeout=1.5)
    assert res.ok, [f.one_paragraph() for f in res.findings]
    small = onnx.load(tmp_path / "min.onnx")
    assert [n.name for n in small.graph.node] == ["endless"]
    # the cut input is fed with the recorded value of v6 (a function of x, not random)
    feeds = dict(np.load(tmp_path / "min.inputs.npz"))
    assert list(feeds) == ["v6"] and feeds["v6"].shape == tuple(SHAPE)
    assert "OM540" in [f.code for f in res.findings]
    # the standalone repro script shows the hang (exit 1) by itself
    p = subprocess.run([sys.executable, str(tmp_path / "min.repro.py")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and "did not finish" in p.stdout


def _reduce_swapped_mul(tmp_path, n: int) -> tuple[str, dict]:
    """A chain of ``n`` nodes whose node 8 (v8 = v7 * 0.5) became v8 = v7 + 0.5, reduced by
    the CLI (--until mismatch) against the good chain's values: (its name, those values)."""
    good = _chain(n, -1)
    bad = onnx.ModelProto()
    bad.CopyFrom(good)
    target = bad.graph.node[8]
    assert target.op_type == "Mul"
    target.op_type = "Add"
    onnx.save(bad, tmp_path / "bad.onnx")
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    from onnx.reference import ReferenceEvaluator

    values = ReferenceEvaluator(good).run(None, {"x": x}, intermediate=True)
    np.savez(tmp_path / "ref.npz", **{k: v for k, v in values.items()
                                      if isinstance(v, np.ndarray) and v.dtype != object})
    np.savez(tmp_path / "x.npz", x=x)
    rc = cli.main(["reduce", str(tmp_path / "bad.onnx"), "-o", str(tmp_path / "min.onnx"),
                   "--until", "mismatch", "--input", str(tmp_path / "x.npz"),
                   "--reference", str(tmp_path / "ref.npz")])
    assert rc == 0
    return target.name, values


def test_mismatch_reduces_to_the_swapped_node(tmp_path):
    name, values = _reduce_swapped_mul(tmp_path, 12)
    small = onnx.load(tmp_path / "min.onnx")
    assert [n.name for n in small.graph.node] == [name]
    feeds = dict(np.load(tmp_path / "min.inputs.npz"))
    np.testing.assert_allclose(feeds["v7"], values["v7"])  # recorded, not random
    # the same model against onnx's own reference: nothing to reduce (OM541)
    res = onnxmedic.reduce(tmp_path / "bad.onnx", tmp_path / "none.onnx", until="mismatch")
    assert not res.ok and [f.code for f in res.errors] == ["OM541"]
    assert not (tmp_path / "none.onnx").exists()


def test_mismatch_candidates_share_one_kept_sandbox_child(tmp_path, monkeypatch):
    """Every candidate of a mismatch reduction runs in one kept child (sandbox.reuse); the
    model and the runs are the ones a child per run finds."""
    import contextlib

    from onnxmedic import sandbox

    servers = []
    real = sandbox.reuse

    @contextlib.contextmanager
    def spy(*a, **k):
        with real(*a, **k) as server:
            servers.append(server)
            yield server

    monkeypatch.setattr(sandbox, "reuse", spy)
    name, _ = _reduce_swapped_mul(tmp_path, 40)
    assert [n.name for n in onnx.load(tmp_path / "min.onnx").graph.node] == [name]
    (server,) = servers
    assert server.stats["children"] == 1 and server.stats["runs"] >= 8


def test_command_criterion_keeps_the_marked_node(tmp_path):
    onnx.save(_chain(16, 9), tmp_path / "m.onnx")
    checker = tmp_path / "check.py"
    checker.write_text(textwrap.dedent("""
        import sys, onnx
        m = onnx.load(sys.argv[1])
        sys.exit(1 if any(n.name == "poison" for n in m.graph.node) else 0)
    """))
    res = onnxmedic.reduce(tmp_path / "m.onnx", tmp_path / "min.onnx",
                           until=f"{sys.executable} {checker} {{model}}", timeout=30)
    assert res.ok, [f.one_paragraph() for f in res.findings]
    small = onnx.load(tmp_path / "min.onnx")
    assert [n.name for n in small.graph.node] == ["poison"]
    onnx.checker.check_model(small)


def test_budget_exhausted_still_writes_a_failing_model(tmp_path):
    onnx.save(_chain(16, 9), tmp_path / "m.onnx")
    checker = tmp_path / "check.py"
    checker.write_text("import sys, onnx\nm = onnx.load(sys.argv[1])\n"
                       "sys.exit(1 if any(n.name == 'poison' for n in m.graph.node) else 0)\n")
    res = onnxmedic.reduce(tmp_path / "m.onnx", tmp_path / "min.onnx",
                           until=f"{sys.executable} {checker} {{model}}", max_runs=3)
    assert res.ok
    assert "OM542" in [f.code for f in res.findings]
    small = onnx.load(tmp_path / "min.onnx")
    assert "poison" in [n.name for n in small.graph.node]


def test_model_that_does_not_crash_is_not_reduced(tmp_path):
    onnx.save(_chain(4, -1), tmp_path / "ok.onnx")
    res = onnxmedic.reduce(tmp_path / "ok.onnx", tmp_path / "min.onnx", until="crash")
    assert not res.ok and res.exit_code == 1
    assert [f.code for f in res.errors] == ["OM541"]


@pytest.mark.parametrize("until", ["segfault", "python check.py"])
def test_bad_criterion_is_a_usage_error(tmp_path, until):
    onnx.save(_chain(4, -1), tmp_path / "ok.onnx")
    res = onnxmedic.reduce(tmp_path / "ok.onnx", tmp_path / "min.onnx", until=until)
    assert res.exit_code == 2 and [f.code for f in res.errors] == ["OM543"]
    assert cli.main(["reduce", str(tmp_path / "ok.onnx"), "-o", str(tmp_path / "m.onnx"),
                     "--until", until]) == 2
