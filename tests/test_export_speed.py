"""_torch_compat.cia_ops_materialized_once: torch.export's collection of the
CompositeImplicitAutograd ops gives the same set with the dispatcher's list materialised once
per collection (not once per ``torch.ops`` namespace), sees an op registered between two
collections, and leaves torch's functions as they were after the block."""

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
