"""_torch_compat.decompositions_sped_up, the work torch.export's run_decompositions repeats for
nothing, left out: its collection of the CompositeImplicitAutograd ops gives the same set with
the dispatcher's list materialised once per collection (not once per ``torch.ops`` namespace)
and sees an op registered between two collections; ``py_impl`` decorators kept per (op, key)
give the same program and kernels; torch's functions are as they were after the block."""

from __future__ import annotations

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
