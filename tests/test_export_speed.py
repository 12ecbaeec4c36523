"""_torch_compat.decompositions_sped_up, the work torch.export's run_decompositions repeats for
nothing, left out: its collection of the CompositeImplicitAutograd ops gives the same set with
the dispatcher's list materialised once per collection (not once per ``torch.ops`` namespace)
and sees an op registered between two collections; ``py_impl`` decorators kept per (op, key)
give the same program and kernels; torch's functions are as they were after the block."""

from __future__ import annotations

import pytest
import torch
import torch._export.utils as export_utils
import torch.export.decomp_utils as decomp_utils
import torch.export.exported_program as exported_program

from onnxmedic._torch_compat import cia_ops_materialized_once
from onnxmedic.ops.testing import check_call


def _counted(calls: list[int]):
    original = export_utils._materialize_cpp_cia_ops

    def counting() -> None:
        calls.append(1)
        original()

    return original, counting


def test_same_ops_one_materialisation_per_collection_and_torch_restored(monkeypatch):
    plain = export_utils._collect_all_valid_cia_ops()
    assert len(torch.ops._dir) > 2  # several namespaces: torch materialises once for each
    calls: list[int] = []
    _, counting = _counted(calls)
    monkeypatch.setattr(export_utils, "_materialize_cpp_cia_ops", counting)
    export_utils._collect_all_valid_cia_ops()
    per_namespace = len(calls)
    assert per_namespace == len(torch.ops._dir) - 1  # aten's is cached by torch
    before = (export_utils._collect_all_valid_cia_ops,
              exported_program._collect_all_valid_cia_ops,
              decomp_utils._collect_all_valid_cia_ops)
    calls.clear()
    with cia_ops_materialized_once():
        once = exported_program._collect_all_valid_cia_ops()
        assert decomp_utils._collect_all_valid_cia_ops() == once
        assert len(calls) == 2  # one per collection
        assert export_utils._materialize_cpp_cia_ops is counting  # only inside a collection
    assert once == plain
    assert (export_utils._collect_all_valid_cia_ops,
            exported_program._collect_all_valid_cia_ops,
            decomp_utils._collect_all_valid_cia_ops) == before


def test_an_op_registered_inside_the_block_is_collected_and_exported():
    """A CompositeImplicitAutograd custom op defined between two translations in the block is
    in the next collection (materialised at its start), so torch.export preserves or
    decomposes it as without the block: the translation of a call to it is right."""
    lib = torch.library.Library("om_speed_test", "DEF")  # noqa: TOR901 - a test-only op
    try:
        with cia_ops_materialized_once():
            first = export_utils._collect_all_valid_cia_ops()
            lib.define("twice_plus_one(Tensor x) -> Tensor")
            lib.impl("twice_plus_one", lambda x: x * 2 + 1, "CompositeImplicitAutograd")
            second = export_utils._collect_all_valid_cia_ops()
        op = torch.ops.om_speed_test.twice_plus_one.default
        assert op not in first and op in second
        res = check_call(lambda x: torch.ops.om_speed_test.twice_plus_one(x),
                         (torch.randn(3, 4),))
        assert res.ok, res.error
    finally:
        lib._destroy()


class _Small(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # linear, layer_norm, gelu and addmm-like CIA ops that run_decompositions preserves or
        # decomposes
        h = torch.nn.functional.layer_norm(x, (4,)) @ x.T
        return torch.nn.functional.gelu(h).softmax(-1).unflatten(0, (1, 3))


def test_py_impl_decorators_kept_give_the_same_program_and_kernels():
    from torch._ops import OperatorBase

    from onnxmedic._torch_compat import decompositions_sped_up, py_impl_decorators_kept

    ep = torch.export.export(_Small(), (torch.randn(3, 4),), strict=False)
    op = torch.ops.aten.gelu.default
    kernels = dict(op.py_kernels)
    plain = ep.run_decompositions().graph_module.code
    original = OperatorBase.py_impl
    with decompositions_sped_up():
        assert OperatorBase.py_impl is not original
        fast = ep.run_decompositions().graph_module.code
        again = ep.run_decompositions().graph_module.code  # decorators kept from the first
    assert OperatorBase.py_impl is original
    assert fast == plain and again == plain
    assert dict(op.py_kernels) == kernels  # run_decompositions restored the op's kernels
    key = torch._C.DispatchKey.AutogradCPU
    with py_impl_decorators_kept():
        first = op.py_impl(key)
        assert op.py_impl(key) is first
        assert torch.ops.aten.relu.default.py_impl(key) is not first
    assert op.py_impl(key) is not first  # torch's own again: a new decorator per call


class _Mixed(torch.nn.Module):
    """CompositeImplicitAutograd ops (linear, layer_norm, gelu), ops torchlib has and ops it
    lacks (hypot: decomposed by torch, translated by onnxmedic's registry)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(self.lin(x), (4,))
        return torch.hypot(torch.nn.functional.gelu(h), x).softmax(-1)


def _nodes(proto) -> list[tuple]:
    return [(n.op_type, n.domain, tuple(n.input), tuple(n.output),
             tuple(a.SerializeToString() for a in n.attribute)) for n in proto.graph.node]


def test_kept_decomposition_tables_give_the_same_graph_node_for_node(monkeypatch):
    """torch.onnx's decomposition table and its split, kept per registry
    (onnx_decompositions_kept), and the CompositeImplicitAutograd override written as dict
    updates (cia_overrides_by_dict) give the ONNX graph torch.onnx's own per-call work gives:
    the same nodes, names, attributes and initializers, for onnxmedic's registry and plain
    torchlib in turn, a second export (from the cache) too."""
    import contextlib

    import onnxmedic._torch_compat as compat
    from onnxmedic.ops import REGISTRY
    from onnxmedic.stages.translate import onnx_export

    args = (torch.randn(3, 4),)
    mixed = torch.export.export(_Mixed().eval(), args, strict=False)
    small = torch.export.export(_Small().eval(), args, strict=False)  # torchlib suffices

    def graphs():
        out = []
        for ep, registry in ((mixed, REGISTRY), (small, None), (mixed, REGISTRY)):
            proto = onnx_export(ep, args, None, registry=registry).model_proto
            out.append((_nodes(proto), sorted(
                (i.name, i.SerializeToString()) for i in proto.graph.initializer)))
        return out

    kept = graphs()
    with monkeypatch.context() as m:  # torch.onnx's own table on every call
        m.setattr(compat, "onnx_decompositions_kept", contextlib.nullcontext)
        m.setattr(compat, "cia_overrides_by_dict", contextlib.nullcontext)
        plain = graphs()
    assert kept == plain
    assert kept[0] == kept[2] and len(kept[0][0]) > 5


def test_kept_decompositions_follow_the_registry_and_torchs_tables():
    """Exports with different translation tables in turn each get their own decomposition
    (nothing leaks from one to the next), a decomposition registered in torch's table
    between two exports is used by the next, and the split dicts handed out are fresh."""
    import torch._decomp

    from onnxmedic._torch_compat import (
        decomposition_split,
        decompositions_sped_up,
        prepare_for_export,
    )
    from onnxmedic.ops import REGISTRY
    from onnxmedic.stages.translate import onnx_registry_plain

    ep = torch.export.export(_Mixed().eval(), (torch.randn(3, 4),), strict=False)
    ours, plain = REGISTRY.onnx_registry(None), onnx_registry_plain(18)
    hypot = torch.ops.aten.hypot.default

    def targets(reg):
        return {n.target for n in prepare_for_export(ep, reg).graph.nodes}

    for reg in (ours, plain, ours, plain):
        assert (hypot in targets(reg)) == (reg is ours)
    with decompositions_sped_up():
        a, b = decomposition_split(ours), decomposition_split(ours)
        assert a == b and a[0] is not b[0] and a[1] is not b[1]
    # a decomposition added to torch's table between two translations is used by the next
    @torch.library.custom_op("om_speed_decomp::thrice", mutates_args=())
    def thrice(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    thrice.register_fake(lambda x: torch.empty_like(x))
    op = torch.ops.om_speed_decomp.thrice.default
    prog = torch.export.export(_Thrice().eval(), (torch.randn(2, 3),), strict=False)

    def kept_op() -> bool:
        return op in {n.target for n in prepare_for_export(prog, plain).graph.nodes}

    assert kept_op()
    torch._decomp.decomposition_table[op] = lambda x: x * 3
    try:
        assert not kept_op()
    finally:
        del torch._decomp.decomposition_table[op]
    assert kept_op()


class _Thrice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.om_speed_decomp.thrice(x) + 1


def _kernel_kind(fn):
    """What a registered kernel is, comparable across two registrations of the same thing:
    a closure or partial by its code and bound values, anything else itself."""
    import functools

    if isinstance(fn, functools.partial):
        return ("partial", _kernel_kind(fn.func), tuple(fn.args),
                tuple(sorted((k, _kernel_kind(v)) for k, v in fn.keywords.items())))
    code = getattr(fn, "__code__", None)
    if code is not None:  # torch defines some per call (_get_decomp_for_cia's): by bytecode
        return ("function", code.co_code, code.co_consts, code.co_names, code.co_varnames,
                tuple(_kernel_kind(c.cell_contents) for c in fn.__closure__ or ()))
    return fn


def _state(ops):
    from torch._subclasses.fake_impls import op_implementations_dict

    return {op: ({k: _kernel_kind(v) for k, v in op.py_kernels.items()},
                 _kernel_kind(op_implementations_dict.get(op))) for op in ops}


def test_cia_overrides_by_dict_register_what_torchs_override_registers():
    """cia_overrides_by_dict's override of the CompositeImplicitAutograd kernels leaves every
    op with the kernels torch's _override_composite_implicit_decomp gives it (the same keys,
    the same kernels: closures compared by code and bound values) and the same fake-tensor
    rule, and restores every op as torch restores it; it is used only on the torch it was
    checked against."""
    from torch.export import exported_program

    import onnxmedic._torch_compat as compat
    from onnxmedic.ops import REGISTRY

    original = exported_program._override_composite_implicit_decomp
    with pytest.MonkeyPatch.context() as m:  # another torch's function: left as it is
        m.setattr(compat, "CIA_OVERRIDE_SOURCE", "0" * 64)
        compat.cia_override_matches.cache_clear()
        with compat.cia_overrides_by_dict():
            assert exported_program._override_composite_implicit_decomp is original
    compat.cia_override_matches.cache_clear()
    if not compat.cia_override_matches():
        pytest.skip("this torch's _override_composite_implicit_decomp is not the one "
                    "cia_overrides_by_dict was checked against (torch 2.13's): torch's runs")
    with compat.decompositions_sped_up():
        cia, _ = compat.decomposition_split(REGISTRY.onnx_registry(None))
    # both of its paths: ops with kernels of their own (torch's steps) and without
    assert any(op.py_kernels for op in cia) and any(not op.py_kernels for op in cia)
    with exported_program._override_composite_implicit_decomp(cia):
        pass  # torch's exit drops fake-tensor rules an op had before (both do): settled
    before = _state(cia)
    with exported_program._override_composite_implicit_decomp(cia):
        torchs = _state(cia)
    assert _state(cia) == before
    with compat.cia_overrides_by_dict():
        assert exported_program._override_composite_implicit_decomp is compat.cia_overridden
        with exported_program._override_composite_implicit_decomp(cia):
            ours = _state(cia)
    assert _state(cia) == before
    assert ours == torchs and ours != before
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    assert all(ours[op][0][key] == _kernel_kind(fn) for op, fn in cia.items())
